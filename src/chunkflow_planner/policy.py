"""The policy: pick the chunk size and the smallest residency that meet a latency target in a memory budget.

Candidates are chunk sizes from 4 MB to 256 MB and, for each, residencies in chunk-sized steps
(k / n, n = chunks of the largest block). Among the points whose predicted step time meets the target
and whose predicted device memory (the peak allocation plus what the allocator holds and the CUDA context,
memory.device_need) fits the budget, the policy takes the smallest residency, then the shortest step time, then
the smallest memory. If the model fits without offload,
offload would only cost time: the plan is `none`.

Two levers widen the space below the critical point (`Levers`): batched CFG (the guidance passes of a step as one
forward, each block streamed once a step) where the model has two passes, and fp8 weight storage where the user
allows lossy storage. Every point is held to the same target, max_slowdown x the fastest way to run without offload
(batched or not, whichever is faster); among the feasible ones the policy still takes the smallest residency
first, and of equal residency bf16 before fp8 (exact before lossy), then the shortest step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.memory import (
    MemoryEstimate,
    block_volumes,
    estimate_memory,
    device_need,
)
from chunkflow_planner.offload import DEFAULT_CHUNK_BYTES, OffloadConfig
from chunkflow_planner.steptime import StepTime, step_time
from chunkflow_planner.units import format_bytes, format_seconds

CfgBatching = str  # "auto" | "on" | "off"

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
class MarginKept:
    """The user's GPU budget (`given` bytes) and the share of it a plan keeps free for the memory model's error: the
    budget the policy checks is given / (1 + margin). Messages name the budget through it."""

    given: int
    margin: float

    @property
    def usable(self) -> int:
        return int(self.given / (1 + self.margin))

    @property
    def _kept(self) -> str:
        return f"the {self.margin:.1%} kept for the memory model's error"

    def needed(self, need: float) -> str:
        """The budget a need takes with the margin, rounded up to the figure shown (two decimals of its unit)."""
        unit = next((u for u in (1e12, 1e9, 1e6, 1e3) if need * (1 + self.margin) >= u), 1.0)
        step = unit / 100 if unit > 1 else 1.0
        n = math.ceil(need * (1 + self.margin) / step - 1e-9) * step
        return f" With the margin, a --mem-budget of at least {format_bytes(n)} is needed (--mem-margin 0 plans to the byte)."


def budget_said(shown: str, kept: MarginKept | None, *, stated: bool = False, more: bool = False) -> str:
    """How a message names the budget it checked (`shown`, the usable bytes as the message formats them): as is
    without a margin; with one, `stated` (after "the budget is") as the user's budget with the usable part, else the
    usable part with the user's budget (`more`: the sentence goes on, so a comma closes the aside)."""
    if kept is None:
        return shown
    if stated:
        return f"{format_bytes(kept.given)} ({shown} after {kept._kept})"
    return f"{shown}, {format_bytes(kept.given)} less {kept._kept}" + ("," if more else "")


@dataclass(frozen=True)
class Point:
    """One evaluated configuration."""

    cfg: OffloadConfig
    time: StepTime
    memory: MemoryEstimate
    need: int  # device memory the GPU must have: memory.device_need of the peak on the problem's hardware

    @property
    def step_time(self) -> float:
        return self.time.total


@dataclass(frozen=True)
class Decision:
    chosen: Point
    none: Point
    layerwise: Point
    target_s: float
    budget: int
    reason: str


@dataclass(frozen=True)
class Levers:
    """Which CFG evaluations and weight storage dtypes the policy may choose among."""

    cfg_batched: tuple[bool, ...] = (False,)
    weight_dtypes: tuple[str, ...] = ("bf16",)

    @classmethod
    def of(cls, cfg_passes: int, cfg_batching: str = "auto", weight_dtype: str = "bf16",
           allow_fp8: bool = False) -> "Levers":
        """From the CLI's choices: `cfg_batching` auto|on|off (auto considers both where there are two passes);
        `weight_dtype` auto|bf16|fp8_e4m3 (auto considers fp8 only with `allow_fp8`)."""
        if cfg_batching not in ("auto", "on", "off"):
            raise ChunkflowError(f"--cfg-batching must be auto, on or off, got {cfg_batching!r}")
        if weight_dtype not in ("auto", "bf16", "fp8_e4m3"):
            raise ChunkflowError(f"--weight-dtype must be auto, bf16 or fp8_e4m3, got {weight_dtype!r}")
        if cfg_passes < 2 or cfg_batching == "off":
            batched: tuple[bool, ...] = (False,)
        else:
            batched = (True,) if cfg_batching == "on" else (False, True)
        if weight_dtype == "auto":
            dtypes: tuple[str, ...] = ("bf16", "fp8_e4m3") if allow_fp8 else ("bf16",)
        else:
            dtypes = (weight_dtype,)
        return cls(batched, dtypes)

    def combos(self) -> list[tuple[bool, str]]:
        """(cfg_batched, weight_dtype) pairs; fp8 is cast on the compute stream. The copy stream is not offered: its
        cast still takes the SMs (steptime.py), so it is never faster in the model and holds one more buffer
        (measured on an H200: 1-2% faster at best); `fp8_cast="copy"` stays a run option."""
        return [(b, d) for b in self.cfg_batched for d in self.weight_dtypes]


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
    levers: Levers = Levers()

    @property
    def aware(self) -> bool:
        return self.hw.pace_collectives if self.comm_aware is None else self.comm_aware

    def evaluate(self, cfg: OffloadConfig) -> Point:
        t = step_time(self.spec, self.workload, self.hw, cfg, self.sp, self.prefetch_bytes, self.text_len)
        m = estimate_memory(self.spec, self.workload, cfg, self.sp)
        return Point(cfg, t, m, device_need(m.peak, m.activations, self.hw))

    def none(self, cfg_batched: bool = False) -> Point:
        """No offload, with the guidance passes run as `cfg_batched` says."""
        return self.evaluate(OffloadConfig("none", cfg_batched=cfg_batched))

    def fastest_none(self) -> Point:
        """No offload in the fastest CFG evaluation the levers allow: what --max-slowdown is relative to."""
        return min((self.none(b) for b in self.levers.cfg_batched), key=lambda p: p.step_time)

    def target(self, max_slowdown: float | None, target_step_time: float | None) -> float:
        """The step target of every point: `target_step_time`, else max_slowdown x the fastest way to run without
        offload (batched CFG is held to what the user could have without offload, not to a batched run that may
        itself be slower, as Qwen-Image's is on an H200)."""
        if target_step_time is not None:
            return target_step_time
        return self.fastest_none().step_time * (max_slowdown or 1.05)


BATCHING_GAIN = 0.02  # batched CFG doubles the activations: taken for a shorter step only if it saves 2% or more


def preference(p: Point) -> tuple:
    """The order among feasible points: smallest residency, exact before lossy storage, shortest step, smallest
    memory, chunk size nearest 16 MB. Use `best_of`, which also keeps batched CFG to where it pays."""
    return (p.cfg.residency, p.cfg.weight_dtype != "bf16", p.step_time, p.memory.peak, chunk_tie(p))


def best_of(points: list[Point]) -> Point:
    """The preferred point; batched CFG only where it lowers residency or shortens the step by BATCHING_GAIN (an
    unbatched point of the same residency and storage within that margin is taken instead)."""
    best = min(points, key=preference)
    if best.cfg.cfg_batched:
        same = [p for p in points if not p.cfg.cfg_batched and p.cfg.residency == best.cfg.residency
                and p.cfg.weight_dtype == best.cfg.weight_dtype]
        if same:
            alt = min(same, key=preference)
            if alt.step_time <= best.step_time * (1 + BATCHING_GAIN):
                return alt
    return best


def residency_grid(spec: ModelSpec, chunk_bytes: int) -> list[float]:
    """Residencies in chunk-sized steps: k / n for k = 0..n, n = chunks in the largest block."""
    n = max(1, math.ceil(max(block_volumes(spec)) / chunk_bytes))
    return [k / n for k in range(n + 1)]


def candidates(problem: Problem, chunk_sizes: tuple[int, ...] = CHUNK_CANDIDATES) -> list[Point]:
    """Every chunkflow point of the design space (chunk size x residency x the levers allowed)."""
    aware = problem.aware
    return [
        problem.evaluate(OffloadConfig("chunkflow", C, r, comm_aware=aware, cfg_batched=b, weight_dtype=dt))
        for b, dt in problem.levers.combos()
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
    kept: MarginKept | None = None,
) -> Decision:
    """Choose the plan for `problem` under a memory budget (bytes) and a latency target; raise Infeasible if none.
    `kept`: the user's budget and margin `budget` is what is left of (for the messages)."""
    none = problem.fastest_none()  # the reference of --max-slowdown and of the plan's `none` baseline
    layerwise = problem.evaluate(OffloadConfig("layerwise"))
    target = problem.target(max_slowdown, target_step_time)
    target_text = format_seconds(target) + (f" ({max_slowdown:.2f}x no offload)" if target_step_time is None else "")

    nones = [problem.none(b) for b in problem.levers.cfg_batched]
    fit = [p for p in nones if p.need <= budget]
    if fit:
        chosen = best_of(fit)
        return Decision(
            chosen, none, layerwise, target, budget,
            f"the model fits without offload (needs {format_bytes(chosen.need)} of "
            f"{budget_said(format_bytes(budget), kept)}): "
            f"offload would only cost time (layerwise {layerwise.step_time / none.step_time:.2f}x)"
            + ("; the guidance passes run as one batched forward" if chosen.cfg.cfg_batched else "")
            + ("; fp8 storage is not used: nothing is offloaded" if "bf16" not in problem.levers.weight_dtypes
               else ""),
        )

    points = candidates(problem, chunk_sizes)
    in_budget = [p for p in points if p.need <= budget]
    feasible = [p for p in in_budget if p.step_time <= target]
    if feasible:
        best = best_of(feasible)
        slow = best.step_time / none.step_time
        if best.cfg.residency == 0:
            tied = [p for p in feasible if p.cfg.residency == 0 and p.step_time == best.step_time
                    and p.cfg.cfg_batched == best.cfg.cfg_batched and p.cfg.weight_dtype == best.cfg.weight_dtype]
            why = (
                f"full offload already meets the target ({slow:.3f}x no offload, target {target_text}); "
                + (f"every chunk size hides, so {format_bytes(best.cfg.chunk_bytes)} (the paper's operating point)"
                   if len(tied) > 1 else f"{format_bytes(best.cfg.chunk_bytes)} chunks give the shortest step")
            )
        else:
            why = (
                f"the smallest residency that meets {target_text} inside {budget_said(format_bytes(budget), kept)}: "
                f"{best.cfg.residency:.0%} resident, {slow:.3f}x no offload"
            )
        return Decision(best, none, layerwise, target, budget, why + lever_reason(best, feasible, problem.levers))

    min_need = min(p.need for p in points)
    hint = _lever_hint(problem, budget, max_slowdown, target_step_time, chunk_sizes)
    if not in_budget:
        raise Infeasible(
            "memory",
            f"memory is the binding constraint: even full offload needs {format_bytes(min_need)} "
            f"(peak allocation, allocator slack and CUDA context) and the budget is "
            f"{budget_said(format_bytes(budget), kept, stated=True)}. Raise --mem-budget, or "
            "shrink the workload (fewer frames, smaller batch or resolution) or raise --sp." + hint
            + (kept.needed(min_need) if kept else ""),
            min_need, None,
        )
    best_in_budget = min(in_budget, key=lambda p: p.step_time)
    raise Infeasible(
        "latency",
        f"latency is the binding constraint: the fastest plan inside "
        f"{budget_said(format_bytes(budget), kept, more=True)} takes "
        f"{format_seconds(best_in_budget.step_time)} per step "
        f"(residency {best_in_budget.cfg.residency:.0%}, {format_bytes(best_in_budget.cfg.chunk_bytes)} chunks), "
        f"above the target {target_text}. The smallest memory any plan needs is {format_bytes(min_need)}. "
        "Raise --mem-budget or relax --max-slowdown / --target-step-time." + hint,
        min_need, best_in_budget.step_time,
    )


def lever_reason(best: Point, feasible: list[Point], levers: Levers) -> str:
    """Why the plan batches CFG or not and stores fp8 or not, against the best feasible point without that choice."""
    parts = []

    def alternative(pred) -> Point | None:
        alt = [p for p in feasible if pred(p)]
        return min(alt, key=preference) if alt else None

    if len(levers.cfg_batched) > 1:
        other = alternative(lambda p: p.cfg.cfg_batched != best.cfg.cfg_batched)
        if best.cfg.cfg_batched:
            parts.append("batched CFG (each block streamed once a step for both guidance passes): "
                         + (f"unbatched would need residency {other.cfg.residency:.0%}" if other is not None
                            and other.cfg.residency > best.cfg.residency else
                            "unbatched meets no target in this budget" if other is None else
                            f"{other.step_time / best.step_time:.2f}x the step time unbatched"))
        else:
            parts.append("unbatched CFG: " + ("no batched plan meets the target in this budget" if other is None else
                                              "batching would not lower residency or shorten the step by "
                                              f"{BATCHING_GAIN:.0%}, and it doubles the activations"))
    elif True in levers.cfg_batched:
        parts.append("batched CFG as asked")
    if len(levers.weight_dtypes) > 1:
        if best.cfg.weight_dtype != "bf16":
            other = alternative(lambda p: p.cfg.weight_dtype == "bf16")
            parts.append("fp8 weight storage (allowed, lossy): "
                         + ("bf16 meets no target in this budget" if other is None else
                            f"bf16 would need residency {other.cfg.residency:.0%}"))
        else:
            parts.append("bf16 weights: fp8 storage would not lower residency, so the exact weights are kept")
    elif levers.weight_dtypes == ("fp8_e4m3",):
        parts.append("fp8 weight storage as asked")
    return "".join(f"; {p}" for p in parts)


def _lever_hint(problem: Problem, budget: int, max_slowdown: float | None, target_step_time: float | None,
                chunk_sizes: tuple[int, ...]) -> str:
    """What a lever the user did not allow would do: fp8 storage (--allow-fp8), batched CFG (--cfg-batching). Only
    the points of the lever not tried yet are evaluated."""
    from dataclasses import replace

    lv = problem.levers
    options = [(Levers(lv.cfg_batched, ("fp8_e4m3",)), "fp8_e4m3" not in lv.weight_dtypes,
                " Lossy fp8 weight storage would make it feasible (--weight-dtype auto --allow-fp8)."),
               (Levers((True,), lv.weight_dtypes), problem.workload.cfg_passes > 1 and True not in lv.cfg_batched,
                " Batched CFG would make it feasible (--cfg-batching auto).")]
    hints = []
    for levers, untried, text in options:
        if not untried:
            continue
        other = replace(problem, levers=levers)
        # held to the fastest no-offload run among the CFG evaluations the user's choice and the lever allow
        both = replace(problem, levers=Levers(tuple({*lv.cfg_batched, *levers.cfg_batched}), levers.weight_dtypes))
        target = both.target(max_slowdown, target_step_time)
        if any(p.need <= budget and p.step_time <= target for p in candidates(other, chunk_sizes)):
            hints.append(text)
    return "".join(hints)
