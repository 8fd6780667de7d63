"""Tables for docs/levers.md from what `scripts/gpu_h200_levers.sh` leaves (a `levers/` directory of run reports,
final latents, plans and two bench sweeps): every measured point with the planner's prediction next to it, the
batched-CFG difference against the unbatched run, and the measured crossover frame count in bf16 and fp8.

    python3 scripts/levers_doc.py docs/data/h200-levers > tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = [  # (report stem suffix, what it is)
    ("none", "no offload"),
    ("none-batched", "no offload, batched CFG"),
    ("r0", "chunkflow r=0"),
    ("planner-off", "chunkflow, the planner without the levers"),
    ("r0-batched", "chunkflow r=0, batched CFG"),
    ("r0-fp8", "chunkflow r=0, fp8 storage"),
    ("planner-on", "chunkflow, the planner with the levers (--allow-fp8)"),
]


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def _row(what: str, rep: dict, base: float | None) -> str:
    m, p, o = rep["measured"], rep["predicted"], rep["run"]["offload"]
    step, pred = m["median_step_s"], p["step_time_s"]
    setting = (f"{o['mode']} r={o['residency']:.2f}" + (" batched" if o.get("cfg_batched") else "")
               + (" fp8" if o.get("weight_dtype", "bf16") != "bf16" else ""))
    vs = f"{step / base:.3f}x" if base else "-"
    mem = m.get("peak_allocated_bytes")  # the quantity the step model predicts (allocated, not reserved)
    return (f"| {what} | {setting} | {step * 1e3:.1f} ms | {pred * 1e3:.1f} ms | {(step - pred) / pred:+.1%} | {vs} | "
            f"{_gb(mem)} | {_gb(p['peak_memory_bytes'])} | {_gb(m.get('pinned_host_bytes'))} |")


def _latents(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path))["latents"].float() if path.exists() else None


def runs_table(d: Path, frames: str) -> list[str]:
    reports = {k: json.loads((d / f"wan-{frames}-{k}.json").read_text())
               for k, _ in RUNS if (d / f"wan-{frames}-{k}.json").exists()}
    if not reports:
        return [f"(no runs at {frames} frames)"]
    none = {False: reports.get("none"), True: reports.get("none-batched")}
    out = ["| run | setting | step measured | predicted | error | vs no offload run the same way | "
           "peak allocated | predicted | pinned |", "|---|---|---|---|---|---|---|---|---|"]
    for key, what in RUNS:
        rep = reports.get(key)
        if rep is None:
            out.append(f"| {what} | not run | | | | | | | |")
            continue
        ref = none[bool(rep["run"]["offload"].get("cfg_batched"))]
        out.append(_row(what, rep, ref["measured"]["median_step_s"] if ref else None))
    return out


def batched_difference(d: Path, frames: str) -> list[str]:
    lines = []
    for a, b in (("none", "none-batched"), ("r0", "r0-batched")):
        za, zb = _latents(d / f"wan-{frames}-{a}.safetensors"), _latents(d / f"wan-{frames}-{b}.safetensors")
        if za is None or zb is None:
            continue
        rel = float((za - zb).abs().max() / za.abs().max())
        lines.append(f"- {frames} frames, {b} against {a}: largest difference {rel:.2e} of the largest magnitude"
                     + (" (bit-identical)" if rel == 0 else ""))
    return lines


def crossover(d: Path) -> list[str]:
    import pandas as pd

    out = []
    for dtype in ("bf16", "fp8_e4m3"):
        csv = d / f"crossover-{dtype}" / "bench.csv"
        if not csv.exists():
            out.append(f"- {dtype}: no sweep")
            continue
        df = pd.read_csv(csv)
        none = df[df["mode"] == "none"].set_index("value")["measured_step_s"]
        cf = df[df["mode"] == "chunkflow"].set_index("value")
        ratio = (cf["measured_step_s"] / none).dropna()
        values = sorted(ratio.index)
        hidden = [int(v) for i, v in enumerate(values) if all(ratio[u] <= 1.05 for u in values[i:])]
        crit = cf["critical"].dropna()
        pred = f"{crit.iloc[0]:.1f}" if len(crit) else "-"
        pairs = ", ".join(f"{int(v)}: {r:.3f}x" for v, r in ratio.items())
        within = f"from {hidden[0]} frames on" if hidden else "at none of them"
        out.append(f"- {dtype}: chunkflow r=0 / no offload by frames: {pairs}; within 1.05x {within}; predicted "
                   f"critical frames {pred}")
    return out


def main(d: Path) -> None:
    lines: list[str] = []
    for frames in sorted({p.name.split("-")[1] for p in d.glob("wan-*-none.json")}, key=int):
        lines += [f"### Wan2.2-TI2V-5B, 480x832, {frames} frames", ""] + runs_table(d, frames) + [""]
        lines += batched_difference(d, frames) + [""]
    lines += ["### Crossover (one pass a step, r = 0)", ""] + crossover(d) + [""]
    for name, what in (("qwen-planned", "Qwen-Image 1328x1328, planned at 1.10x in 24 GB"),):
        f = d / f"{name}.json"
        if f.exists():
            rep = json.loads(f.read_text())
            base = json.loads((d / "qwen-none-batched.json").read_text())["measured"]["median_step_s"] \
                if (d / "qwen-none-batched.json").exists() else None
            lines += [f"### {what}", "", "| run | setting | step measured | predicted | error | vs no offload | "
                      "peak allocated | predicted | pinned |", "|---|---|---|---|---|---|---|---|---|",
                      _row("planned", rep, base), ""]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
