"""Tables for docs/levers.md from what `docs/data/h200-levers/gpu_h200_levers.sh` leaves (a `levers/` directory of run reports,
final latents, plans and two bench sweeps): every measured point with the planner's prediction next to it, the
batched-CFG difference against the unbatched run, and the measured crossover frame count in bf16 and fp8.

    python3 scripts/levers_doc.py docs/data/h200-levers [MORE_DIRS_WITH_CROSSOVER_SWEEPS ...] > tables.md
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


def crossover(dirs: list[Path]) -> list[str]:
    """Every `crossover-*` bench sweep in `dirs`: chunkflow r=0 against no offload by frames, where that ratio stays
    within 1.05x, and where the measured prefetch stall stays under 2% of the step (the copies hide: the crossover
    the planner predicts; fp8's cast is compute, not stall)."""
    import pandas as pd

    out = []
    for csv in sorted(p for d in dirs for p in d.glob("crossover-*/bench.csv")):
        df = pd.read_csv(csv)
        none = df[df["mode"] == "none"].set_index("value")["measured_step_s"]
        cf = df[df["mode"] == "chunkflow"].set_index("value")
        ratio = (cf["measured_step_s"] / none).dropna()
        stall = (cf["prefetch_stall_s"] / cf["measured_step_s"]).dropna()
        values = sorted(ratio.index)

        def first_from(ok) -> str:
            good = [int(v) for i, v in enumerate(values) if all(ok(u) for u in values[i:])]
            return f"from {good[0]} frames on" if good else "at none of them"

        crit = cf["critical"].dropna()
        pred = f"{crit.iloc[0]:.1f}" if len(crit) else "-"
        pairs = ", ".join(f"{int(v)}: {r:.3f}x" for v, r in ratio.items())
        stalls = ", ".join(f"{int(v)}: {x:.0%}" for v, x in stall.items())
        out.append(f"- {csv.parent.name}: chunkflow r=0 / no offload by frames: {pairs}; within 1.05x "
                   f"{first_from(lambda u: ratio[u] <= 1.05)}. Prefetch stall / step: {stalls}; under 2% "
                   f"{first_from(lambda u: stall[u] < 0.02)}; predicted critical frames {pred}")
    return out


QWEN_PLANS = (("qwen-planned", "planned"), ("qwen-planned-fp8", "planned, fp8 allowed"),
              ("qwen-planned-fp8-torchcast", "the fp8 plan, cast by PyTorch's copy kernel (CHUNKFLOW_FP8_CAST=torch)"),
              ("qwen-planned-nomargin", "planned without the memory margin"))


QWEN_SAME = (("qwen-planned", "qwen-none"), ("qwen-planned", "qwen-none-batched"), ("qwen-planned-nomargin", "qwen-none"),
             ("qwen-planned-fp8", "qwen-planned-fp8-torchcast"), ("qwen-planned-fp8", "qwen-none"))


def qwen_latents(d: Path) -> list[str]:
    """The final latents of Qwen-Image runs against each other (where both were kept): bf16 offload against no
    offload, the fp8 plan with either cast kernel, fp8 against bf16 (lossy: the size of the difference)."""
    out = []
    for a, b in QWEN_SAME:
        za, zb = _latents(d / f"{a}.safetensors"), _latents(d / f"{b}.safetensors")
        if za is None or zb is None:
            continue
        rel = float((za - zb).norm() / zb.norm())
        out.append(f"- latents of {a} against {b}: " + ("bit-identical" if bool((za == zb).all())
                                                         else f"relative difference {rel:.3g}"))
    return out


def _verdict(d: Path, run: str) -> str:
    """What `chunkflow plan` said for the plan of `run` (its log), where it wrote none."""
    log = d / run.replace("planned", "plan").join(("", ".log"))
    if not log.exists():
        return "no plan log"
    text = " ".join(log.read_text().split())
    return text.split("infeasible: ")[1].split(". ")[0] if "infeasible: " in text else "no plan written"


def main(d: Path, more: list[Path]) -> None:
    lines: list[str] = []
    for frames in sorted({p.name.split("-")[1] for p in d.glob("wan-*-none.json")}, key=int):
        lines += [f"### Wan2.2-TI2V-5B, 480x832, {frames} frames", ""] + runs_table(d, frames) + [""]
        lines += batched_difference(d, frames) + [""]
    lines += ["### Crossover (one pass a step, r = 0)", ""] + crossover([d, *more]) + [""]
    plans = [(n, label) for n, label in QWEN_PLANS if (d / f"{n}.json").exists()]
    refs = [r for r in ("qwen-none", "qwen-none-batched") if (d / f"{r}.json").exists()]
    if plans or refs:
        # --max-slowdown bounds a plan by the fastest no-offload setting, batched or not: so is each run measured
        fastest = min((json.loads((d / f"{r}.json").read_text())["measured"]["median_step_s"] for r in refs),
                      default=None)
        lines += ["### Qwen-Image 1328x1328, planned at 1.10x in 24 GB", "", "| run | setting | step measured | predicted | "
                  "error | vs the fastest no offload | peak allocated | predicted | pinned |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for ref in refs:
            r = json.loads((d / f"{ref}.json").read_text())
            lines.append(_row(f"no offload{', batched CFG' if 'batched' in ref else ''}", r, fastest))
        for name, label in plans:
            lines.append(_row(label, json.loads((d / f"{name}.json").read_text()), fastest))
        lines += [""] + qwen_latents(d)
        missing = [label for n, label in QWEN_PLANS if not (d / f"{n}.json").exists()]
        if missing:  # a plan the planner found infeasible has no run: say so, with its log's verdict
            lines.append("")
            lines += [f"- {label}: not run ({_verdict(d, n)})" for n, label in QWEN_PLANS
                      if label in missing and "torchcast" not in n]
        lines.append("")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
