"""`chunkflow run`: execute a plan's workload with real denoising steps, measure, compare with the planner.

One step = `cfg_passes` transformer forwards and one `FlowMatchEulerDiscreteScheduler.step`. Step time is
measured with CUDA events (perf_counter on the CPU), peak GPU memory with torch's allocator statistics reset
after the warm-up; the prediction for the mode actually run comes from `Problem.evaluate(OffloadConfig(...))`
with the plan's hardware, workload and SP degree. Relative errors are (measured - predicted) / predicted.

The pieces are separate so `chunkflow bench` and the GPU accuracy script can build a model once and reuse it:
`prepare_inputs` + `denoise` measure, `predict` predicts, `run_plan` composes them for one plan.
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field

from chunkflow_planner.catalog import CatalogError, HardwareSpec, ModelSpec, Workload, get_hardware, get_model
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.plan import Plan

RUN_REPORT_SCHEMA_VERSION = 1
MODES = ("none", "layerwise", "chunkflow")
DEFAULT_MAX_STEPS = 5


class RunError(ValueError):
    """A run that cannot start (bad plan, model, profile or option); the message says what to fix."""


# --------------------------------------------------------------------------------------------- report


class Measured(BaseModel):
    step_times_s: list[float]
    median_step_s: float
    peak_allocated_bytes: int | None = Field(None, description="torch peak allocated over the timed steps (GPU)")
    peak_reserved_bytes: int | None = None
    pinned_host_bytes: int = 0
    achieved_residency: float | None = None


class Predicted(BaseModel):
    step_time_s: float
    peak_memory_bytes: int
    pinned_host_bytes: int = 0
    regime: str = ""
    compute_s: float = 0.0
    collective_s: float = 0.0
    contention_stall_s: float = 0.0
    prefetch_stall_s: float = 0.0
    overhead_s: float = 0.0


class RelErrors(BaseModel):
    """(measured - predicted) / predicted; None where nothing was measured (peak memory on the CPU)."""

    step_time: float
    peak_memory: float | None = None


class RunConfig(BaseModel):
    mode: str
    chunk_bytes: int | None = None
    residency: float = 0.0
    device: str
    dtype: str
    weights: str = "random"
    warmup: int
    steps: int
    world_size: int = 1
    sp_degree: int = 1
    comm_aware: bool = True


class RunReport(BaseModel):
    schema_version: int = RUN_REPORT_SCHEMA_VERSION
    date: str
    command: str
    gpu: str
    torch: str
    diffusers: str
    hardware: str = Field(description="name of the hardware profile the prediction used")
    plan: Plan
    run: RunConfig
    measured: Measured
    predicted: Predicted
    rel_error: RelErrors
    stats: dict[str, Any] | None = Field(None, description="OffloadHandle.stats() after the timed steps")

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")


def rel_error(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or predicted == 0:
        return None
    return (measured - predicted) / predicted


# ------------------------------------------------------------------------------------------ prediction


def plan_hardware(plan: Plan, profile: str | None = None) -> HardwareSpec:
    """The HardwareSpec to predict with: `profile` if given, else the one embedded in the plan, else the catalog
    entry of the plan's hardware name with the plan's figures laid over it."""
    if profile:
        return get_hardware(profile)  # CatalogError names what is wrong
    hw = plan.hardware
    if hw.spec:
        try:
            return HardwareSpec(**hw.spec)
        except Exception as exc:  # pydantic ValidationError
            raise RunError(f"the plan's embedded hardware profile is malformed ({exc}); pass --profile") from None
    try:
        base = get_hardware(hw.name)
    except CatalogError:
        base = get_hardware("h200")
    return base.model_copy(update=dict(
        name=hw.name, peak_tflops=hw.peak_tflops, eta_comp=hw.eta_comp, eta_pref=hw.eta_pref,
        h2d_link_gbps=hw.h2d_gbps * base.gpus_per_host_link, eta_comp_curve=None,
    ))


def planner_config(mode: str, chunk_bytes: int | None, residency: float, comm_aware: bool = True) -> OffloadConfig:
    return OffloadConfig(mode, chunk_bytes if mode == "chunkflow" else None,  # type: ignore[arg-type]
                         residency if mode == "chunkflow" else 0.0, comm_aware)


def predict(spec: ModelSpec, w: Workload, hw: HardwareSpec, mode: str, chunk_bytes: int | None,
            residency: float, sp: int = 1, comm_aware: bool = True) -> Predicted:
    from chunkflow_planner.overlap import analyse
    from chunkflow_planner.policy import Problem

    point = Problem(spec, w, hw, sp).evaluate(planner_config(mode, chunk_bytes, residency, comm_aware))
    regime = analyse(spec, w, hw, sp).regime
    return Predicted(
        step_time_s=point.step_time, peak_memory_bytes=point.memory.peak,
        pinned_host_bytes=int(point.memory.pinned_host), regime=regime, compute_s=point.time.compute,
        collective_s=point.time.collective, contention_stall_s=point.time.contention_stall,
        prefetch_stall_s=point.time.prefetch_stall, overhead_s=point.time.overhead,
    )


# ----------------------------------------------------------------------------------------- measurement


def workload_of(plan: Plan) -> Workload:
    w = plan.workload
    return Workload(batch=w.batch, frames=w.frames, height=w.height, width=w.width, steps=w.steps,
                    cfg_passes=w.cfg_passes)


def resolve_device(device: str | None):
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from chunkflow.runtime.handle import OffloadError, resolve_device as _resolve

    try:
        return _resolve(device)
    except OffloadError as exc:
        raise RunError(str(exc)) from None


def _timestep_scale(spec: ModelSpec) -> float:
    """The transformer's timestep units, kept with the input builders (models/inputs.py)."""
    from chunkflow.models.inputs import TIMESTEP_SCALE

    return TIMESTEP_SCALE[spec.diffusers.inputs]


@dataclass
class Timing:
    times: list[float]
    peak_allocated: int | None
    peak_reserved: int | None
    latents: Any


def denoise(model, spec: ModelSpec, w: Workload, inputs: dict, device, warmup: int, steps: int,
            guidance: float = 5.0, on_step: Callable[[int, float], None] | None = None) -> Timing:
    """`warmup` + `steps` flow-matching Euler steps of `cfg_passes` forwards each; the timed steps' times.

    Peak memory statistics are reset after the warm-up, so they cover the timed steps only.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    cuda = device.type == "cuda"
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0 if spec.is_video else 3.0)
    scheduler.set_timesteps(warmup + steps, device=device)
    latents = inputs["hidden_states"]
    t_in = inputs["timestep"]
    scale = _timestep_scale(spec)
    times: list[float] = []

    def one_step(t):
        nonlocal latents
        kwargs = dict(inputs, hidden_states=latents, timestep=torch.full_like(t_in, float(t) * scale))
        preds = [model(**kwargs)[0] for _ in range(w.cfg_passes)]
        pred = preds[0] if len(preds) == 1 else preds[1] + guidance * (preds[0] - preds[1])
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]

    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            if i == warmup and cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                one_step(t)
                b.record()
                b.synchronize()  # timing only: outside the runtime's hot path
                dt = a.elapsed_time(b) / 1e3
            else:
                t0 = time.perf_counter()
                one_step(t)
                dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
            if on_step is not None:
                on_step(i, dt)
    peak_a = torch.cuda.max_memory_allocated(device) if cuda else None
    peak_r = torch.cuda.max_memory_reserved(device) if cuda else None
    return Timing(times, peak_a, peak_r, latents)


def environment(device) -> dict[str, str]:
    import diffusers
    import torch

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu, torch=torch.__version__,
                diffusers=diffusers.__version__, command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]))


def measured_of(timing: Timing, stats: dict | None) -> Measured:
    return Measured(
        step_times_s=timing.times, median_step_s=statistics.median(timing.times),
        peak_allocated_bytes=timing.peak_allocated, peak_reserved_bytes=timing.peak_reserved,
        pinned_host_bytes=(stats or {}).get("pinned_bytes", 0),
        achieved_residency=(stats or {}).get("achieved_residency"),
    )


def make_report(env: dict, plan: Plan, cfg: RunConfig, hw: HardwareSpec, m: Measured, p: Predicted,
                stats: dict | None) -> RunReport:
    err = RelErrors(step_time=rel_error(m.median_step_s, p.step_time_s),  # type: ignore[arg-type]
                    peak_memory=rel_error(m.peak_allocated_bytes, p.peak_memory_bytes))
    return RunReport(**env, hardware=hw.name, plan=plan, run=cfg, measured=m, predicted=p, rel_error=err, stats=stats)


# ------------------------------------------------------------------------------------------ one plan


@dataclass
class RunOptions:
    mode: str | None = None
    chunk_size: str | None = None
    residency: float | None = None
    device: str | None = None
    weights: str | None = None
    warmup: int = 1
    steps: int | None = None
    profile: str | None = None
    seed: int = 0


def resolve_options(plan: Plan, o: RunOptions) -> tuple[str, int | None, float]:
    """The mode, chunk bytes and residency to run: the plan's, with the options laid over them, validated."""
    from chunkflow_planner.units import UnitError, parse_size

    mode = o.mode or plan.offload.mode
    if mode not in MODES:
        raise RunError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    chunk = plan.offload.chunk_bytes
    if o.chunk_size is not None:
        try:
            chunk = parse_size(o.chunk_size)
        except UnitError as exc:
            raise RunError(f"--chunk-size: {exc}") from None
    residency = plan.offload.residency if o.residency is None else o.residency
    if not 0.0 <= residency <= 1.0 or math.isnan(residency):
        raise RunError(f"--residency must be in [0, 1], got {residency}")
    if mode == "chunkflow" and chunk is None:
        chunk = 16 * 10**6
    if mode != "chunkflow":
        if o.residency not in (None, 0.0) and mode == "layerwise":
            raise RunError("layerwise streams whole blocks with no residency; use --mode chunkflow for --residency")
        residency, chunk = (1.0 if mode == "none" else 0.0), None
    return mode, chunk, residency


def check_steps(warmup: int, steps: int | None) -> None:
    if steps is not None and steps < 1:
        raise RunError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise RunError(f"--warmup must be >= 0, got {warmup}")


def run_plan(plan: Plan, o: RunOptions, progress: Callable[[int, int], Any] | None = None,
             log: Callable[[str], None] = lambda s: None) -> RunReport | None:
    """Build the plan's model, run warm-up and timed steps under the chosen offload, and report.

    Returns the report on rank 0 (None on other ranks under torchrun).
    """
    import os

    import torch

    from chunkflow.models.build import build_transformer
    from chunkflow.models.inputs import make_inputs
    from chunkflow.runtime.handle import OffloadError

    check_steps(o.warmup, o.steps)
    try:
        spec = get_model(plan.model.name)
    except CatalogError as exc:
        raise RunError(f"the plan's model {plan.model.name!r} is not in the catalog: {exc}") from None
    mode, chunk, residency = resolve_options(plan, o)
    hw = plan_hardware(plan, o.profile)
    w = workload_of(plan)
    steps = o.steps if o.steps is not None else min(DEFAULT_MAX_STEPS, w.steps)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        try:
            from chunkflow.parallel import enable_sequence_parallel, init_distributed
        except ImportError as exc:
            raise RunError(f"WORLD_SIZE={world} asks for sequence parallelism, but chunkflow.parallel is not "
                           f"available ({exc}); run on one GPU without torchrun") from None
        rank, world, device = init_distributed()
    else:
        device = resolve_device(o.device)
    sp = world
    dtype = torch.bfloat16
    if rank == 0 and plan.parallel.sp_degree != sp:
        log(f"note: the plan is for SP={plan.parallel.sp_degree}, this run has {sp} process(es); predicting for SP={sp}")

    t0 = time.perf_counter()
    try:
        model, handle = build_transformer(spec, weights=o.weights, dtype=dtype, device=device, mode=mode,
                                          chunk_size=chunk if chunk is not None else "16MB", residency=residency,
                                          seed=o.seed, comm_aware=plan.offload.comm_aware)
    except (OffloadError, FileNotFoundError) as exc:
        raise RunError(str(exc)) from None
    if world > 1:
        enable_sequence_parallel(model, spec, world)
    log(f"built {spec.name} ({'random' if o.weights is None else o.weights} weights, mode {mode}) "
        f"in {time.perf_counter() - t0:.1f} s on {device}")
    inputs = make_inputs(spec, w, dtype, device, seed=o.seed)
    total = o.warmup + steps
    cb = (lambda i, dt: progress(i + 1, total)) if progress is not None else None
    try:
        timing = denoise(model, spec, w, inputs, device, o.warmup, steps, on_step=cb)
        stats = handle.stats().as_dict()
    finally:
        handle.remove()
    if rank != 0:
        return None
    cfg = RunConfig(mode=mode, chunk_bytes=chunk, residency=residency, device=str(device), dtype=str(dtype),
                    weights=o.weights or "random", warmup=o.warmup, steps=steps, world_size=world, sp_degree=sp,
                    comm_aware=plan.offload.comm_aware)
    pred = predict(spec, w, hw, mode, chunk, residency, sp, plan.offload.comm_aware)
    return make_report(environment(device), plan, cfg, hw, measured_of(timing, stats), pred, stats)
