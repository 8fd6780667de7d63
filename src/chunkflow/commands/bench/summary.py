"""summary.md of a sweep: the tables behind the plots, the planner's picks against the measured best, and the
planner's accuracy (median and worst relative error)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from chunkflow.commands.bench.choices import PlannerChoice
from chunkflow.commands.bench.sweep import BenchMeta, row_label
from chunkflow_planner.units import short_bytes

CHUNK_TOLERANCE = 0.05  # the planner's chunk size should be within 5% of the best measured (issue 6)


@dataclass(frozen=True)
class ErrorStats:
    n: int
    median_abs: float
    worst: float  # signed, the largest in magnitude

    def text(self) -> str:
        return f"median |error| {self.median_abs:.1%}, worst {self.worst:+.1%} (n={self.n})" if self.n else "not measured"


def error_stats(errors) -> ErrorStats:
    xs = [float(e) for e in errors if e == e and e is not None]
    if not xs:
        return ErrorStats(0, float("nan"), float("nan"))
    return ErrorStats(len(xs), statistics.median(abs(e) for e in xs), max(xs, key=abs))


@dataclass(frozen=True)
class ChunkVerdict:
    best_bytes: int
    best_s: float
    chosen_bytes: int
    chosen_s: float

    @property
    def gap(self) -> float:
        return self.chosen_s / self.best_s - 1

    @property
    def within(self) -> bool:
        return self.gap <= CHUNK_TOLERANCE


def chunk_verdict(df, meta: BenchMeta, choice: PlannerChoice) -> ChunkVerdict | None:
    """The planner's chunk size against the best measured one at the chunk sweep's workload."""
    b = meta.spec
    if not b.has_chunk_sweep or choice.chunk_bytes is None:
        return None
    rows = df[(df["mode"] == "chunkflow") & (df["value"] == b.chunk_value) & ((df["residency"] - b.residency).abs() < 1e-9)]
    if not len(rows):
        return None
    best = rows.loc[rows["measured_step_s"].idxmin()]
    chosen = rows[rows["chunk_bytes"] == choice.chunk_bytes]
    if not len(chosen):
        return None
    return ChunkVerdict(int(best["chunk_bytes"]), float(best["measured_step_s"]), choice.chunk_bytes,
                        float(chosen["measured_step_s"].iloc[0]))


def _gb(x) -> str:
    return "-" if x is None or x != x else f"{float(x) / 1e9:.2f}"


def _ms(x) -> str:
    return "-" if x != x or x is None else f"{1e3 * float(x):.1f}"


def _pct(x) -> str:
    return "-" if x != x or x is None else f"{float(x):+.1%}"


def summary_markdown(df, meta: BenchMeta, choice: PlannerChoice) -> str:
    b = meta.spec
    none = {int(r["value"]): float(r["measured_step_s"]) for _, r in df[df["mode"] == "none"].iterrows()}

    def vs_none(r) -> str:
        n = none.get(int(r["value"]))
        return f"{r['measured_step_s'] / n:.3f}" if n else "-"

    def label(r) -> str:
        dtype, cast = r.get("weight_dtype", "bf16"), r.get("fp8_cast", "compute")
        return row_label(r["mode"], r["chunk_bytes"], r["residency"], dtype if isinstance(dtype, str) else "bf16",
                         cast if isinstance(cast, str) else "compute")

    out = [f"# chunkflow bench: {b.model}", "",
           f"- GPU: {meta.gpu}, SP={meta.sp}, env {meta.env}; torch {meta.torch}, diffusers {meta.diffusers}",
           f"- chunkflow paces chunk copies around collectives (communication awareness): {b.comm_aware}",
           f"- date: {meta.date}; command: `{meta.command}`",
           f"- predictions: hardware profile `{meta.hardware.get('name')}`; {b.warmup} warm-up + {b.steps} timed "
           "steps per point (median), one forward per step, random bf16 weights",
           f"- torch.compile: {b.compile}" + (" (repeated blocks compiled before offload; the predictions are for "
                                              "eager execution)" if b.compile != "off" else ""),
           ""]
    out += ["## Every point", "",
            "| " + b.axis + " | config | step ms | x none | predicted ms | error | peak GB | predicted GB | error "
            "| compute | collective | prefetch stall | overhead | pinned GB | host RSS GB | bit-identical |",
            "|" + "---|" * 16]
    step_errors, peak_errors = error_stats(df["err_step"]), error_stats(df["err_peak"])
    compared = step_errors.n > 0  # else measured on another kind of device than the profile predicts for
    for _, r in df.iterrows():
        out.append(f"| {r['value']} | {label(r)} | {_ms(r['measured_step_s'])} | {vs_none(r)} | "
                   f"{_ms(r['predicted_step_s']) if compared else '-'} | {_pct(r['err_step'])} | "
                   f"{_gb(r['measured_peak_bytes'])} | "
                   f"{_gb(r['predicted_peak_bytes']) if compared else '-'} | {_pct(r['err_peak'])} | {_ms(r['compute_s'])} | "
                   f"{_ms(r['collective_s'])} | {_ms(r['prefetch_stall_s'])} | {_ms(r['overhead_s'])} | "
                   f"{_gb(r['pinned_bytes'])} | {_gb(r['host_rss_bytes'])} | {r['bit_identical']} |")
    out += ["", "## Planner accuracy", "",
            f"- step time: {step_errors.text()}" if compared else
            (f"- step time: not compared: the profile `cpu`'s times are nominal figures, not predictions"
             if meta.hardware.get("device_is_host") else
             f"- step time: not compared: measured on {meta.gpu}, predicted for the profile "
             f"`{meta.hardware.get('name')}` (on a GPU, with that GPU's profile, it is)"),
            f"- peak memory: {peak_errors.text()}" if peak_errors.n else "- peak memory: not measured (no GPU)", ""]
    crit = df["critical"].dropna()
    if len(crit):
        out += [f"Predicted critical point (F_block = F*): {float(crit.iloc[0]):.1f} {b.axis}; regime per point in "
                "bench.csv.", ""]
    v = chunk_verdict(df, meta, choice)
    if v is not None:
        out += ["## Chunk size", "",
                f"At {b.chunk_value} {b.axis}: best measured {short_bytes(v.best_bytes)} ({_ms(v.best_s)} ms); "
                f"the planner picks {short_bytes(v.chosen_bytes)} ({_ms(v.chosen_s)} ms, {v.gap:+.1%}): "
                + ("within" if v.within else "NOT within") + f" {CHUNK_TOLERANCE:.0%} of the best.", ""]
    if b.has_residency_sweep:
        r = "none (no residency meets the target)" if choice.residency is None else f"{choice.residency:.2f}"
        out += ["## Residency", "", f"At {b.residency_value} {b.axis}, the planner's smallest residency for <= 1.05x "
                f"no offload (offload forced): {r}. {choice.residency_reason}", ""]
    return "\n".join(out) + "\n"
