"""The policy: pick the chunk size and the smallest residency that meet a latency target in a memory budget.

Candidates are chunk sizes from 4 MB to 256 MB and, for each, residencies in chunk-sized steps
(k / n, n = chunks of the largest block). Among the points whose predicted step time meets the target
and whose predicted peak memory (plus the runtime margin) fits the budget, the policy takes the smallest
residency, then the shortest step time, then the smallest memory. If the model fits without offload,
offload would only cost time: the plan is `none`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.memory import MemoryEstimate, block_volumes, estimate_memory, runtime_need
from chunkflow_planner.offload import DEFAULT_CHUNK_BYTES, OffloadConfig
from chunkflow_planner.steptime import StepTime, step_time

MB = 10**6
CHUNK_CANDIDATES = tuple(c * MB for c in (4, 8, 16, 32, 64, 128, 256))


class Infeasible(ChunkflowError):
    """No configuration meets the target inside the budget; says which constraint binds and how close we got."""

    def __init__(self, binding: str, message: str, min_memory: int, best_step_time: float | None) -> None:
        super().__init__(message)
        self.binding = binding
        self.min_memory = min_memory
        self.best_step_time = best_step_time


@dataclass(frozen=True)
class Point:
    """One evaluated configuration."""

    cfg: OffloadConfig
    time: StepTime
    memory: MemoryEstimate

    @property
    def step_time(self) -> float:
        return self.time.total

    @property
    def need(self) -> int:
        """Memory the GPU must have (peak plus runtime margin)."""
        return runtime_need(self.memory.peak)


@dataclass(frozen=True)
class Decision:
    chosen: Point
    none: Point
    layerwise: Point
    target_s: float
    budget: int
    reason: str


@dataclass(frozen=True)
class Problem:
    """Everything the prediction depends on, evaluated point by point."""

    spec: ModelSpec
    workload: Workload
    hw: HardwareSpec
    sp: int = 1
    prefetch_bytes: float | None = None
    text_len: float | None = None
    comm_aware: bool | None = None  # pace chunk copies around collectives; None: as the hardware's link says

    @property
    def aware(self) -> bool:
        return self.hw.pace_collectives if self.comm_aware is None else self.comm_aware

    def evaluate(self, cfg: OffloadConfig) -> Point:
        t = step_time(self.spec, self.workload, self.hw, cfg, self.sp, self.prefetch_bytes, self.text_len)
        m = estimate_memory(self.spec, self.workload, cfg, self.sp)
        return Point(cfg, t, m)


def residency_grid(spec: ModelSpec, chunk_bytes: int) -> list[float]:
    """Residencies in chunk-sized steps: k / n for k = 0..n, n = chunks in the largest block."""
    n = max(1, math.ceil(max(block_volumes(spec)) / chunk_bytes))
    return [k / n for k in range(n + 1)]


def candidates(problem: Problem, chunk_sizes: tuple[int, ...] = CHUNK_CANDIDATES) -> list[Point]:
    """Every chunkflow point of the design space (chunk size x residency)."""
    aware = problem.aware
    return [
        problem.evaluate(OffloadConfig("chunkflow", C, r, comm_aware=aware))
        for C in chunk_sizes
        for r in residency_grid(problem.spec, C)
    ]


def chunk_tie(p: Point) -> float:
    """Distance of a point's chunk size from the paper's 16 MB operating point (the tie-break)."""
    return abs(math.log2((p.cfg.chunk_bytes or DEFAULT_CHUNK_BYTES) / DEFAULT_CHUNK_BYTES))


def best_chunk(problem: Problem, residency: float = 0.0, chunk_sizes: tuple[int, ...] = CHUNK_CANDIDATES) -> Point:
    """The planner's chunk size at a fixed residency: shortest predicted step, ties to the one nearest 16 MB."""
    aware = problem.aware
    pts = [problem.evaluate(OffloadConfig("chunkflow", C, residency, comm_aware=aware)) for C in chunk_sizes]
    return min(pts, key=lambda p: (p.step_time, p.memory.peak, chunk_tie(p)))


def decide(
    problem: Problem,
    budget: int,
    max_slowdown: float | None = 1.05,
    target_step_time: float | None = None,
    chunk_sizes: tuple[int, ...] = CHUNK_CANDIDATES,
) -> Decision:
    """Choose the plan for `problem` under a memory budget (bytes) and a latency target; raise Infeasible if none."""
    none = problem.evaluate(OffloadConfig("none"))
    layerwise = problem.evaluate(OffloadConfig("layerwise"))
    target = target_step_time if target_step_time is not None else none.step_time * (max_slowdown or 1.05)
    target_text = f"{target:.3f} s" + (f" ({max_slowdown:.2f}x no offload)" if target_step_time is None else "")

    if none.need <= budget:
        return Decision(
            none, none, layerwise, target, budget,
            f"the model fits without offload (needs {none.need / 1e9:.1f} GB of {budget / 1e9:.1f} GB): "
            f"offload would only cost time (layerwise {layerwise.step_time / none.step_time:.2f}x)",
        )

    points = candidates(problem, chunk_sizes)
    in_budget = [p for p in points if p.need <= budget]
    feasible = [p for p in in_budget if p.step_time <= target]
    if feasible:
        # ties (compute hides every chunk size) go to the chunk size nearest the paper's 16 MB operating point
        best = min(feasible, key=lambda p: (p.cfg.residency, p.step_time, p.memory.peak, chunk_tie(p)))
        slow = best.step_time / none.step_time
        if best.cfg.residency == 0:
            tied = [p for p in feasible if p.cfg.residency == 0 and p.step_time == best.step_time]
            why = (
                f"full offload already meets the target ({slow:.3f}x no offload, target {target_text}); "
                + (f"every chunk size hides, so {best.cfg.chunk_bytes // 10**6} MB (the paper's operating point)"
                   if len(tied) > 1 else f"{best.cfg.chunk_bytes // 10**6} MB chunks give the shortest step")
            )
        else:
            why = (
                f"the smallest residency that meets {target_text} inside {budget / 1e9:.1f} GB: "
                f"{best.cfg.residency:.0%} resident, {slow:.3f}x no offload"
            )
        return Decision(best, none, layerwise, target, budget, why)

    min_need = min(p.need for p in points)
    if not in_budget:
        raise Infeasible(
            "memory",
            f"memory is the binding constraint: even full offload needs {min_need / 1e9:.2f} GB "
            f"(peak plus runtime margin) and the budget is {budget / 1e9:.2f} GB. Raise --mem-budget, or "
            "shrink the workload (fewer frames, smaller batch or resolution) or raise --sp.",
            min_need, None,
        )
    best_in_budget = min(in_budget, key=lambda p: p.step_time)
    raise Infeasible(
        "latency",
        f"latency is the binding constraint: the fastest plan inside {budget / 1e9:.2f} GB takes "
        f"{best_in_budget.step_time:.3f} s per step "
        f"(residency {best_in_budget.cfg.residency:.0%}, {best_in_budget.cfg.chunk_bytes // 10**6} MB chunks), "
        f"above the target {target_text}. The smallest memory any plan needs is {min_need / 1e9:.2f} GB. "
        "Raise --mem-budget or relax --max-slowdown / --target-step-time.",
        min_need, best_in_budget.step_time,
    )
