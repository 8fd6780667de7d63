"""A plan's whole pipeline built for generating (`run --prompt`, `run --prompts`, chunkflow.load): the model, the
hardware it is compared with, the workload, the device, every component placed as the plan says, and the load measured
against the plan's prediction of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from chunkflow.reports import LoadResult
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.plan import Plan
from chunkflow_planner.units import format_bytes

MAX_SEED = 2**62  # the build seed's bound: components draw random weights with it plus a few hundred


def placements_of(plan: Plan) -> tuple[dict[str, str], bool]:
    """component -> placement from the plan's pipeline section (a plan made with --transformer-only: the transformer
    as planned, everything else for its phase only)."""
    if plan.pipeline is not None:
        return {c.name: c.placement for c in plan.pipeline.components}, plan.pipeline.vae_tiling
    where = "gpu" if plan.offload.mode == "none" else "stream"
    return {"transformer": where, "transformer_2": where}, False


@dataclass
class PipelineSetup:
    """What a generation run is made on: the model, the hardware it is compared with, the workload, the device and
    the built pipeline with its load."""

    spec: Any  # ModelSpec
    hw: Any  # HardwareSpec
    w: Any  # Workload, with the steps run
    device: Any  # torch.device
    folder: Any  # the weights' folder, None for random weights
    placements: dict[str, str]
    tiling: bool
    built: Any  # BuiltPipeline
    load: LoadResult
    comparable: bool  # the run's device is the plan's kind (GPU or host)
    planned_disk_reads: dict[str, int]  # component -> bytes the plan reads from its files a generation
    plan_steps: int  # the steps the plan was made for (the run may run others)
    rank: int = 0  # this process's rank in its torchrun job (commands.run_generate: sequence parallel)
    world: int = 1  # the job's processes: the SP degree the pipeline runs with


def setup_pipeline(plan: Plan, cfg: OffloadConfig, device, *, weights: str | None = None, variant: str | None = None,
                   profile: str | None = None, seed: int = 0, steps: int | None = None,
                   progress: Callable[[str, int | None, int | None], None] | None = None,
                   log: Callable[[str], None] = lambda s: None, image: bool = False,
                   transformers: dict[str, str] | None = None) -> PipelineSetup:
    """Resolve the run's model, hardware and workload (`steps` in place of the plan's where given); build the
    pipeline on `device` (a torch.device) with its load measured. `image`: the image pipeline of the family.
    `transformers`: transformer component -> a single file read instead of the folder's (`--transformer FILE`)."""
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow.reports import RunError
    from chunkflow.weights import resolve_weights
    from chunkflow_planner.plan import model_of
    from chunkflow_planner.plan import hardware_of

    spec = model_of(plan)
    if spec.pipeline is None:
        raise RunError(f"{spec.name} has no pipeline in the catalog; run without --prompt for the synthetic benchmark")
    hw = hardware_of(plan, profile)
    w = plan.workload.to_workload()
    w = w.model_copy(update={"steps": steps if steps is not None else w.steps})
    folder = resolve_weights(weights) if weights is not None else None
    placements, tiling = placements_of(plan)
    on_bytes = (lambda done, total: progress("load", done, total)) if progress is not None else None
    built = build_pipeline(spec, placements, cfg, device, weights=folder, seed=seed, vae_tiling=tiling,
                           variant=variant, log=log, on_bytes=on_bytes, image=image,
                           transformer_files={k: Path(v) for k, v in (transformers or {}).items() if v is not None})
    comparable = (device.type == "cuda") != hw.pipeline.device_is_host  # the plan's device is the one run on
    load = load_result(built, plan, hw, folder, variant, comparable)
    log(f"built the {spec.pipeline.cls} ({'random weights' if folder is None else folder}) in "
        f"{load.measured_time_s:.1f} s on {device}")
    for name, path in load.transformer_files.items():
        log(f"{name}: read from {path} ({load.transformer_formats[name]})")
    for name, have in load.component_bytes.items():
        want = load.planned_component_bytes.get(name)
        if want and have > want * 1.01:
            log(f"note: {name} holds {format_bytes(have)}, the plan counted {format_bytes(want)}; its memory "
                "predictions are short by the difference")
    planned_reads = {c.name: c.disk_read_bytes for c in plan.pipeline.components if c.disk_read_bytes} \
        if plan.pipeline is not None else {}
    return PipelineSetup(spec, hw, w, device, folder, placements, tiling, built, load, comparable, planned_reads,
                         plan.workload.steps)


def load_result(built, plan: Plan, hw, folder, variant: str | None, comparable: bool) -> LoadResult:
    """The build's LoadResult: measured (built.load), and the plan's load predicted for the bytes it read and the
    share the page cache held (`comparable`: the run's device is the plan's kind, GPU or host)."""
    from chunkflow.reports import rel_error
    from chunkflow_planner.pipeline.load import LoadEstimate, T_load, load_parts

    m = built.load
    planned = {c.name: c.bytes for c in plan.pipeline.components} if plan.pipeline is not None else {}
    lp = plan.prediction.load
    cached = m.cached_bytes / m.read_bytes if m.read_bytes and m.cached_bytes is not None else None
    pred_t, parts, pred_host = None, {}, None
    if lp is not None and comparable:
        pred_host = lp.host_peak_bytes
        if folder is not None and not hw.pipeline.device_is_host:  # a CPU plan's times are nominal, not predictions
            est = LoadEstimate(m.read_bytes, lp.h2d_bytes, lp.pinned_bytes, lp.host_peak_bytes, lp.fresh_bytes,
                               lp.pinned_while_reading_bytes)
            pred_t = T_load(est, cached or 0.0, hw)
            parts = load_parts(est, cached or 0.0, hw)
    return LoadResult(
        weights=str(folder) if folder is not None else "random", variant=variant, measured_time_s=m.seconds,
        startup_s=m.startup_seconds,
        read_bytes=m.read_bytes, cached_fraction=cached, read_seconds=m.read_seconds,
        pin_seconds=m.pin_seconds, pin_wait_seconds=m.pin_wait_seconds,
        host_peak_bytes=m.host_peak_bytes, component_bytes=m.component_bytes, planned_component_bytes=planned,
        disk_component_bytes=m.disk_component_bytes,
        transformer_files={k: f for k, (f, _) in built.transformer_files.items()},
        transformer_formats={k: fmt for k, (_, fmt) in built.transformer_files.items()},
        predicted_time_s=pred_t, predicted_parts_s=parts, predicted_host_peak_bytes=pred_host,
        time_error=rel_error(m.seconds, pred_t) if pred_t is not None else None,
        host_error=rel_error(m.host_peak_bytes, pred_host) if pred_host is not None else None)
