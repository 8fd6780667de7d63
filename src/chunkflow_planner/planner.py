"""From a model, workload, hardware and constraints to a Plan: the planner's one entry point.

It composes the two halves: the transformer-streaming core (policy, overlap, plan) and, where the model has a
pipeline in the catalog, the whole-pipeline extension (chunkflow_planner.pipeline), which it alone calls."""

from __future__ import annotations

import math
import os
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
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.overlap import OverlapAnalysis, analyse
from chunkflow_planner.plan import (
    Analysis,
    Baselines,
    Critical,
    Plan,
    PlanHardware,
    PlanModel,
    PlanParallel,
    PlanPrediction,
    PlanWorkload,
    Prediction,
)
from chunkflow_planner.policy import Decision, Infeasible, Levers, Point, Problem, decide
from chunkflow_planner.workload import WorkloadError, tokens
from chunkflow_planner.pipeline.assemble import decide_whole, plans_pipeline, with_pipeline
from chunkflow_planner.pipeline.hostinfo import UNCHECKED_HOST_BUDGET, default_host_budget

DEFAULT_HARDWARE = "h200"
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
) -> ResolvedHardware:
    """The hardware to plan for: a catalog name or profile path, else the saved profile, else the default.

    What-if overrides replace single figures; `h2d_gbps` is the effective per-GPU BW_h2d.
    """
    ranges = {"peak_tflops": PEAK_TFLOPS_RANGE, "h2d_gbps": H2D_GBPS_RANGE, "eta_comp": EFFICIENCY_RANGE,
              "eta_pref": EFFICIENCY_RANGE}
    for key, value in (("peak_tflops", peak_tflops), ("h2d_gbps", h2d_gbps), ("eta_comp", eta_comp),
                       ("eta_pref", eta_pref)):
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
    for key, value in (("peak_tflops", peak_tflops), ("eta_comp", eta_comp), ("eta_pref", eta_pref)):
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


def _prediction(p: Point, hw: HardwareSpec | None = None, passes: int = 1) -> Prediction:
    """A point's prediction; with a disk tier, its reads a step (`passes` forwards unless CFG is batched)."""
    disk = {}
    if p.cfg.disk_blocks and hw is not None:
        disk = dict(disk_read_bytes_per_step=int(p.memory.disk_read * (1 if p.cfg.cfg_batched else passes)),
                    disk_read_gbps=hw.disk_read_gbps, disk_stall_s=p.time.disk_stall)
    return Prediction(step_time_s=p.step_time, peak_memory_bytes=p.memory.peak,
                      pinned_host_bytes=int(p.memory.pinned_host), **disk)


def usable_budget(budget: int, margin: float) -> int:
    """The GPU bytes a plan may predict using of `budget`, keeping `margin` for the memory model's error."""
    return MarginKept(budget, margin).usable


def memory_margin(hw: HardwareSpec, mem_margin: float | None) -> float:
    """The share of the GPU budget kept for the memory model's error: `mem_margin`, else the hardware's."""
    margin = hw.mem_margin if mem_margin is None else mem_margin
    if not (math.isfinite(margin) and 0 <= margin <= 0.5):
        raise CatalogError(f"the memory margin must be between 0 and 0.5 (a share of the budget), got {margin}")
    return margin


def decide_transformer(problem: Problem, usable: int, kept: MarginKept | None, max_slowdown: float | None,
                       target_step_time: float | None) -> Decision:
    """The transformer alone, its reason and its error naming the user's budget through `kept`."""
    try:
        decision = decide(problem, usable, max_slowdown, target_step_time)
    except Infeasible as exc:
        raise Infeasible(exc.facts, explain.step_infeasible(exc.facts, kept)) from None
    return replace(decision, reason=explain.step_reason(decision.facts, kept))


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
    spec: ModelSpec,
    workload: Workload,
    hardware: ResolvedHardware,
    *,
    sp: int = 1,
    budget: int | None = None,
    max_slowdown: float | None = 1.05,
    target_step_time: float | None = None,
    prefetch_bytes: float | None = None,
    text_len: float | None = None,
    pipeline: bool = True,
    host_budget: int | None = None,
    target_time: float | None = None,
    generation_slowdown: float | None = None,
    levers: Levers | None = None,
    mem_margin: float | None = None,
    read_bytes: int | None = None,
) -> tuple[Plan, Decision, OverlapAnalysis]:
    """Analyse, decide and assemble the Plan. Raises policy.Infeasible when nothing fits.

    With `pipeline` (and a catalog pipeline for the model, SP 1) the whole generation is planned: placements of the
    text encoders, transformer and VAE under the GPU budget in every phase and `host_budget` (default: the memory
    this machine's memory less a share for the system: pipeline.hostinfo), against `target_time` or `generation_slowdown` x everything on the GPU if given.
    Otherwise the transformer alone, as the ChunkFlow paper does. `levers`: batched CFG and fp8 storage the policy
    may choose (default: batched CFG considered where the model has two guidance passes, bf16 weights).
    `mem_margin` (default: the hardware's) keeps every predicted GPU peak under budget / (1 + mem_margin): the
    memory model's measured error, so that a plan that fits on paper fits the card. `read_bytes`: the checkpoint's
    bytes as stored, where the folder is known (the load's prediction; default: the parameters' own bytes)."""
    hw = hardware.spec
    check_parallel(spec, hw, sp)
    budget = hw.memory_bytes if budget is None else budget
    margin = memory_margin(hw, mem_margin)
    usable = usable_budget(budget, margin)  # the one budget the policy checks
    kept = MarginKept(budget, margin) if margin > 0 else None  # how the messages name it
    levers = Levers.of(workload.cfg_passes) if levers is None else levers
    problem = Problem(spec, workload, hw, sp, prefetch_bytes, text_len, levers=levers)
    whole = None
    if plans_pipeline(problem, pipeline):
        host_source = "--host-mem-budget"
        if host_budget is None:
            host_budget, host_source = host_budget_of(hardware)
        decision, whole = decide_whole(problem, usable, kept, UNCHECKED_HOST_BUDGET if host_budget is None
                                       else host_budget, max_slowdown, target_step_time, target_time,
                                       generation_slowdown)
    else:
        decision = decide_transformer(problem, usable, kept, max_slowdown, target_step_time)
    analysis = critical_analysis(spec, workload, hardware, sp, prefetch_bytes, text_len, decision.chosen.cfg)
    plan = assemble(spec, workload, hardware, problem, decision, analysis, budget, margin)
    if whole is not None:
        plan = with_pipeline(plan, spec, whole, read_bytes).model_copy(update={
            "host_memory_budget_source": host_source,
            **({"host_memory_budget_bytes": None} if host_budget is None else {})})
    return plan, decision, analysis


def assemble(spec: ModelSpec, workload: Workload, hardware: ResolvedHardware, problem: Problem, decision: Decision,
             analysis: OverlapAnalysis, budget: int, margin: float) -> Plan:
    """The transformer's Plan: what runs, its analysis, its prediction against the baselines, and why."""
    hw = hardware.spec
    chosen = decision.chosen
    return Plan(
        model=PlanModel(
            name=spec.name, n_blocks=spec.n_blocks, block_bytes_total=spec.block_bytes_total, non_block_bytes=spec.non_block_bytes
        ),
        workload=PlanWorkload(
            batch=workload.batch, frames=workload.frames, height=workload.height, width=workload.width,
            tokens=tokens(spec, workload), steps=workload.steps, cfg_passes=workload.cfg_passes,
        ),
        parallel=PlanParallel(sp_degree=problem.sp),
        hardware=PlanHardware(
            name=hw.name, source=hardware.source, peak_tflops=hw.peak_tflops, h2d_gbps=hw.h2d_gbps,
            eta_comp=hw.eta_comp, eta_pref=hw.eta_pref, memory_bytes=hw.memory_bytes, peer_link=hw.peer_link,
            spec=hw.model_dump(mode="json"),
        ),
        analysis=_plan_analysis(analysis, hw),
        offload=chosen.cfg.with_overrides(comm_aware=problem.aware),
        prediction=PlanPrediction(
            **_prediction(chosen, hw, workload.cfg_passes).model_dump(),
            baselines=Baselines(none=_prediction(decision.none), layerwise=_prediction(decision.layerwise),
                                none_cfg_batched=decision.none.cfg.cfg_batched),
        ),
        memory_budget_bytes=budget,
        memory_margin=margin,
        target_step_time_s=decision.target_s,
        reason=decision.reason,
    )


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
