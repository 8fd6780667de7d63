"""What the planner would pick at the sweep's workloads, to mark on the plots and check in the summary."""

from __future__ import annotations

from dataclasses import dataclass

from chunkflow.commands.bench.sweep import BenchSpec
from chunkflow_planner.catalog import HardwareSpec, ModelSpec
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.policy import Infeasible, Problem, best_chunk, decide

MAX_SLOWDOWN = 1.05


@dataclass(frozen=True)
class PlannerChoice:
    chunk_bytes: int | None  # at the chunk sweep's workload and the scaling residency, among the swept sizes
    # both picks assume the sweep's communication awareness (bench.comm_aware), so they match what was measured
    residency: float | None  # smallest meeting MAX_SLOWDOWN x none when offload is forced (None: no such plan)
    residency_reason: str


def planner_choice(spec: ModelSpec, bench: BenchSpec, hw: HardwareSpec, sp: int) -> PlannerChoice:
    """The planner's chunk size (figure 5) and residency (figure 6) for this sweep."""
    chunk = None
    if bench.has_chunk_sweep:
        p = Problem(spec, bench.workload(spec, bench.chunk_value), hw, sp, comm_aware=bench.comm_aware)
        chunk = best_chunk(p, bench.residency, tuple(bench.chunk_sizes)).cfg.chunk_bytes
    p = Problem(spec, bench.workload(spec, bench.residency_value), hw, sp, comm_aware=bench.comm_aware)
    none_need = p.evaluate(OffloadConfig("none")).need
    try:  # a budget just under no offload's need forces the planner to offload and pick a residency
        d = decide(p, none_need - 1, MAX_SLOWDOWN, chunk_sizes=(bench.chunk,))
        return PlannerChoice(chunk, d.chosen.cfg.residency, d.reason)
    except Infeasible as exc:
        return PlannerChoice(chunk, None, str(exc))
