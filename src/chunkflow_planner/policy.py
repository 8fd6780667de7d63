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

A third lever keeps the bytes exact and sends fewer of them: the codec (issue 39, tiers.py), the host tier's
streamed bytes stored and copied losslessly encoded, decoded on the GPU. It is one more axis of the same space
(`Levers.codecs`): below the critical point it shortens a streaming-bound step (rho B on the link for B / D of decode),
above it the copies hide anyway and the decode only lengthens the compute path, so the step-time order alone turns it
on where it pays and off where it does not; of equal step time the raw point is preferred. Where the host budget
binds, the decision's point is tried encoded (its store rho of the tails) before the disk tier; an encoded point's
disk blocks are read encoded too (rho of their tails a forward, from the codec's spill file: memory.disk_bytes), so
with the codec fewer disk blocks fit the budget and each reads fewer bytes.

The policy returns facts (`Facts`: which constraint binds, the levers and their amounts, the margins); explain.py
words them. The budget comes in as one number, the device bytes the points are checked against.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, partial

from chunkflow_planner import explain
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
from chunkflow_planner.tiers import CODEC_RATE_REMEDY, codec_known, disk_known

CODEC = "exponent-pack"  # the codec the policy may turn on

CfgBatching = str  # "auto" | "on" | "off"

MB = 10**6
CHUNK_CANDIDATES = tuple(c * MB for c in (4, 8, 16, 32, 64, 128, 256))


@dataclass(frozen=True, kw_only=True)
class Target:
    """A latency target in seconds; `slowdown`: the multiple of no offload it was set at (None: given in seconds)."""

    seconds: float
    slowdown: float | None = None


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What decided a plan or ruled every one out. `binding`: the constraint that binds ("memory": the GPU budget,
    "host memory": the host budget, "latency": the target; None where the plan meets them all). The margins:
    `budget`, the GPU bytes checked (the one budget number), against `need`, the device bytes of the point chosen
    or, where none is, of the least any needs; `target` against `time_s`, the time of the point chosen or of the
    fastest inside the budgets (None where memory binds)."""

    binding: str | None
    budget: int
    need: int
    target: Target
    time_s: float | None = None


class Infeasible(ChunkflowError):
    """No configuration meets the target inside the budget: its `facts` say which constraint binds and how close the
    closest point came; the message words them (explain.py)."""

    def __init__(self, facts: Facts, message: str) -> None:
        super().__init__(message)
        self.facts = facts

    @property
    def binding(self) -> str:
        return self.facts.binding

    @property
    def min_memory(self) -> int:
        return self.facts.need

    @property
    def best_step_time(self) -> float | None:
        return self.facts.time_s


@dataclass(frozen=True, eq=False)
class Point:
    """One evaluated configuration: its memory at once, its step time (`time`) on first use. Most of the design
    space's points are ruled out by memory alone, and the step time is most of a point's price; the time is the
    same pure function of the problem and the setting whenever it is computed."""

    cfg: OffloadConfig
    memory: MemoryEstimate
    need: int  # device memory the GPU must have: memory.device_need of the peak on the problem's hardware
    timed: Callable[[], StepTime] = field(repr=False)

    @cached_property
    def time(self) -> StepTime:
        return self.timed()

    @property
    def step_time(self) -> float:
        return self.time.total

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Point):
            return NotImplemented
        return (self.cfg, self.memory, self.need, self.time) == (other.cfg, other.memory, other.need, other.time)

    __hash__ = None  # type: ignore[assignment]  (as before: a StepTime holds a list)


@dataclass(frozen=True)
class Setting:
    """A point as the facts name it: its offload, its step time and that time over the fastest without offload."""

    cfg: OffloadConfig
    step_s: float
    slowdown: float


def setting(p: Point, none: Point) -> Setting:
    """`p` named against `none`, the fastest way to run without offload."""
    return Setting(p.cfg, p.step_time, p.step_time / none.step_time)


@dataclass(frozen=True)
class Lever:
    """A lever of the chosen point: "cfg_batching" (`on`: the guidance passes batched), "weight_dtype" (`on`: fp8
    storage) or "codec" (`on`: the streamed bytes encoded). `asked`: the only setting the user allowed; else `other`, the preferred feasible point with the lever
    the other way (None: none is feasible), and `gain`, the step saving batching must bring to be taken."""

    name: str
    on: bool
    asked: bool = False
    other: Setting | None = None
    gain: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StepFacts(Facts):
    """The facts of the transformer alone. `chosen`: the point chosen, or the fastest inside the budget where latency
    binds; `levers`: its levers; `unlocks`: the levers the user did not allow that would make it feasible;
    `layerwise_slowdown`: layerwise over no offload; `chunk_ties`: at full offload, the chunk sizes as fast as the
    chosen; `fp8_unused`: only fp8 storage was allowed and nothing is offloaded."""

    chosen: Setting | None = None
    levers: tuple[Lever, ...] = ()
    unlocks: tuple[str, ...] = ()
    layerwise_slowdown: float = 1.0
    chunk_ties: int = 1
    fp8_unused: bool = False


@dataclass(frozen=True)
class Baselines:
    """What every plan is measured against: no offload in the fastest CFG evaluation the levers allow, layerwise
    offload, and the step target of every point."""

    none: Point
    layerwise: Point
    target_s: float


@dataclass(frozen=True)
class Decision:
    """The point chosen, the baselines and step target, the device bytes checked, and the facts and their words."""

    chosen: Point
    none: Point
    layerwise: Point
    target_s: float
    budget: int
    reason: str  # the facts in words (explain.py)
    facts: Facts | None = None


def codec_refusal(spec: ModelSpec, hw: HardwareSpec) -> str | None:
    """Why the codec cannot be planned for `spec` on `hw` (None: it can): the profile gives no decode rate
    (tiers.CODEC_RATE_REMEDY says what to do), or the model's weights are not 16-bit floats."""
    if spec.stored is not None:
        return (f"the codec encodes bf16 weights; a {spec.stored.format} file streams its stored bytes as they are. "
                "Leave it off (--codec off)")
    if spec.dtype_bytes != 2:
        return (f"the codec encodes 16-bit (bf16) weights; {spec.name} holds {spec.dtype_bytes}-byte weights. Leave "
                "it off (--codec off)")
    if not codec_known(hw):
        return f"the profile {hw.name!r} has no decode rate to price the codec: {CODEC_RATE_REMEDY}"
    return None


@dataclass(frozen=True)
class Levers:
    """Which CFG evaluations, weight storage dtypes and codecs the policy may choose among."""

    cfg_batched: tuple[bool, ...] = (False,)
    weight_dtypes: tuple[str, ...] = ("bf16",)
    codecs: tuple[str, ...] = ("none",)

    @classmethod
    def of(cls, cfg_passes: int, cfg_batching: str = "auto", weight_dtype: str = "bf16",
           allow_fp8: bool = False, codec: str = "off", codec_refused: str | None = None) -> "Levers":
        """From the CLI's choices: `cfg_batching` auto|on|off (auto considers both where there are two passes);
        `weight_dtype` auto|bf16|fp8_e4m3 (auto considers fp8 only with `allow_fp8`); `codec` auto|on|off (auto
        considers both where `codec_refused`, codec_refusal's answer, is None; on is refused with its words)."""
        if cfg_batching not in ("auto", "on", "off"):
            raise ChunkflowError(f"--cfg-batching must be auto, on or off, got {cfg_batching!r}")
        if weight_dtype not in ("auto", "bf16", "fp8_e4m3"):
            raise ChunkflowError(f"--weight-dtype must be auto, bf16 or fp8_e4m3, got {weight_dtype!r}")
        if codec not in ("auto", "on", "off"):
            raise ChunkflowError(f"--codec must be auto, on or off, got {codec!r}")
        if codec == "on" and codec_refused is not None:
            raise ChunkflowError(f"--codec on: {codec_refused}")
        if codec == "on" and weight_dtype == "fp8_e4m3":
            raise ChunkflowError("--codec on encodes bf16 weights losslessly and --weight-dtype fp8_e4m3 stores them "
                                 "cast: use one or the other (--weight-dtype bf16 with --codec on)")
        if cfg_passes < 2 or cfg_batching == "off":
            batched: tuple[bool, ...] = (False,)
        else:
            batched = (True,) if cfg_batching == "on" else (False, True)
        if weight_dtype == "auto":
            dtypes: tuple[str, ...] = ("bf16", "fp8_e4m3") if allow_fp8 else ("bf16",)
        else:
            dtypes = (weight_dtype,)
        if codec == "on":
            codecs: tuple[str, ...] = (CODEC,)
            dtypes = ("bf16",)  # the codec encodes bf16 weights; fp8 storage is the other way to fewer bytes
        elif codec == "auto" and codec_refused is None:
            codecs = ("none", CODEC)
        else:
            codecs = ("none",)
        return cls(batched, dtypes, codecs)

    def combos(self) -> list[tuple[bool, str, str]]:
        """(cfg_batched, weight_dtype, codec) triples; fp8 is cast on the compute stream and never encoded. The copy
        stream is not offered: its cast still takes the SMs (steptime.py), so it is never faster in the model and
        holds one more buffer (measured on an H200: 1-2% faster at best); `fp8_cast="copy"` stays a run option."""
        return [(b, d, c) for b in self.cfg_batched for d in self.weight_dtypes for c in self.codecs
                if c == "none" or d == "bf16"]


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
    share_host: bool = True  # under SP, the host's ranks share the shareable host bytes (pipeline/hostshare.py)

    def __post_init__(self) -> None:
        if self.spec.stored is not None:  # a stored format streams its own bytes: no fp8 cast or codec over them
            object.__setattr__(self, "levers", Levers(self.levers.cfg_batched))

    @property
    def aware(self) -> bool:
        return self.hw.pace_collectives if self.comm_aware is None else self.comm_aware

    def evaluate(self, cfg: OffloadConfig) -> Point:
        """`cfg`'s point: its memory now, its step time when first asked (at once where pricing it raises: a codec
        or disk tier the profile has no rate for, so that the error comes where it always came)."""
        m = estimate_memory(self.spec, self.workload, cfg, self.sp, self.hw)
        point = Point(cfg, m, device_need(m.peak, m.activations, self.hw), partial(
            step_time, self.spec, self.workload, self.hw, cfg, self.sp, self.prefetch_bytes, self.text_len))
        if (cfg.codec != "none" and not codec_known(self.hw)) or (cfg.disk_blocks and not disk_known(self.hw)):
            point.time  # noqa: B018 - raises tiers.CodecRateUnknown or DiskRateUnknown, saying what to do
        return point

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
    """The order among feasible points: smallest residency, exact before lossy storage, shortest step, raw before
    encoded, smallest memory, chunk size nearest 16 MB. Use `best_of`, which also keeps batched CFG to where it
    pays."""
    return (p.cfg.residency, p.cfg.weight_dtype != "bf16", p.step_time, p.cfg.codec != "none", p.memory.peak,
            chunk_tie(p))


def best_of(points: list[Point]) -> Point:
    """The preferred point; batched CFG only where it lowers residency or shortens the step by BATCHING_GAIN (an
    unbatched point of the same residency and storage within that margin is taken instead)."""
    best = min(points, key=preference)
    if best.cfg.cfg_batched:
        same = [p for p in points if not p.cfg.cfg_batched and p.cfg.residency == best.cfg.residency
                and p.cfg.weight_dtype == best.cfg.weight_dtype and p.cfg.codec == best.cfg.codec]
        if same:
            alt = min(same, key=preference)
            if alt.step_time <= best.step_time * (1 + BATCHING_GAIN):
                return alt
    return best


def fewest_disk_blocks(problem: Problem, point: Point, fits, priced=None, evaluate=None):
    """`point` with the fewest disk blocks (offload.disk_block_indices: their streamed tails read from the
    checkpoint's files each forward, or with a codec rho of them from its spill file, tiers.py) for which `fits(point)` holds, priced by `priced` (default: the point
    itself); with every block on disk where none fits (the least host memory there is, for a shortfall's facts).
    Host memory falls as disk blocks are added, so the count is bisected. `evaluate`: problem.evaluate, or a cache
    of it where many placements bisect the same point."""
    priced = priced or (lambda p: p)
    evaluate = evaluate or problem.evaluate

    def at(k: int) -> Point:
        return evaluate(point.cfg.with_overrides(disk_blocks=k))

    lo, hi = 1, problem.spec.n_blocks
    every = at(hi)
    if not fits(every):
        return priced(every)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(at(mid)):
            hi = mid
        else:
            lo = mid + 1
    return priced(at(lo))


def residency_grid(spec: ModelSpec, chunk_bytes: int) -> list[float]:
    """Residencies in chunk-sized steps: k / n for k = 0..n, n = chunks in the largest block."""
    n = max(1, math.ceil(max(block_volumes(spec)) / chunk_bytes))
    return [k / n for k in range(n + 1)]


def candidates(problem: Problem, chunk_sizes: tuple[int, ...] = CHUNK_CANDIDATES) -> list[Point]:
    """Every chunkflow point of the design space (chunk size x residency x the levers allowed)."""
    aware = problem.aware
    return [
        problem.evaluate(OffloadConfig("chunkflow", C, r, comm_aware=aware, cfg_batched=b, weight_dtype=dt,
                                       codec=codec))
        for b, dt, codec in problem.levers.combos()
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


def baselines(problem: Problem, max_slowdown: float | None, target_step_time: float | None) -> Baselines:
    """No offload, layerwise and the step target, straight from the step-time and memory model."""
    return Baselines(problem.fastest_none(), problem.evaluate(OffloadConfig("layerwise")),
                     problem.target(max_slowdown, target_step_time))


def step_target(base: Baselines, max_slowdown: float | None, target_step_time: float | None) -> Target:
    """The step target as the facts carry it: its seconds and the slowdown it was set at, if any."""
    return Target(seconds=base.target_s, slowdown=None if target_step_time is not None else max_slowdown or 1.05)


def decide(
    problem: Problem,
    budget: int,
    max_slowdown: float | None = 1.05,
    target_step_time: float | None = None,
    chunk_sizes: tuple[int, ...] = CHUNK_CANDIDATES,
) -> Decision:
    """Choose the plan for `problem` under a memory budget (the device bytes the policy checks) and a latency
    target; raise Infeasible if none. The reason and the error word the facts as explain.py does without a margin."""
    base = baselines(problem, max_slowdown, target_step_time)  # the reference of --max-slowdown and the baselines
    target = step_target(base, max_slowdown, target_step_time)
    fit = [p for p in (problem.none(b) for b in problem.levers.cfg_batched) if p.need <= budget]
    if fit:
        chosen, facts = _without_offload(problem, best_of(fit), base, budget, target)
    else:
        points = candidates(problem, chunk_sizes)
        feasible = [p for p in points if p.need <= budget and p.step_time <= target.seconds]
        if not feasible:
            facts = _shortfall(problem, points, base, budget, target, (max_slowdown, target_step_time), chunk_sizes)
            raise Infeasible(facts, explain.step_infeasible(facts))
        chosen, facts = _offloaded(problem, best_of(feasible), feasible, base, budget, target)
    return Decision(chosen, base.none, base.layerwise, base.target_s, budget, explain.step_reason(facts), facts)


def _without_offload(problem: Problem, chosen: Point, base: Baselines, budget: int,
                     target: Target) -> tuple[Point, StepFacts]:
    """The facts of a model that fits without offload."""
    return chosen, StepFacts(
        binding=None, budget=budget, need=chosen.need, target=target, time_s=chosen.step_time,
        chosen=setting(chosen, base.none), layerwise_slowdown=base.layerwise.step_time / base.none.step_time,
        fp8_unused="bf16" not in problem.levers.weight_dtypes)


def _offloaded(problem: Problem, best: Point, feasible: list[Point], base: Baselines, budget: int,
               target: Target) -> tuple[Point, StepFacts]:
    """The facts of the preferred streamed point `best` among the `feasible` ones."""
    ties = 1
    if best.cfg.residency == 0:
        ties = sum(1 for p in feasible if p.cfg.residency == 0 and p.step_time == best.step_time
                   and p.cfg.cfg_batched == best.cfg.cfg_batched and p.cfg.weight_dtype == best.cfg.weight_dtype
                   and p.cfg.codec == best.cfg.codec)
    return best, StepFacts(
        binding=None, budget=budget, need=best.need, target=target, time_s=best.step_time,
        chosen=setting(best, base.none), levers=levers_of(best, feasible, problem.levers, base.none),
        chunk_ties=ties)


def _shortfall(problem: Problem, points: list[Point], base: Baselines, budget: int, target: Target,
               asked: tuple[float | None, float | None], chunk_sizes: tuple[int, ...]) -> StepFacts:
    """Why no point is feasible: memory binds where none fits the budget, else latency (with the fastest that
    fits); `asked`: (max_slowdown, target_step_time), to hold the levers not allowed to the same target."""
    min_need = min(p.need for p in points)
    hint = unlocks(problem, budget, *asked, chunk_sizes)
    in_budget = [p for p in points if p.need <= budget]
    if not in_budget:
        return StepFacts(binding="memory", budget=budget, need=min_need, target=target, unlocks=hint)
    fastest = min(in_budget, key=lambda p: p.step_time)
    return StepFacts(binding="latency", budget=budget, need=min_need, target=target, time_s=fastest.step_time,
                     chosen=setting(fastest, base.none), unlocks=hint)


def levers_of(best: Point, feasible: list[Point], levers: Levers, none: Point) -> tuple[Lever, ...]:
    """The levers of `best`: whether it batches CFG and stores fp8, against the preferred feasible point without
    that choice (where the user allowed both settings)."""

    def other(pred) -> Setting | None:
        alt = [p for p in feasible if pred(p)]
        return setting(min(alt, key=preference), none) if alt else None

    out = []
    if len(levers.cfg_batched) > 1:
        out.append(Lever("cfg_batching", best.cfg.cfg_batched, gain=BATCHING_GAIN,
                         other=other(lambda p: p.cfg.cfg_batched != best.cfg.cfg_batched)))
    elif True in levers.cfg_batched:
        out.append(Lever("cfg_batching", True, asked=True))
    if len(levers.weight_dtypes) > 1:
        fp8 = best.cfg.weight_dtype != "bf16"
        out.append(Lever("weight_dtype", fp8, other=other(lambda p: p.cfg.weight_dtype == "bf16") if fp8 else None))
    elif levers.weight_dtypes == ("fp8_e4m3",):
        out.append(Lever("weight_dtype", True, asked=True))
    if len(levers.codecs) > 1 and best.cfg.weight_dtype == "bf16":
        out.append(Lever("codec", best.cfg.codec != "none",
                         other=other(lambda p: p.cfg.codec != best.cfg.codec and p.cfg.weight_dtype == "bf16")))
    elif levers.codecs == (CODEC,):
        out.append(Lever("codec", True, asked=True))
    return tuple(out)


def unlocks(problem: Problem, budget: int, max_slowdown: float | None, target_step_time: float | None,
            chunk_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The levers the user did not allow that would make a plan feasible: "weight_dtype" (fp8 storage,
    --allow-fp8), "cfg_batching" (batched CFG). Only the points of the lever not tried yet are evaluated."""
    lv = problem.levers
    fp8_untried = "fp8_e4m3" not in lv.weight_dtypes and problem.spec.stored is None  # a stored format casts none
    options = [(Levers(lv.cfg_batched, ("fp8_e4m3",)), fp8_untried, "weight_dtype"),
               (Levers((True,), lv.weight_dtypes, lv.codecs),
                problem.workload.cfg_passes > 1 and True not in lv.cfg_batched, "cfg_batching")]
    found = []
    for levers, untried, name in options:
        if not untried:
            continue
        other = replace(problem, levers=levers)
        # held to the fastest no-offload run among the CFG evaluations the user's choice and the lever allow
        both = replace(problem, levers=Levers(tuple({*lv.cfg_batched, *levers.cfg_batched}), levers.weight_dtypes))
        target = both.target(max_slowdown, target_step_time)
        if any(p.need <= budget and p.step_time <= target for p in candidates(other, chunk_sizes)):
            found.append(name)
    return tuple(found)
