"""From a model, workload, hardware and constraints to a Plan: the planner's one entry point.

It composes the two halves: the transformer-streaming core (policy, overlap, plan) and, where the model has a
pipeline in the catalog, the whole-pipeline extension (chunkflow_planner.pipeline), which it alone calls."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from chunkflow_planner.catalog import (
    EFFICIENCY_RANGE,
    H2D_GBPS_RANGE,
    PEAK_TFLOPS_RANGE,
    CatalogError,
    HardwareSpec,
    ModelSpec,
    Workload,
    get_hardware,
    load_profile,
)
from chunkflow_planner import explain
from chunkflow_planner.explain import MarginKept
from chunkflow_planner.format_plan import plan_format
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.overlap import OverlapAnalysis, analyse
from chunkflow_planner.plan import (
    Analysis,
    Baselines,
    CachePrediction,
    Critical,
    Plan,
    PlanHardware,
    PlanModel,
    PlanParallel,
    PlanPrediction,
    PlanWorkload,
)
from chunkflow_planner.memory import host_need
from chunkflow_planner.policy import (Decision, Infeasible, Lever, Levers, Point, Problem, decide, fewest_disk_blocks,
                                     setting)
from chunkflow_planner.tiers import DISK_RATE_REMEDY, codec_ratio, disk_known
from chunkflow_planner.whole_first import whole_first, whole_said
from chunkflow_planner.workload import WorkloadError, per_forward, tokens
from chunkflow_planner.pipeline.assemble import decide_whole, plans_pipeline, repriced_whole, with_pipeline
from chunkflow_planner.pipeline.decide import PipelineDecision
from chunkflow_planner.bands import Band, bands, kind_of, with_startup
from chunkflow_planner.reprice import point_prediction as _prediction, prediction_values, repriced_alone, with_supposed
from chunkflow_planner.pipeline.hostinfo import UNCHECKED_HOST_BUDGET, default_host_budget

DEFAULT_HARDWARE = "h200"
DISK_GBPS_RANGE = (0.01, 1e4)  # GB/s: a network share to a RAID of NVMe drives
PROFILE_FILENAME = "hardware-profile.yaml"


def config_dir() -> Path:
    """Where chunkflow keeps per-machine state: $CHUNKFLOW_CONFIG_DIR, else $XDG_CONFIG_HOME/chunkflow."""
    if os.environ.get("CHUNKFLOW_CONFIG_DIR"):
        return Path(os.environ["CHUNKFLOW_CONFIG_DIR"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "chunkflow"


def saved_profile_path() -> Path:
    """The hardware profile `chunkflow calibrate` saves for this machine."""
    return config_dir() / PROFILE_FILENAME


@dataclass(frozen=True)
class ResolvedHardware:
    spec: HardwareSpec
    source: str  # "catalog:h200", "profile:/path", "default:h200"
    # whether it describes the machine the planner runs on (the saved profile, the default, the CPU itself): only
    # then is this machine's memory the plan's host budget by default
    this_machine: bool = True
    named: str | None = None  # what --hardware said


def resolve_hardware(
    name: str | None = None,
    *,
    peak_tflops: float | None = None,
    h2d_gbps: float | None = None,
    eta_comp: float | None = None,
    eta_pref: float | None = None,
    disk_gbps: float | None = None,
) -> ResolvedHardware:
    """The hardware to plan for: a catalog name or profile path, else the saved profile, else the default.

    What-if overrides replace single figures; `h2d_gbps` is the effective per-GPU BW_h2d, `disk_gbps` the disk's
    cold read rate BW_disk (the disk tier's link, tiers.py).
    """
    ranges = {"peak_tflops": PEAK_TFLOPS_RANGE, "h2d_gbps": H2D_GBPS_RANGE, "eta_comp": EFFICIENCY_RANGE,
              "eta_pref": EFFICIENCY_RANGE, "disk_gbps": DISK_GBPS_RANGE}
    for key, value in (("peak_tflops", peak_tflops), ("h2d_gbps", h2d_gbps), ("eta_comp", eta_comp),
                       ("eta_pref", eta_pref), ("disk_gbps", disk_gbps)):
        lo, hi = ranges[key]
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise CatalogError(f"--{key.replace('_', '-')} must be between {lo:g} and {hi:g}, got {value}")
    this_machine = True
    if name:
        spec = get_hardware(name)
        source = f"profile:{name}" if spec.name.lower() != name.lower() else f"catalog:{spec.name}"
        this_machine = spec.pipeline.device_is_host or _is_saved_profile(name)
    elif saved_profile_path().exists():
        try:
            spec = load_profile(saved_profile_path())
        except CatalogError as exc:
            raise CatalogError(f"{exc}. It is this machine's default profile (saved by chunkflow calibrate): remove it "
                               "or run `chunkflow calibrate` again, or pass --hardware") from None
        source = f"profile:{saved_profile_path()} (saved by chunkflow calibrate)"
    else:
        spec = get_hardware(DEFAULT_HARDWARE)
        source = f"default:{DEFAULT_HARDWARE} (no --hardware and no calibrated profile on this machine)"
    update: dict[str, float] = {}
    for key, value in (("peak_tflops", peak_tflops), ("eta_comp", eta_comp), ("eta_pref", eta_pref),
                       ("disk_read_gbps", disk_gbps)):
        if value is not None:
            update[key] = value
    if h2d_gbps is not None:
        update["h2d_link_gbps"] = h2d_gbps * spec.gpus_per_host_link
    if update:
        try:  # validated like a profile, so an override cannot carry the spec out of its ranges
            spec = HardwareSpec.model_validate({**spec.model_dump(), **update})
        except ValidationError as e:
            raise CatalogError(f"the overrides give an invalid hardware profile: {e.errors()[0]['msg']}") from None
        source += " with overrides " + ", ".join(f"{k}={v:g}" for k, v in update.items())
    return ResolvedHardware(spec, source, this_machine, name or None)


def _is_saved_profile(name: str) -> bool:
    """Whether --hardware NAME is the profile `chunkflow calibrate` saved on this machine (given by its path)."""
    try:
        return Path(name).is_file() and Path(name).resolve() == saved_profile_path().resolve()
    except OSError:
        return False


def host_budget_of(hardware: ResolvedHardware) -> tuple[int | None, str]:
    """(bytes or None, how they were chosen) of the host budget a plan gets without --host-mem-budget: this
    machine's memory less a share for the system where the plan is for this machine; none (nothing checked, the
    memory needed printed) where --hardware names another, whose RAM the catalog does not know."""
    if hardware.this_machine:
        return default_host_budget()
    return None, (f"no host budget checked: --hardware {hardware.named} names another machine, and this one's "
                  "memory says nothing of its RAM; give --host-mem-budget to plan inside one")


def check_parallel(spec: ModelSpec, hw: HardwareSpec, sp: int) -> None:
    """Ulysses splits heads: the degree must divide them and not exceed the node's GPUs."""
    if sp < 1:
        raise WorkloadError(f"--sp must be at least 1, got {sp}")
    if spec.heads % sp:
        divisors = [k for k in range(1, spec.heads + 1) if spec.heads % k == 0]
        raise WorkloadError(f"Ulysses SP splits attention heads: {spec.name} has {spec.heads}, so --sp must be one of {divisors}")
    if sp > hw.gpus:
        raise WorkloadError(f"--sp {sp} needs {sp} GPUs; hardware {hw.name!r} lists {hw.gpus}. Pick another --hardware.")


def with_bands(plan: Plan, problem: Problem, chosen: Point, whole: PipelineDecision | None,
               read_bytes: int | None = None, host_alone: bool = False) -> Plan:
    """`plan` with a band on each of its predictions: bands.bands over the plan priced again with its choices held
    (pipeline/assemble.repriced_whole, or reprice.repriced_alone for the transformer alone), on the profile with the
    figures the planner supposes written in (reprice.with_supposed); an unmeasured class's activations then reach
    its GPU peaks' low edges down (with_activation_prior)."""
    def price_for(prob: Problem) -> Callable[[HardwareSpec], dict[str, float]]:
        def price(hw: HardwareSpec) -> dict[str, float]:
            again = (repriced_whole(plan, prob, whole, hw, read_bytes) if whole is not None
                     else repriced_alone(plan, prob, chosen, hw, host_alone))
            return prediction_values(again)
        return price

    values = prediction_values(plan)
    if problem.hw.pipeline.device_is_host:  # a CPU plan's times are nominal figures: no band claims to hold them
        values = {k: v for k, v in values.items() if not k.endswith("_s")}
    hw = with_supposed(problem.hw, problem.spec)
    found = bands(price_for(problem), hw, values)
    found = with_startup(with_cache_spread(found, plan, values), values, problem.hw)
    found = with_activation_prior(found, problem, lambda prob: price_for(prob)(hw), values)
    return plan.model_copy(update={"prediction": plan.prediction.model_copy(update={"bands": found})})


CACHE_FIT = "cache hit rate"  # the band's name for the step cache's hit-rate spread (stepcache.py)


def with_cache_spread(found: dict, plan: Plan, values: dict[str, float]) -> dict:
    """The bands of the times the step cache's steps make up (the generation, the denoise phase) widened by its
    hit rate's spread: the steps' seconds at the spread's ends (prediction.cache.steps_s_range) against the plan's,
    added in quadrature to the fits' and named among them."""
    c = plan.prediction.cache
    if c is None or c.steps_s_range[0] == c.steps_s_range[1]:
        return found
    moved = max(abs(c.steps_s - c.steps_s_range[0]), abs(c.steps_s_range[1] - c.steps_s))
    out = dict(found)
    for key in ("generation_time_s", "generation_warm_time_s", "phases.denoise.time_s", "phases.denoise.warm_time_s"):
        band, base = found.get(key), values.get(key)
        if band is None or not base:
            continue
        rel = min(1000.0, math.hypot(band.rel, moved / base))
        out[key] = band.model_copy(update=dict(rel=rel, low=base * max(0.0, 1 - rel), high=base * (1 + rel),
                                               fits=[CACHE_FIT, *band.fits][:3] if moved / base > band.rel
                                               else [*band.fits, CACHE_FIT][:4],
                                               measured=band.measured and c.hit_rate_source != "prior",
                                               supposed=[*band.supposed, *([CACHE_FIT] if c.hit_rate_source == "prior"
                                                                            else [])]))
    return out


ACTIVATION_PRIOR = "unmeasured class's activations"  # the band's name for the prior's reach below (derive.py)


def with_activation_prior(found: dict[str, Band], problem: Problem, price: Callable[[Problem], dict[str, float]],
                          values: dict[str, float]) -> dict[str, Band]:
    """The bands of the GPU peaks with their low edges reaching down to the plan priced at the default activation
    model, where the transformer's is a prior for a class never measured (ActivationModel.prior_multiple: the
    default times chunkflow/models/derive.py's ACTIVATION_MARGIN, an upper bound; PixArt-Sigma held 0.44 of it on
    an H100, its denoise peak 10.8% under the plan). One-sided, as the prior is a bound:

        low = min(low, value at c / prior_multiple),   high and the prediction kept

    `price(problem)`: the plan's values priced again, everything it decided held, for that problem's spec."""
    act = problem.spec.activation
    if act.prior_multiple is None:
        return found
    least = price(replace(problem, spec=problem.spec.model_copy(update={"activation": act.lowered()})))
    out = dict(found)
    for key, band in found.items():
        v, lowered = values.get(key), least.get(key)
        if kind_of(key) != "peak_memory" or not v or lowered is None or lowered >= band.low:
            continue
        below = max(0.0, 1.0 - lowered / v)
        out[key] = band.model_copy(update=dict(
            low=max(0.0, lowered), rel_low=below, rel_high=band.edges()[1], rel=max(below, band.edges()[1]),
            fits=[ACTIVATION_PRIOR, *band.fits][:3], measured=False,
            supposed=[*band.supposed, ACTIVATION_PRIOR]))
    return out


def usable_budget(budget: int, margin: float) -> int:
    """The GPU bytes a plan may predict using of `budget`, keeping `margin` for the memory model's error."""
    return MarginKept(budget, margin).usable


def memory_margin(hw: HardwareSpec, mem_margin: float | None) -> float:
    """The share of the GPU budget kept for the memory model's error: `mem_margin`, else the hardware's."""
    margin = hw.mem_margin if mem_margin is None else mem_margin
    if not (math.isfinite(margin) and 0 <= margin <= 0.5):
        raise CatalogError(f"the memory margin must be between 0 and 0.5 (a share of the budget), got {margin}")
    return margin


def host_memory_margin(hw: HardwareSpec, host_mem_margin: float | None) -> float:
    """The share of the host budget kept for the host model's error: `host_mem_margin`, else the hardware's."""
    margin = hw.host_mem_margin if host_mem_margin is None else host_mem_margin
    if not (math.isfinite(margin) and 0 <= margin <= 0.5):
        raise CatalogError(f"the host memory margin must be between 0 and 0.5 (a share of the budget), got {margin}")
    return margin


def decide_transformer(problem: Problem, usable: int, kept: MarginKept | None, max_slowdown: float | None,
                       target_step_time: float | None, host_budget: int | None = None,
                       host_margin: float = 0.0) -> Decision:
    """The transformer alone, its reason and its error naming the user's budget through `kept`; with `host_budget`,
    its pinned store and the process inside it less `host_margin`, with the fewest disk blocks that bring a streamed
    point inside (the disk tier, tiers.py)."""
    try:
        decision = decide(problem, usable, max_slowdown, target_step_time)
    except Infeasible as exc:
        raise Infeasible(exc.facts, explain.step_infeasible(exc.facts, kept)) from None
    decision = replace(decision, reason=explain.step_reason(decision.facts, kept)
                       + explain.codec_said(decision.chosen, *codec_ratio(problem.hw)))
    decision = decision if host_budget is None else _within_host(problem, decision, host_budget, host_margin)
    host_usable = None if host_budget is None else int(host_budget / (1 + host_margin))
    return _whole_first(problem, decision, host_usable)


def _whole_first(problem: Problem, decision: Decision, host_usable: int | None) -> Decision:
    """The decision with its first block kept whole where a first-block cache makes that faster (whole_first.py),
    inside the same GPU budget and, where one is held, the host budget."""
    def fits(p: Point) -> bool:
        return p.need <= decision.budget and (host_usable is None or host_need(p.memory, problem.hw) <= host_usable)

    q = whole_first(problem, decision.chosen, fits, decision.target_s)
    if q is decision.chosen:
        return decision
    facts = replace(decision.facts, chosen=setting(q, decision.none), need=q.need, time_s=q.step_time)
    return replace(decision, chosen=q, facts=facts, reason=decision.reason + whole_said(q))


def _within_host(problem: Problem, decision: Decision, host_budget: int, margin: float) -> Decision:
    """The decision with its point inside the host budget (less the margin): as is where it fits, else with the
    fewest disk blocks that fit; Infeasible (host memory binds) where even every block on disk does not, or where the
    disk tier cannot be used (no disk rate known, no streaming, fp8 storage)."""
    hw = problem.hw
    usable = int(host_budget / (1 + margin))
    chosen = decision.chosen

    def fits(p: Point) -> bool:
        return host_need(p.memory, hw) <= usable

    if fits(chosen):
        return decision
    encoded = _encoded(problem, decision)
    if encoded is not None:
        if fits(encoded):
            return _encoded_decision(decision, encoded, hw)
        chosen = encoded  # fewer disk blocks bring the encoded store inside
    n = problem.spec.n_blocks
    if chosen.cfg.mode == "none" or chosen.cfg.weight_dtype != "bf16":
        raise _host_infeasible(decision, chosen, host_budget, margin, n, "the disk tier keeps streamed bf16 blocks "
                               "only (the plan streams nothing, or stores fp8)", hw)
    if not disk_known(hw):
        raise _host_infeasible(decision, chosen, host_budget, margin, n, "the disk tier could keep blocks' streamed "
                               f"bytes in the checkpoint's files: {DISK_RATE_REMEDY}", hw)
    disk = fewest_disk_blocks(problem, chosen, fits)
    if not fits(disk):
        raise _host_infeasible(decision, disk, host_budget, margin, n, None, hw)
    encoded_said = "" if chosen is decision.chosen else explain.codec_said(disk, *codec_ratio(hw))
    return replace(decision, chosen=disk, reason=decision.reason + encoded_said
                   + explain.disk_said(disk, hw.disk_read_gbps))


def _encoded_decision(decision: Decision, encoded: Point, hw: HardwareSpec) -> Decision:
    """The decision with its point encoded to fit the host budget, its reason saying so (the codec's lever against
    the raw point the policy had chosen)."""
    raw = setting(decision.chosen, decision.none)
    levers = tuple(lv for lv in decision.facts.levers if lv.name != "codec") + (Lever("codec", True, other=raw),)
    facts = replace(decision.facts, levers=levers, chosen=setting(encoded, decision.none), need=encoded.need,
                    time_s=encoded.step_time)
    return replace(decision, chosen=encoded, facts=facts, reason=explain.step_reason(facts, None)
                   + explain.codec_said(encoded, *codec_ratio(hw)))


def _encoded(problem: Problem, decision: Decision) -> Point | None:
    """The decision's point with its streamed bytes encoded (the codec, tiers.py), where the levers allow the codec,
    the point streams bf16 raw and, encoded, still fits the GPU budget and meets the step target; else None."""
    p = decision.chosen
    if (p.cfg.codec != "none" or p.cfg.mode == "none" or p.cfg.weight_dtype != "bf16"
            or len([c for c in problem.levers.codecs if c != "none"]) == 0):
        return None
    q = problem.evaluate(p.cfg.with_overrides(codec=next(c for c in problem.levers.codecs if c != "none")))
    return q if q.need <= decision.budget and q.step_time <= decision.target_s else None


def _host_infeasible(decision: Decision, p: Point, budget: int, margin: float, n_blocks: int,
                     no_disk: str | None, hw: HardwareSpec) -> Infeasible:
    """Host memory binds for the transformer alone at point `p` (the least host memory tried)."""
    return Infeasible(replace(decision.facts, binding="host memory"),
                      explain.host_infeasible(host_need(p.memory, hw), budget, margin, p.cfg.disk_blocks, n_blocks,
                                              no_disk))


def critical_analysis(spec: ModelSpec, workload: Workload, hardware: ResolvedHardware, sp: int,
                      prefetch_bytes: float | None, text_len: float | None, cfg: OffloadConfig) -> OverlapAnalysis:
    """The overlap analysis of what will run; the hardware must give a finite critical workload."""
    analysis = analyse(spec, workload, hardware.spec, sp, prefetch_bytes, text_len, cfg=cfg)
    if not math.isfinite(analysis.F_star):
        raise CatalogError(f"hardware {hardware.spec.name!r} ({hardware.source}) gives no finite critical workload "
                           "F*: its compute rate is too low for any block to hide a prefetch. Check the profile's "
                           "figures.")
    return analysis


def make_plan(
    spec: ModelSpec, workload: Workload, hardware: ResolvedHardware, *, sp: int = 1, budget: int | None = None,
    max_slowdown: float | None = 1.05, target_step_time: float | None = None, prefetch_bytes: float | None = None,
    text_len: float | None = None, pipeline: bool = True, host_budget: int | None = None,
    target_time: float | None = None, generation_slowdown: float | None = None, levers: Levers | None = None,
    mem_margin: float | None = None, read_bytes: int | None = None, host_mem_margin: float | None = None,
    share_host: bool = True, with_band: bool = True,
) -> tuple[Plan, Decision, OverlapAnalysis]:
    """Analyse, decide and assemble the Plan. Raises policy.Infeasible when nothing fits.

    With `pipeline` (and a catalog pipeline for the model) the whole generation is planned: placements of the
    text encoders, transformer and VAE under the GPU budget in every phase and `host_budget` (default: the memory
    this machine's memory less a share for the system: pipeline.hostinfo), against `target_time` or `generation_slowdown` x everything on the GPU if given.
    Otherwise the transformer alone, as the ChunkFlow paper does. `levers`: batched CFG and fp8 storage the policy
    may choose (default: batched CFG considered where the model has two guidance passes, bf16 weights).
    `mem_margin` (default: the hardware's) keeps every predicted GPU peak under budget / (1 + mem_margin): the
    memory model's measured error, so that a plan that fits on paper fits the card. `read_bytes`: the checkpoint's
    bytes as stored, where the folder is known (the load's prediction; default: the parameters' own bytes).
    `host_mem_margin` (default: the hardware's) keeps the predicted host peak under host_budget / (1 +
    host_mem_margin), the host model's measured error. The transformer alone is held to `host_budget` only where one
    is given (its pinned store and the process), with the fewest disk blocks that fit where the disk rate is known.
    Under SP (`sp` ranks on one host) every rank runs the whole pipeline and the host budget holds the host's memory:
    with `share_host` the ranks share the host-tier tails and parked components, once (pipeline/hostshare.py); the
    plan's offload setting carries `share_host`. `with_band` False leaves the bands out (a table that shows none:
    `plan --format a,b,c` without a plan file)."""
    hw = hardware.spec
    check_parallel(spec, hw, sp)
    check_cache_parallel(workload, sp)
    gpu = _gpu_budget(hw, budget, mem_margin)
    levers = Levers.of(workload.cfg_passes) if levers is None else levers
    problem = Problem(spec, workload, hw, sp, prefetch_bytes, text_len, levers=levers, share_host=share_host)
    host = _HostBudget(host_budget, "--host-mem-budget", host_memory_margin(hw, host_mem_margin))
    targets = _Targets(max_slowdown, target_step_time, target_time, generation_slowdown)
    decision, whole, host = _decide(problem, hardware, gpu, host, targets, pipeline)
    analysis = critical_analysis(spec, workload, hardware, sp, prefetch_bytes, text_len, decision.chosen.cfg)
    plan = assemble(spec, workload, hardware, problem, decision, analysis, gpu.given, gpu.margin)
    plan = _with_host_budget(plan, problem, decision, whole, host, read_bytes)
    if with_band:
        plan = with_bands(plan, problem, decision.chosen, whole, read_bytes,
                          host_alone=whole is None and host.bytes is not None)
    return plan, decision, analysis


@dataclass(frozen=True)
class _GpuBudget:
    """The GPU budget a plan is held to: the bytes given (or the GPU's), the share kept for the memory model's
    error, the bytes the policy checks and how the messages name them."""

    given: int
    margin: float
    usable: int
    kept: MarginKept | None


def _gpu_budget(hw: HardwareSpec, budget: int | None, mem_margin: float | None) -> _GpuBudget:
    """The GPU budget of `budget` bytes (default: the GPU's memory) less the memory margin (default: the
    hardware's)."""
    budget = hw.memory_bytes if budget is None else budget
    margin = memory_margin(hw, mem_margin)
    usable = usable_budget(budget, margin)  # the one budget the policy checks
    kept = MarginKept(budget, margin) if margin > 0 else None  # how the messages name it
    return _GpuBudget(budget, margin, usable, kept)


@dataclass(frozen=True)
class _HostBudget:
    """The host budget a plan is held to: its bytes (None: none checked), how they were chosen, and the share kept
    for the host model's error."""

    bytes: int | None
    source: str
    margin: float


@dataclass(frozen=True)
class _Targets:
    """The latency targets: a step's, relative or absolute, and the whole generation's."""

    max_slowdown: float | None
    target_step_time: float | None
    target_time: float | None
    generation_slowdown: float | None


def _decide(problem: Problem, hardware: ResolvedHardware, gpu: _GpuBudget, host: _HostBudget, targets: _Targets,
            pipeline: bool) -> tuple[Decision, PipelineDecision | None, _HostBudget]:
    """The decision: the whole pipeline's where it is planned (with this machine's host budget where none is
    given), else the transformer's alone; the host budget it was held to."""
    step_targets = (targets.max_slowdown, targets.target_step_time)
    if not plans_pipeline(problem, pipeline):
        return decide_transformer(problem, gpu.usable, gpu.kept, *step_targets, host.bytes, host.margin), None, host
    if host.bytes is None:
        got, source = host_budget_of(hardware)
        host = _HostBudget(got, source, host.margin)
    host_usable = UNCHECKED_HOST_BUDGET if host.bytes is None else int(host.bytes / (1 + host.margin))
    decision, whole = decide_whole(problem, gpu.usable, gpu.kept, host_usable, *step_targets, targets.target_time,
                                   targets.generation_slowdown,
                                   None if host.bytes is None else (host.bytes, host.margin))
    return decision, whole, host


def _with_host_budget(plan: Plan, problem: Problem, decision: Decision, whole: PipelineDecision | None,
                      host: _HostBudget, read_bytes: int | None) -> Plan:
    """The plan with its pipeline section where the whole pipeline was planned, and the host budget it was held
    to (the transformer's own host memory predicted where it alone was held to one)."""
    if whole is not None:
        return with_pipeline(plan, problem.spec, whole, read_bytes).model_copy(update={
            "host_memory_budget_source": host.source, "host_memory_budget_bytes": host.bytes,
            "host_memory_margin": None if host.bytes is None else host.margin})
    if host.bytes is None:
        return plan
    pred = plan.prediction.model_copy(update={"host_memory_bytes": int(host_need(decision.chosen.memory, problem.hw))})
    return plan.model_copy(update={"prediction": pred, "host_memory_budget_bytes": host.bytes,
                                   "host_memory_budget_source": "--host-mem-budget",
                                   "host_memory_margin": host.margin})


def assemble(spec: ModelSpec, workload: Workload, hardware: ResolvedHardware, problem: Problem, decision: Decision,
             analysis: OverlapAnalysis, budget: int, margin: float) -> Plan:
    """The transformer's Plan: what runs, its analysis, its prediction against the baselines, and why."""
    hw = hardware.spec
    chosen = decision.chosen
    return Plan(
        model=PlanModel(
            name=spec.name, n_blocks=spec.n_blocks, block_bytes_total=spec.block_bytes_total, non_block_bytes=spec.non_block_bytes,
            # a derived entry, or one in a stored format, travels with its plan (model_of)
            spec=spec if spec.derived is not None or spec.stored is not None else None,
        ),
        workload=PlanWorkload(
            batch=workload.batch, frames=workload.frames, height=workload.height, width=workload.width,
            tokens=tokens(spec, workload), steps=workload.steps, cfg_passes=workload.cfg_passes,
            cache=workload.cache,
        ),
        parallel=PlanParallel(sp_degree=problem.sp),
        hardware=PlanHardware(
            name=hw.name, source=hardware.source, peak_tflops=hw.peak_tflops, h2d_gbps=hw.h2d_gbps,
            eta_comp=hw.eta_comp, eta_pref=hw.eta_pref, memory_bytes=hw.memory_bytes, peer_link=hw.peer_link,
            spec=hw.model_dump(mode="json"),
        ),
        analysis=_plan_analysis(analysis, hw),
        offload=chosen.cfg.with_overrides(comm_aware=problem.aware, share_host=problem.share_host),
        prediction=PlanPrediction(
            **_prediction(chosen, hw, workload.cfg_passes).model_dump(), cache=cache_prediction(workload, chosen),
            baselines=Baselines(none=_prediction(decision.none), layerwise=_prediction(decision.layerwise),
                                none_cfg_batched=decision.none.cfg.cfg_batched),
        ),
        format=plan_format(spec, chosen.cfg, workload, hw),
        memory_budget_bytes=budget,
        memory_margin=margin,
        target_step_time_s=decision.target_s,
        reason=decision.reason,
    )


def check_cache_parallel(workload: Workload, sp: int) -> None:
    """A step cache that decides from the data refused under sequence parallelism (stepcache.parallel_problem,
    CacheError); one whose schedule is known ahead decides the same on every rank and is planned as on one GPU."""
    if sp > 1 and workload.cache is not None:
        from chunkflow_planner.stepcache import CacheError, parallel_problem

        problem = parallel_problem(workload.cache.setting)
        if problem is not None:
            raise CacheError(f"--cache {workload.cache.label()} with --sp {sp}: {problem}")


def cache_prediction(workload: Workload, point) -> CachePrediction | None:
    """The step cache's steps and seconds at `point` (stepcache.cached_steps), at its hit rate and the spread's
    ends; None without a cache."""
    from chunkflow_planner.stepcache import cached_steps

    cache = workload.cache
    if cache is None:
        return None
    passes = per_forward(workload, point.cfg.cfg_batched)[1]

    def at(rate):  # noqa: ANN001, ANN202
        return cached_steps(cache, workload.steps, point.step_time, point.time, passes, rate)

    mid = at(None)
    if cache.hit_rate is None:  # a schedule: no spread
        ends = (mid, mid)
    else:
        ends = (at(min(0.999, cache.hit_rate + cache.hit_rate_spread)), at(max(0.0, cache.hit_rate - cache.hit_rate_spread)))
    uncached = workload.steps * point.step_time
    return CachePrediction(label=cache.label(), hit_rate=cache.hit_rate, hit_rate_source=cache.hit_rate_source,
                           computed_steps=mid.computed, skipped_steps=mid.skipped,
                           computed_steps_range=(ends[0].computed, ends[1].computed), steps_s=mid.time_s,
                           steps_s_range=(ends[0].time_s, ends[1].time_s), uncached_steps_s=uncached,
                           speedup=uncached / mid.time_s if mid.time_s > 0 else 1.0)


def _plan_analysis(analysis: OverlapAnalysis, hw: HardwareSpec) -> Analysis:
    """The plan's section of the overlap analysis."""
    return Analysis(
        block_flops_per_gpu=analysis.F_block, prefetch_bytes_per_block=analysis.B_pref, f_star=analysis.F_star,
        i_block=analysis.I_block, i_star=analysis.I_star, t_comp_s=analysis.T_comp, t_pref_s=analysis.T_pref,
        eta_comp_used=analysis.F_block / (analysis.T_comp * hw.peak_tflops * 1e12),  # eq. 1 solved for eta
        regime=analysis.regime,
        critical=Critical(
            axis=analysis.critical.axis, value=analysis.critical.value,
            nearest_valid=analysis.critical.nearest_valid, reason=analysis.critical.reason,
        ),
    )
