"""Tables for docs/pipeline-h200.md from `chunkflow run --prompt` reports (docs/data/h200-pipeline/gpu_h200_pipeline.sh): per
phase the measured time and peak GPU memory against the plan, for the measured generation (after `--warmup`
generations: start-up excluded) and the process's first one (start-up included), and peak host memory.

    python3 scripts/pipeline_doc.py REPORT.json ...                      # against each report's own plan
    python3 scripts/pipeline_doc.py --profile P.yaml REPORT.json ...     # re-predicted with profile P

With --profile the plan's placements and offload are kept and every phase is predicted again on P (the model of
this checkout): to show what a refit profile predicts for the runs it was refit from (in-sample).
"""

from __future__ import annotations

import sys
from pathlib import Path

PHASES = ("encode", "denoise", "decode")


def _pct(m: float, p: float | None) -> str:
    return "-" if not p or m is None else f"{(m - p) / p:+.1%}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def _predictions(rep, profile):
    """phase -> (time of a later generation, time of the first, peak memory) and the host memory prediction."""
    from chunkflow.commands.run_generate import expected_time

    if profile is None:
        pp = rep.plan.prediction.phases
        out = {ph: (expected_time(getattr(pp, ph), warmup=1), getattr(pp, ph).time_s, getattr(pp, ph).peak_memory_bytes)
               for ph in PHASES}
        return out, rep.plan.prediction.host_memory_bytes
    from chunkflow.commands.calibrate.refit import generation_estimate

    e, _ = generation_estimate(rep, profile)
    out = {ph: (e.phases[ph].time_s - e.phases[ph].startup_s, e.phases[ph].time_s, e.peak_memory(ph)) for ph in PHASES}
    return out, e.host_memory


def table(paths: list[str], profile=None) -> list[str]:
    from chunkflow.reports import load_reports
    from chunkflow.commands.plan_tables import parts_text

    out = ["| pipeline | phase | measured | predicted | error | first generation | predicted | error | "
           "peak GPU memory | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    host, spread, parts = [], [], []
    for path in paths:
        rep = load_reports([path])[0]
        g = rep.generation
        w = rep.plan.workload
        name = (f"{rep.plan.model.name} {w.width}x{w.height}" + (f" x{w.frames}" if w.frames > 1 else "")
                + f", {g.steps} steps, {_gb(rep.plan.memory_budget_bytes)}")
        pred, host_pred = _predictions(rep, profile)
        warm = bool(g.warmup_generations)
        totals = [0.0, 0.0, 0.0, 0.0]
        for ph in PHASES:
            m = g.phases[ph]
            t_warm, t_first, mem = pred[ph]
            first = (g.first_phase_times_s or {}).get(ph) if warm else m.measured_time_s
            later = m.measured_time_s if warm else None
            totals = [totals[0] + (later or 0), totals[1] + t_warm, totals[2] + (first or 0), totals[3] + t_first]
            out.append(f"| {name} | {ph} | {f'{later:.3f} s' if later is not None else '-'} | {t_warm:.3f} s | "
                       f"{_pct(later, t_warm)} | {f'{first:.3f} s' if first is not None else '-'} | {t_first:.3f} s | "
                       f"{_pct(first, t_first)} | {_gb(m.measured_peak_memory_bytes)} | "
                       f"{_gb(mem)} | {_pct(m.measured_peak_memory_bytes, mem)} |")
        if warm:  # the median generation (with --repeat: not the sum of the phases' medians)
            totals[0] = g.generation_time_s
        out.append(f"| {name} | **generation** | {totals[0]:.3f} s | {totals[1]:.3f} s | {_pct(totals[0], totals[1])} | "
                   f"{totals[2]:.3f} s | {totals[3]:.3f} s | {_pct(totals[2], totals[3])} | | | |")
        host.append(f"- {name}: peak host memory {_gb(g.host_peak_bytes)}, predicted {_gb(host_pred)} "
                    f"({_pct(g.host_peak_bytes, host_pred)}); budget {_gb(rep.plan.host_memory_budget_bytes)}")
        if g.measured_generations > 1:  # --repeat: each phase's spread over the measured generations
            spread.append(f"- {name}: {g.measured_generations} generations measured (medians above); "
                          + "; ".join(f"{ph} {min(t):.3f}-{max(t):.3f} s" for ph, t in
                                      ((ph, g.phases[ph].measured_times_s) for ph in PHASES))
                          + f"; generation {min(g.generation_times_s):.3f}-{max(g.generation_times_s):.3f} s")
        enc = g.phases["encode"]
        if enc.parts_s:  # where the encode phase's time went (medians over the measured generations)
            first = (g.first_parts_s or {}).get("encode")
            parts.append(f"- {name}: encode " + _parts(enc) + ("" if not first else "; first generation: "
                                                              + parts_text(first, g.first_phase_times_s["encode"])))
    return out + [""] + host + ([""] + spread if spread else []) + ([""] + parts if parts else [])


def _parts(m) -> str:
    """A phase's measured components and the rest against the plan (as `chunkflow run` prints them), and its most
    time in the collector."""
    from chunkflow.commands.plan_tables import parts_line

    from chunkflow_planner.units import format_seconds

    gc = f", in the garbage collector {format_seconds(max(m.gc_s))} at most" if m.gc_s and max(m.gc_s) > 0 else ""
    return parts_line(m, gpu=True) + gc


def main(argv: list[str]) -> None:
    profile = None
    if argv[:1] == ["--profile"]:
        from chunkflow_planner.catalog import load_profile

        profile, argv = load_profile(argv[1]), argv[2:]
    print("\n".join(table([str(Path(p)) for p in argv], profile)))


if __name__ == "__main__":
    main(sys.argv[1:])
