"""Write VAE decode fits into models.yaml (each VAE's `decode:` block), naming where they were measured: the
catalog's fits are the ones `chunkflow calibrate` measured on the GPU the source names. From a profile (its fits as
calibrate made them) or from a calibration.json (`--raw`: its decode rows fitted again with this checkout's fit).

    python3 scripts/catalog_decode_fits.py PROFILE.yaml "scripts/...sh; docs/data/.../calibration.json"
    python3 scripts/catalog_decode_fits.py calibration.json "..."     # refit from the measured rows
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _fields(fit: dict) -> list[tuple[str, float]]:
    keys = ["mem_const", "mem_per_px", "mem_per_voxel", "time_const", "time_per_voxel", "time_per_call"]
    return [(k, fit[k]) for k in keys if k in fit and not (k.startswith("time_per") and not fit[k])]


def decode_block(fit: dict, where: str, indent: str) -> str:
    """The `decode:` block of one VAE in models.yaml's style."""
    lines = [f"{indent}decode:"]
    lines += [f"{indent}  {k}: {v:.6g}" for k, v in _fields(fit)]
    lines.append(f"{indent}  source: '{fit['source']} ({where})'")
    t = fit.get("tiled")
    if t:
        inner = ", ".join(f"{k}: {v:.6g}" for k, v in _fields(t))
        lines.append(f"{indent}  tiled: {{{inner},")
        lines.append(f"{indent}    source: '{t['source']} ({where})'}}")
    return "\n".join(lines)


def refit_rows(raw: dict) -> dict:
    """VaeDecodeFits (dicts) of every VAE in a calibration.json, fitted as `chunkflow calibrate` fits them now."""
    from chunkflow.commands.calibrate.fit import fit_vae_rows
    from chunkflow.commands.calibrate.measure import vae_owners

    owners = vae_owners()
    date = raw["date"]
    fits = {}
    for name in dict.fromkeys(r["vae"] for r in raw["vae"]):
        rows = [r for r in raw["vae"] if r["vae"] == name]
        plain, tiled = [r for r in rows if not r["tiled"]], [r for r in rows if r["tiled"]]
        fits[name] = fit_vae_rows(owners[name], plain, tiled, f"chunkflow calibrate {date} on {raw['device']}: "
                                  f"{len(plain)} decodes")
    return fits


def main(source: str, where: str) -> None:
    from chunkflow_planner.catalog import load_models

    data = yaml.safe_load(Path(source).read_text())  # JSON is YAML
    fits = refit_rows(data) if "vae" in data else data["vae_decode"]
    path = ROOT / "models.yaml"
    text = path.read_text()
    for name, fit in fits.items():
        # every model whose VAE is `name`: its decode block runs from `decode:` to the line closing `tiled: {...}`
        # the VAE's own mapping: from its `name:` line to its `decode:` block, never past a line indented less
        pat = re.compile(r"(^( +)name: %s\n(?:\2.*\n)*?)\2decode:\n(?:\2  .*\n)+" % re.escape(name), re.M)
        text, n = pat.subn(lambda m: m.group(1) + decode_block(fit, where, m.group(2)) + "\n", text)
        users = sum(1 for spec in load_models().values() if spec.pipeline and spec.pipeline.vae.name == name)
        if n != users:
            raise SystemExit(f"{name}: {users} model(s) use it but {n} decode block(s) matched; models.yaml unchanged")
        print(f"{name}: {n} model(s)")
    path.write_text(text)


if __name__ == "__main__":
    main(*sys.argv[1:3])
