"""The whole pipeline in the Plan: whether it is planned, its decision beside the transformer's baselines, and the
plan's sections for its placements, its load and its phases (planner.make_plan calls these)."""

from __future__ import annotations

import math
from dataclasses import replace

from chunkflow_planner.catalog import HardwareSpec, ModelSpec
from chunkflow_planner.explain import MarginKept
from chunkflow_planner.pipeline import explain
from chunkflow_planner.pipeline.decide import PipelineDecision, decide_pipeline
from chunkflow_planner.pipeline.hostshare import host_load, streamed_shared
from chunkflow_planner.pipeline.load import T_load, load_estimate, load_parts
from chunkflow_planner.pipeline.phases import estimate
from chunkflow_planner.pipeline.placement import ON_DISK, PHASES, PipelineEstimate
from chunkflow_planner.plan import LoadPrediction, PhasePrediction, PhasesPrediction, Plan, PlanComponent, PlanPipeline
from chunkflow_planner.policy import Decision, Infeasible, Problem, baselines
from chunkflow_planner.reprice import point_prediction
from chunkflow_planner.whole_first import whole_said


def plans_pipeline(problem: Problem, pipeline: bool) -> bool:
    """Whether the whole generation is planned: asked, in the catalog and with the catalog's volumes; under SP every
    rank runs the whole pipeline (placement.py)."""
    return (pipeline and problem.spec.pipeline is not None and problem.prefetch_bytes is None
            and problem.text_len is None)


def decide_whole(problem: Problem, usable: int, kept: MarginKept | None, host_budget: int,
                 max_slowdown: float | None, target_step_time: float | None, target_time: float | None,
                 generation_slowdown: float | None,
                 host_kept: tuple[int, float] | None = None) -> tuple[Decision, PipelineDecision]:
    """The whole pipeline's placements, and the transformer's decision in it with the baselines of the plan; the
    error names the user's budgets through `kept` and `host_kept` (the user's host bytes and the margin kept)."""
    try:
        whole = decide_pipeline(problem.spec, problem.workload, problem.hw, problem, usable, host_budget,
                                max_slowdown, target_step_time, target_time, generation_slowdown)
    except Infeasible as exc:
        raise Infeasible(exc.facts, explain.pipeline_infeasible(exc.facts, kept, host_kept)) from None
    base = baselines(problem, max_slowdown, target_step_time)
    return Decision(whole.chosen.transformer, base.none, base.layerwise, base.target_s, usable,
                    whole.reason + whole_said(whole.chosen.transformer), whole.facts), whole


def load_prediction(spec: ModelSpec, e: PipelineEstimate, read_bytes: int | None = None) -> LoadPrediction:
    """The plan's LoadPrediction of the placement `e` (placement.PipelineEstimate); `read_bytes`: the checkpoint's
    bytes as stored, if known (plan --weights). Under SP the load is the host's, every rank's at once
    (hostshare.host_load); host_peak_bytes stays one process's, host_peak_per_host_bytes is the host's."""
    one = load_estimate(spec, e.placements, e.transformer.memory, e.host_bytes, e.hw, read_bytes,
                        expert_memory=[(r.placement, r.point.memory) for r in e.experts] or None)
    total = sum(spec.component_bytes().values())
    est = host_load(one, sum(e.shared_bytes.values()), streamed_shared(e.placements, e.shared_bytes, spec), e.ranks,
                    e.share_host, (read_bytes if read_bytes is not None else total) / total)
    return LoadPrediction(
        read_bytes=int(est.read_bytes), time_cold_s=T_load(est, 0.0, e.hw), time_warm_s=T_load(est, 1.0, e.hw),
        read_bytes_source=("the checkpoint folder's headers" if read_bytes is not None
                           else "every component's parameters in its own dtype"),
        parts_cold_s=load_parts(est, 0.0, e.hw), h2d_bytes=int(est.h2d_bytes), pinned_bytes=int(est.pinned_bytes),
        fresh_bytes=int(est.fresh_bytes), pinned_while_reading_bytes=int(est.pinned_while_reading),
        host_peak_bytes=int(one.host_peak_bytes),
        host_peak_per_host_bytes=int(est.host_peak_bytes) if e.ranks > 1 else None)


def with_pipeline(plan: Plan, spec: ModelSpec, whole: PipelineDecision, read_bytes: int | None = None) -> Plan:
    """The plan with the whole pipeline's placements, its load's and its phases' predictions."""
    e = whole.chosen
    pl = e.placements
    pipe = spec.pipeline
    disk = {k: int(v) for k, v in e.disk_bytes.items()}
    comps = [PlanComponent(name=te.component, kind="text_encoder", bytes=te.nbytes, placement=p,
                           disk_read_bytes=disk.get(te.component, 0))
             for te, p in zip(pipe.text_encoders, pl.text_encoders)]
    comps += [PlanComponent(name=r.name, kind="transformer", bytes=spec.nbytes, placement=r.placement,
                            disk_read_bytes=disk.get(r.name, 0), steps=r.steps if pipe.experts > 1 else None)
              for r in e.experts]
    comps.append(PlanComponent(name=pipe.vae.component, kind="vae", bytes=pipe.vae.nbytes, placement=pl.vae,
                               disk_read_bytes=disk.get(pipe.vae.component, 0)))
    phases = PhasesPrediction(**{ph: PhasePrediction(time_s=e.phases[ph].time_s, startup_s=e.phases[ph].startup_s,
                                                     peak_memory_bytes=e.peak_memory(ph),
                                                     allocated_bytes=int(e.phases[ph].allocated_bytes),
                                                     parts_s=dict(e.phases[ph].detail))
                                 for ph in PHASES})
    split = e.host_split
    pred = plan.prediction.model_copy(update=dict(
        phases=phases, load=load_prediction(spec, e, read_bytes), generation_time_s=e.generation_time,
        host_memory_bytes=e.host_memory,
        host_memory_shared_bytes=split.shared if e.ranks > 1 else None,
        host_memory_per_rank_bytes=split.per_rank if e.ranks > 1 else None,
        host_memory={k: int(v) for k, v in e.host_bytes.items()}, disk_read_bytes_per_generation=sum(disk.values())))
    return plan.model_copy(update=dict(
        pipeline=PlanPipeline(components=comps, vae_tiling=pl.vae_tiling), prediction=pred,
        host_memory_budget_bytes=whole.host_budget,
        target_time_s=whole.target_s if math.isfinite(whole.target_s) else None))


def repriced_whole(plan: Plan, problem: Problem, whole: PipelineDecision, hw: HardwareSpec,
                   read_bytes: int | None = None) -> Plan:
    """`plan` (made for `problem`, the pipeline as `whole` decided) with its predictions priced on `hw` instead,
    nothing it decided changed: the same placements, the transformer's setting (and a disk expert's) evaluated
    again, the phases, host memory and load priced again (what bands.py moves)."""
    prob = replace(problem, hw=hw)
    e = whole.chosen
    point = prob.evaluate(e.transformer.cfg)
    disk_point = next((prob.evaluate(r.point.cfg) for r in e.experts if r.placement == ON_DISK), None) \
        if e.placements.mixed else None
    e2 = estimate(problem.spec, problem.workload, hw, e.placements, point, None, disk_point, ranks=e.ranks,
                  share_host=e.share_host)
    base = plan.model_copy(update={"prediction": plan.prediction.model_copy(
        update=point_prediction(point, hw, problem.workload.cfg_passes).model_dump())})
    return with_pipeline(base, problem.spec, replace(whole, chosen=e2), read_bytes)
