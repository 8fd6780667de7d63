"""Write the VAE decode fits of a calibrated profile into models.yaml (each VAE's `decode:` block), naming where
they were measured: the catalog's fits are the ones `chunkflow calibrate` measured on the GPU the source names.

    python3 scripts/catalog_decode_fits.py PROFILE.yaml "scripts/...sh; docs/data/.../calibration.json"
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


def main(profile: str, where: str) -> None:
    fits = yaml.safe_load(Path(profile).read_text())["vae_decode"]
    path = ROOT / "models.yaml"
    text = path.read_text()
    for name, fit in fits.items():
        # every model whose VAE is `name`: its decode block runs from `decode:` to the line closing `tiled: {...}`
        pat = re.compile(r"(name: %s\n(?:(?!\n      [a-z_]+:)(?:.*\n))*?)( +)decode:\n(?:\2  .*\n)+" % re.escape(name))
        text, n = pat.subn(lambda m: m.group(1) + decode_block(fit, where, m.group(2)) + "\n", text)
        print(f"{name}: {n} model(s)")
    path.write_text(text)


if __name__ == "__main__":
    main(*sys.argv[1:3])
