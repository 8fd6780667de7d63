"""The whole-pipeline policy: every placement estimated (phases.py), the fastest that fits the GPU budget in every
phase and the host budget and meets the generation's target, and the facts of the choice or of the shortfall
(explain.py words them)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.memory import allocation_within
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.pipeline import explain
from chunkflow_planner.pipeline.decode import vae_fit
from chunkflow_planner.pipeline.experts import expert_steps
from chunkflow_planner.pipeline.phases import estimate
from chunkflow_planner.pipeline.placement import (
    ON_DISK,
    TEXT_PLACEMENTS,
    TRANSFORMER_PLACEMENTS,
    VAE_PLACEMENTS,
    PipelineError,
    PipelineEstimate,
    Placements,
)
from chunkflow_planner.pipeline.text import TextCosts, text_costs
from chunkflow_planner.tiers import disk_known
from chunkflow_planner.whole_first import whole_first
from chunkflow_planner.policy import (
    BATCHING_GAIN,
    Facts,
    Infeasible,
    Lever,
    Point,
    Problem,
    Setting,
    Target,
    best_of,
    candidates,
    chunk_tie,
    fewest_disk_blocks,
    levers_of,
    setting,
)


def _estimate(problem: Problem, pl: Placements, point: Point, costs: TextCosts | None = None,
              disk_point: Point | None = None, hw: HardwareSpec | None = None) -> PipelineEstimate:
    """phases.estimate of `problem`'s model and workload on `hw` (default the problem's), its ranks (SP degree) and
    their sharing of host memory."""
    return estimate(problem.spec, problem.workload, problem.hw if hw is None else hw, pl, point, costs, disk_point,
                    ranks=problem.sp, share_host=problem.share_host)


@dataclass(frozen=True)
class _Transformer:
    """The transformer's candidates, evaluated once for every placement combination."""

    none: Point  # no offload, the guidance passes as is fastest: the reference
    points: list[Point]
    target: float  # the step target of every point (Problem.target)
    nones: tuple[Point, ...]  # no offload in every CFG evaluation the levers allow

    def meets(self, p: Point) -> bool:
        return p.step_time <= self.target

    def within(self, p: Point, room: float, hw: HardwareSpec) -> bool:
        """Whether `p` fits `room` (allocated bytes priced with the reference's activations, _room): its peak and
        what the allocator holds of the activations it has beyond the reference's (batched CFG doubles them)."""
        return p.memory.peak + hw.alloc_slack * (p.memory.activations - self.none.memory.activations) <= room


def transformer_candidates(problem: Problem, max_slowdown: float | None, target_step_time: float | None) -> _Transformer:
    return _Transformer(problem.fastest_none(), candidates(problem), problem.target(max_slowdown, target_step_time),
                        tuple(problem.none(b) for b in problem.levers.cfg_batched))


def _pick_stream(cands: _Transformer, room: float, hw: HardwareSpec) -> Point | None:
    """The plan's rule for a streamed transformer in `room` allocated bytes: the smallest residency that meets the
    step target (then the shortest step), else the fastest that fits."""
    fits = [p for p in cands.points if cands.within(p, room, hw)]
    if not fits:
        return None
    meet = [p for p in fits if cands.meets(p)]
    if meet:  # the plan's policy order: smallest residency, bf16 before fp8, shortest step, chunk nearest 16 MB
        return best_of(meet)
    return min(fits, key=lambda p: (p.step_time, p.memory.peak, chunk_tie(p)))


def _placements(spec: ModelSpec, hw: HardwareSpec) -> list[Placements]:
    """Every placement of the pipeline's components; on disk only where the disk's rate is known."""
    pipe = spec.pipeline
    if pipe.vae.tiled_only:  # its class cannot decode untiled
        tilings: tuple[bool, ...] = (True,)
    else:
        tilings = (False, True) if vae_fit(spec, hw).tiled is not None else (False,)
    known = disk_known(hw)
    text, tr_places, vaes = ([p for p in places if p != ON_DISK or known]
                             for places in (TEXT_PLACEMENTS, TRANSFORMER_PLACEMENTS, VAE_PLACEMENTS))
    out = []
    for tes in itertools.product(text, repeat=len(pipe.text_encoders)):
        for tr in tr_places:
            for vae in vaes:
                for tiling in tilings:
                    out.append(Placements(tuple(tes), tr, vae, tiling))
    return out


@dataclass(frozen=True, kw_only=True)
class PipelineFacts(Facts):
    """The facts of the whole pipeline: `placement`, the estimate chosen (or, where none is feasible, the one
    nearest the binding limit) and `transformer`, its transformer's point; `host_budget` against the placement's host
    memory; `base_time_s`, the generation with everything on the GPU; the per-step target of a streamed transformer
    (`step_target_s`), whether its point meets it (`step_met`) and its levers."""

    placement: PipelineEstimate
    transformer: Setting
    host_budget: int
    base_time_s: float
    step_target_s: float
    step_met: bool = True
    levers: tuple[Lever, ...] = ()
    disk_passed: PipelineEstimate | None = None  # a faster placement that reads more from disk, within DISK_TIE
    disk_would: PipelineEstimate | None = None  # host memory binds, no disk rate known: the plan at SUPPOSED_DISK_GBPS
    disk_meets_gbps: float | None = None  # latency binds with disk reads: the disk rate that would meet the target


@dataclass(frozen=True)
class PipelineDecision:
    chosen: PipelineEstimate
    baseline: PipelineEstimate  # everything on the GPU, no offload, no tiling: what the target is relative to
    target_s: float
    gpu_budget: int
    host_budget: int
    reason: str  # the facts in words (explain.py)
    facts: PipelineFacts | None = None


def _room(other_alloc: float, budget: int, hw: HardwareSpec, point: Point) -> float:
    """Allocated bytes the transformer may use in the denoise phase inside `budget` beside `other_alloc` (what the
    phase allocates besides it), with `point`'s activations' allocator slack (the slack of every candidate is about
    the same, its activations barely depend on the offload)."""
    return allocation_within(budget, point.memory.activations, hw) - other_alloc


def generation_target(base: PipelineEstimate, target_time: float | None, generation_slowdown: float | None) -> float:
    """The whole generation's target: `target_time`, else generation_slowdown x everything on the GPU, else none."""
    if target_time is not None:
        return target_time
    return base.generation_time * generation_slowdown if generation_slowdown is not None else math.inf


def _disk_ok(point: Point) -> bool:
    """Whether a streamed point can keep blocks on disk: it streams, and in the checkpoint's own dtype."""
    return point.cfg.mode != "none" and point.cfg.weight_dtype == "bf16"


def _with_disk(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, point: Point, costs: TextCosts,
               host_budget: int, problem: Problem, evaluate=None) -> PipelineEstimate | None:
    """A streamed transformer's placement inside `host_budget` with the fewest disk blocks (the disk tier: their
    streamed bytes read from the checkpoint's files each forward); every block on disk where even that does not fit
    (the least host memory there is, for the shortfall's facts); None where the profile has no disk rate. Host
    memory falls as disk blocks are added: the count is bisected (policy.fewest_disk_blocks)."""
    if not disk_known(hw) or not _disk_ok(point):
        return None
    return fewest_disk_blocks(problem, point,
                              lambda p: _estimate(problem, pl, p, costs, hw=hw).host_memory <= host_budget,
                              lambda p: _estimate(problem, pl, p, costs, hw=hw), evaluate)


def _encoded(point: Point, cands: _Transformer, room: float, problem: Problem, evaluate) -> Point | None:
    """A raw streamed bf16 point with its streamed bytes encoded (the codec, tiers.py: rho of them in host memory),
    where the levers allow the codec and the encoded point still fits `room` and meets the step target; else None."""
    codecs = [c for c in problem.levers.codecs if c != "none"]
    if not codecs or point.cfg.codec != "none" or not _disk_ok(point):
        return None
    q = evaluate(point.cfg.with_overrides(codec=codecs[0]))
    return q if cands.within(q, room, problem.hw) and cands.meets(q) else None


def _one_on_disk(spec: ModelSpec, w: Workload, pl: Placements) -> list[Placements]:
    """A streamed placement of several experts with one of them on disk, for each expert, the one that runs the
    fewest steps first (the policy's time picks which: that one reads its blocks at fewer forwards; where times
    tie, the first is kept)."""
    n = spec.pipeline.experts
    steps = expert_steps(spec.pipeline, w.steps)
    return [replace(pl, experts=tuple(ON_DISK if j == i else "stream" for j in range(n)))
            for i in sorted(range(n), key=lambda i: steps[i])] if n > 1 else []


def _mixed(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, point: Point, costs: TextCosts,
           host_budget: int, problem: Problem, evaluate) -> PipelineEstimate | None:
    """Experts placed as `pl` says (one on disk, every block read from the files at its forwards; the others
    streamed at `point`) inside `host_budget`, the streamed ones with the fewest disk blocks that bring it inside
    (as _with_disk); None where the profile has no disk rate or the point cannot keep blocks on disk."""
    if not disk_known(hw) or not _disk_ok(point):
        return None
    disk_point = evaluate(point.cfg.with_overrides(disk_blocks=spec.n_blocks))

    def priced(p: Point) -> PipelineEstimate:
        return _estimate(problem, pl, p, costs, disk_point, hw=hw)

    e = priced(point)
    if e.host_memory <= host_budget:
        return e
    return fewest_disk_blocks(problem, point, lambda p: priced(p).host_memory <= host_budget, priced, evaluate)


def _estimates(spec: ModelSpec, w: Workload, hw: HardwareSpec, cands: _Transformer, costs: TextCosts,
               gpu_budget: int, host_budget: int, problem: Problem) -> tuple[list[PipelineEstimate],
                                                                               dict[Placements, float]]:
    """Every placement estimated: a transformer on the GPU or moved per phase in each CFG evaluation allowed, a
    streamed one by the plan's rule in the room its placement leaves (returned per placement, allocated bytes),
    and, where that streamed placement is over the host budget, with the fewest disk blocks that bring it inside;
    a transformer on disk is that streamed point with every block on disk."""
    seen: list[PipelineEstimate] = []
    rooms: dict[Placements, float] = {}
    picked: dict[float, Point] = {}  # the streamed point by room: placements that leave the same room share it
    evaluated: dict[OffloadConfig, Point] = {}  # points with disk blocks, shared by the placements that try them

    def evaluate(cfg: OffloadConfig) -> Point:
        if cfg not in evaluated:
            evaluated[cfg] = problem.evaluate(cfg)
        return evaluated[cfg]

    for pl in _placements(spec, hw):
        if pl.transformer in ("gpu", "phase"):  # each CFG evaluation allowed: batched needs more memory
            seen.extend(_estimate(problem, pl, none, costs, hw=hw) for none in cands.nones)
            continue
        probe = _estimate(problem, pl, cands.none, costs, hw=hw)
        other = probe.phases["denoise"].allocated_bytes - cands.none.memory.peak
        rooms[pl] = _room(other, gpu_budget, hw, cands.none)
        if rooms[pl] not in picked:
            point = _pick_stream(cands, rooms[pl], hw)
            room = rooms[pl]
            picked[room] = (whole_first(problem, point, lambda p: cands.within(p, room, hw))  # first-block caching
                            if point is not None else min(cands.points, key=lambda p: p.memory.peak))
        point = picked[rooms[pl]]
        if pl.transformer == ON_DISK:
            if not _disk_ok(point):
                continue
            seen.append(_estimate(problem, pl, evaluate(point.cfg.with_overrides(disk_blocks=spec.n_blocks)),
                                  costs, hw=hw))
            continue
        e = _estimate(problem, pl, point, costs, hw=hw)
        seen.append(e)
        if e.host_memory > host_budget and e.gpu_need <= gpu_budget:
            enc = _encoded(point, cands, rooms[pl], problem, evaluate)
            if enc is not None:  # the codec's store before the disk tier
                seen.append(_estimate(problem, pl, enc, costs, hw=hw))
                if seen[-1].host_memory <= host_budget:
                    continue
                # the raw point's disk blocks too: encoded ones read rho of the bytes but decode them, so where the
                # decode costs more than the reads save the raw one is faster (_fastest weighs time and disk bytes)
                raw = _with_disk(spec, w, hw, pl, point, costs, host_budget, problem, evaluate)
                if raw is not None:
                    seen.append(raw)
                point = enc
            disk = _with_disk(spec, w, hw, pl, point, costs, host_budget, problem, evaluate)
            if disk is not None:
                seen.append(disk)
            for mixed in _one_on_disk(spec, w, pl):  # an expert on disk before every expert's blocks
                rooms[mixed] = rooms[pl]
                m = _mixed(spec, w, hw, mixed, point, costs, host_budget, problem, evaluate)
                if m is not None:
                    seen.append(m)
    return seen, rooms


DISK_TIE = 0.05  # placements this close to the fastest are ranked by the bytes they read from disk


def _fastest(fits: list[PipelineEstimate]) -> PipelineEstimate:
    """The fastest placement, then the smallest; a whole transformer batches CFG only for a real gain. Where the
    fastest reads from disk, a placement within DISK_TIE of its time that reads fewer bytes from disk a generation
    is taken instead (then the fastest of those): a disk's rate varies with the page cache and with other readers
    more than a host link's, and the disk tier's plans were the least accurate measured (a generation reading 18
    transformer blocks from disk each forward ran 13.9% over its plan on an H200, issue 36), so the placement that
    reads what it needs once (a text encoder, the VAE) is preferred to one that reads blocks every step."""
    best = min(fits, key=lambda e: (round(e.generation_time, 6), e.gpu_need, e.host_memory))
    if best.disk_read > 0:
        near = [e for e in fits if e.generation_time <= best.generation_time * (1 + DISK_TIE)]
        best = min(near, key=lambda e: (round(e.disk_read, -6), round(e.generation_time, 6), e.gpu_need,
                                        e.host_memory))
    if best.transformer.cfg.cfg_batched and best.placements.transformer in ("gpu", "phase"):
        plain = [e for e in fits if e.placements == best.placements and not e.transformer.cfg.cfg_batched]
        if plain and plain[0].generation_time <= best.generation_time * (1 + BATCHING_GAIN):
            return plain[0]  # batching doubles the activations: only for a real gain
    return best


def _stream_levers(best: PipelineEstimate, cands: _Transformer, room: float, problem: Problem) -> tuple[Lever, ...]:
    """The levers of a streamed transformer that meets the step target, against the points that do in its room."""
    feasible = [p for p in cands.points if cands.within(p, room, problem.hw) and cands.meets(p)]
    return levers_of(best.transformer, feasible, problem.levers, cands.none)


def _facts(e: PipelineEstimate, *, cands: _Transformer, base: PipelineEstimate, target: float, gpu_budget: int,
           host_budget: int, binding: str | None, time_s: float | None = None,
           levers: tuple[Lever, ...] = ()) -> PipelineFacts:
    """The facts of placement `e` against the budgets and targets."""
    return PipelineFacts(
        binding=binding, budget=gpu_budget, need=e.gpu_need, target=Target(seconds=target), time_s=time_s,
        placement=e, transformer=setting(e.transformer, cands.none), host_budget=host_budget,
        base_time_s=base.generation_time, step_target_s=cands.target, step_met=cands.meets(e.transformer),
        levers=levers)


def _shortfall(best: PipelineEstimate | None, fits_gpu: list[PipelineEstimate], seen: list[PipelineEstimate],
               facts_of: Callable[..., PipelineFacts]) -> PipelineFacts:
    """Why no placement is feasible: latency binds where the fastest inside both budgets (`best`) misses the target,
    host memory where some fit the GPU budget (`fits_gpu`) and none the host's, else GPU memory."""
    if best is not None:
        return facts_of(best, binding="latency", time_s=best.generation_time)
    if fits_gpu:
        return facts_of(min(fits_gpu, key=lambda e: e.host_memory), binding="host memory")
    return facts_of(min(seen, key=lambda e: e.gpu_need), binding="memory")


SUPPOSED_DISK_GBPS = 1.5  # what a shortfall supposes without a disk rate: the H200 host's NVMe as calibrate measured
# it (issue 36, 2026-12-02)


def _disk_facts(facts: PipelineFacts, spec: ModelSpec, w: Workload, problem: Problem, target: float,
                asked: dict, cands: _Transformer | None = None) -> PipelineFacts:
    """A shortfall's facts with what the disk tier would do: where host memory binds and the disk's rate is unknown,
    the plan at SUPPOSED_DISK_GBPS; where latency binds and the placement reads from disk, the rate that would meet
    the target."""
    hw = problem.hw
    if hw.pipeline.device_is_host:
        return facts
    if facts.binding == "host memory" and not disk_known(hw):
        supposed = hw.model_copy(update={"disk_read_gbps": SUPPOSED_DISK_GBPS})
        try:
            # the transformer's candidates keep no block on disk: the disk's rate prices none of them (`cands`)
            would = decide_pipeline(spec, w, supposed, replace(problem, hw=supposed), **asked, cands=cands)
        except Infeasible:
            return facts
        return replace(facts, disk_would=would.chosen)
    if facts.binding == "latency" and facts.placement.disk_read > 0:
        return replace(facts, disk_meets_gbps=_rate_meeting(facts.placement, spec, w, problem, target))
    return facts


def _rate_meeting(e: PipelineEstimate, spec: ModelSpec, w: Workload, problem: Problem, target: float) -> float | None:
    """The disk rate (GB/s) at which placement `e` meets `target`, bisected on a log scale; None where no disk
    would (the time is not the disk's)."""
    def time_at(gbps: float) -> float:
        hw = problem.hw.model_copy(update={"disk_read_gbps": gbps})
        at = replace(problem, hw=hw)
        disk = at.evaluate(e.transformer.cfg.with_overrides(disk_blocks=spec.n_blocks)) if e.placements.mixed else None
        return _estimate(at, e.placements, at.evaluate(e.transformer.cfg), text_costs(spec, w, hw),
                         disk).generation_time

    lo, hi = problem.hw.disk_read_gbps, 1e4
    if time_at(hi) > target:
        return None
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if time_at(mid) <= target else (mid, hi)
    return hi


def decide_pipeline(
    spec: ModelSpec,
    w: Workload,
    hw: HardwareSpec,
    problem: Problem,
    gpu_budget: int,
    host_budget: int,
    max_slowdown: float | None = 1.05,
    target_step_time: float | None = None,
    target_time: float | None = None,
    generation_slowdown: float | None = None,
    cands: _Transformer | None = None,
) -> PipelineDecision:
    """The fastest placement that fits the GPU budget (the device bytes checked) in every phase and the host budget,
    and meets the latency target for the whole generation if one is set (`target_time`, or `generation_slowdown` x
    everything on the GPU without offload); the transformer streamed by the plan's rule (the smallest residency
    meeting max_slowdown x no offload per step, else the fastest that fits). Raises Infeasible naming the binding
    constraint; the reason and the error word the facts as explain.py does without a margin."""
    if spec.pipeline is None:
        raise PipelineError(f"{spec.name} has no pipeline in the catalog; plan the transformer alone "
                            "(--transformer-only)")
    if cands is None:  # given: the same problem's, on a profile that differs in its disk rate only (_disk_facts)
        cands = transformer_candidates(problem, max_slowdown, target_step_time)
    costs = text_costs(spec, w, hw)
    base = _estimate(problem, Placements(("gpu",) * len(spec.pipeline.text_encoders), "gpu", "gpu", False),
                     cands.none, costs, hw=hw)
    target = generation_target(base, target_time, generation_slowdown)
    facts_of = partial(_facts, cands=cands, base=base, target=target, gpu_budget=gpu_budget, host_budget=host_budget)
    seen, rooms = _estimates(spec, w, hw, cands, costs, gpu_budget, host_budget, problem)
    fits_gpu = [e for e in seen if e.gpu_need <= gpu_budget]
    fits = [e for e in fits_gpu if e.host_memory <= host_budget]
    quickest = min(fits, key=lambda e: e.generation_time) if fits else None
    if quickest is None or quickest.generation_time > target:
        facts = _disk_facts(_shortfall(quickest, fits_gpu, seen, facts_of), spec, w, problem, target,
                            dict(gpu_budget=gpu_budget, host_budget=host_budget, max_slowdown=max_slowdown,
                                 target_step_time=target_step_time, target_time=target_time,
                                 generation_slowdown=generation_slowdown), cands)
        raise Infeasible(facts, explain.pipeline_infeasible(facts))
    best = _fastest([e for e in fits if e.generation_time <= target])
    streamed = best.placements.transformer == "stream" and cands.meets(best.transformer)
    facts = facts_of(best, binding=None, time_s=best.generation_time,
                     levers=_stream_levers(best, cands, rooms[best.placements], problem) if streamed else ())
    if quickest.generation_time < best.generation_time * (1 - 1e-6):  # the disk tie (_fastest) passed it over
        facts = replace(facts, disk_passed=quickest)
    return PipelineDecision(best, base, target, gpu_budget, host_budget, explain.pipeline_reason(facts), facts)
