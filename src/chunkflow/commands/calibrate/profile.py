"""The hardware profile calibrate writes: its base catalog entry, the measured fields laid over it, its YAML, and what
changed against the profile saved before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from chunkflow.commands.calibrate.fit import H2DFit, summary_eta
from chunkflow_planner.catalog import HardwareSpec, get_hardware, load_hardware


def base_hardware(device_name: str, world: int = 1, base: str | None = None) -> tuple[HardwareSpec, str]:
    """The catalog entry whose unmeasured fields the profile inherits: `base`, else one matching the GPU name."""
    if base:
        return get_hardware(base), f"base {base} (as asked)"
    name = device_name.lower().replace("nvidia", "").replace("geforce", "").strip()
    hits = [hw for hw in load_hardware().values() if hw.name.split("-")[0] in name.replace(" ", "-").split("-")
            or hw.name.split("-")[0] in name.replace(" ", "")]
    if "pcie" not in name:
        hits = [h for h in hits if "pcie" not in h.name] or hits
    if hits:
        best = sorted(hits, key=lambda h: (h.gpus != world, h.gpus))[0]
        return best, f"base {best.name} (catalog match for {device_name!r})"
    return get_hardware("h200"), f"base h200 (no catalog match for {device_name!r}: unmeasured fields are h200's)"


def make_profile(base: HardwareSpec, *, name: str, peak_tflops: float, gemm_tflops: float | None,
                 curve: list[tuple[float, float]], h2d: H2DFit, memory_bytes: int | None = None, gpus: int | None = None,
                 coll_gbps: float | None = None, contention: float | None = None, peer_link: str | None = None,
                 source: str = "") -> HardwareSpec:
    """A HardwareSpec: the base entry with every measured field replaced (see the module docstring)."""
    update: dict[str, Any] = dict(
        name=name, description=f"calibrated by chunkflow calibrate ({base.name} base)", peak_tflops=peak_tflops,
        gemm_tflops=gemm_tflops, eta_comp_curve=[(float(f), float(e)) for f, e in curve],
        eta_comp=summary_eta(curve), h2d_link_gbps=h2d.bw_Bps / 1e9 * 1.0, eta_pref=1.0,
        dma_startup_us=h2d.t0_s * 1e6, source=source,
    )
    for key, value in (("memory_bytes", memory_bytes), ("gpus", gpus), ("coll_gbps", coll_gbps),
                       ("contention", contention), ("peer_link", peer_link)):
        if value is not None:
            update[key] = value
    if gpus is not None and gpus > 1:
        update["gpus_per_host_link"] = base.gpus_per_host_link
    return HardwareSpec(**{**base.model_dump(), **update})


def profile_yaml(hw: HardwareSpec, header: str = "") -> str:
    lines = ["# chunkflow hardware profile (HardwareSpec); `chunkflow plan --hardware THIS_FILE` reads it."]
    lines += [f"# {h}" for h in header.splitlines() if h]
    return "\n".join(lines) + "\n" + yaml.safe_dump(hw.model_dump(mode="json"), sort_keys=False)


def write_profile(hw: HardwareSpec, path: str | Path, header: str = "") -> Path:
    """The profile as YAML at `path`, written atomically (its directory is created if missing)."""
    from chunkflow_planner.files import write_atomic

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, profile_yaml(hw, header))


PROFILE_FIELDS = ("peak_tflops", "gemm_tflops", "eta_comp", "h2d_link_gbps", "dma_startup_us", "eta_pref", "coll_gbps",
                  "contention", "block_overhead_us", "memory_bytes", "peer_link", "startup_s", "encode_host_s",
                  "host_margin", "postprocess_gbps", "alloc_slack", "reserve_fraction", "mem_margin")


def profile_changes(old: HardwareSpec, new: HardwareSpec) -> list[str]:
    """`field old -> new` for every summary field that differs, and whether the eta_comp curves changed."""
    out = [f"{k} {old.figure(k)!r} -> {new.figure(k)!r}" for k in PROFILE_FIELDS if old.figure(k) != new.figure(k)]
    if old.eta_comp_curves != new.eta_comp_curves or old.eta_comp_curve != new.eta_comp_curve:
        out.append("eta_comp curves changed")
    out += [f"VAE {name}{how}: allocator slack {a!r} -> {b!r}" for name, how, a, b in _vae_slacks(old, new) if a != b]
    return out or ["none"]


def _vae_slacks(old: HardwareSpec, new: HardwareSpec) -> list[tuple[str, str, float | None, float | None]]:
    """(VAE, '' or ' (tiled)', old slack, new slack) of each VAE decode fit in `new` (VaeDecodeFit.alloc_slack)."""
    out = []
    for name, fit in sorted(new.pipeline.vae_decode.items()):
        was = old.pipeline.vae_decode.get(name)
        out.append((name, "", was.alloc_slack if was else None, fit.alloc_slack))
        if fit.tiled is not None:
            out.append((name, " (tiled)", was.tiled.alloc_slack if was and was.tiled else None, fit.tiled.alloc_slack))
    return out
