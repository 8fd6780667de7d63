"""`chunkflow run`: execute a plan's workload with real denoising steps, measure, compare with the planner.

One step = `cfg_passes` transformer forwards and one `FlowMatchEulerDiscreteScheduler.step`. Step time is
measured with CUDA events (perf_counter on the CPU), peak GPU memory with torch's allocator statistics reset
after the warm-up; the prediction for the setting actually run comes from `chunkflow_planner.predict` with the
plan's hardware, workload and SP degree. Relative errors are (measured - predicted) / predicted.

`denoise` is the measuring loop `chunkflow bench` reuses; `run_plan` builds the plan's model under one
OffloadConfig, runs it and reports.
"""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Sequence

from pydantic import BaseModel, Field, ValidationError

from chunkflow.launch import torchrun_world
from chunkflow.run_generate import GenerationResult
from chunkflow_planner.catalog import CatalogError, ModelSpec, Workload, get_model
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.files import FileError, read_text
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.plan import Plan
from chunkflow_planner.predict import Predicted, hardware_of, predict
from chunkflow_planner.versioned import field_errors

RUN_REPORT_SCHEMA_VERSION = 3
MAX_STEPS = 100_000  # denoising steps a run takes (pipelines use 4-100)
MAX_SEED = 2**62
DEFAULT_MAX_STEPS = 5


class RunError(ChunkflowError):
    """A run that cannot start (bad plan, model, profile or option); the message says what to fix."""


# --------------------------------------------------------------------------------------------- report


class MemorySample(BaseModel):
    """Memory after one timed step: torch's allocated and reserved device bytes (None on the CPU), host RSS."""

    step: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    host_rss_bytes: int


PositiveTime = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Measured(BaseModel):
    step_times_s: list[PositiveTime] = Field(min_length=1)
    median_step_s: PositiveTime
    peak_allocated_bytes: int | None = Field(None, description="torch peak allocated over the timed steps (GPU)")
    peak_reserved_bytes: int | None = None
    pinned_host_bytes: int = 0
    achieved_residency: float | None = None
    memory_trace: list[MemorySample] = Field(default_factory=list, description="memory after every timed step")


class RelErrors(BaseModel):
    """(measured - predicted) / predicted; None where nothing was compared: peak GPU memory on the CPU, and any time
    measured on another kind of device than the plan's (a GPU's prediction run on the CPU)."""

    step_time: float | None = None
    peak_memory: float | None = None


class RunConfig(BaseModel):
    offload: OffloadConfig
    device: str
    dtype: str
    weights: str = "random"
    warmup: int
    steps: int
    world_size: int = 1
    sp_degree: int = 1


class RunReport(BaseModel):
    schema_version: int = RUN_REPORT_SCHEMA_VERSION
    date: str
    command: str
    gpu: str
    torch: str
    diffusers: str
    triton: str | None = Field(None, description="Triton's version where installed (the fp8 cast kernel)")
    transformers: str | None = Field(None, description="transformers' version where installed (its text encoders' "
                                     "operator counts change with it)")
    hardware: str = Field(description="name of the hardware profile the prediction used")
    plan: Plan
    run: RunConfig
    measured: Measured
    predicted: Predicted
    rel_error: RelErrors
    stats: dict[str, Any] | None = Field(None, description="OffloadHandle.stats() after the timed steps")
    generation: GenerationResult | None = Field(None, description="`run --prompt`: the whole generation, phase by "
                                                "phase, measured against the plan")

    def write(self, path: str | Path) -> None:
        from chunkflow_planner.files import write_atomic

        write_atomic(path, self.model_dump_json(indent=2) + "\n")


def _upgrade(data: dict) -> dict:
    """An older report in today's layout: version 1 held the offload setting as flat fields of `run`; version 2
    had no `generation` section."""
    if data.get("schema_version") == 1 and isinstance(data.get("run"), dict):
        run = dict(data["run"])
        fields = {k: run.pop(k) for k in ("mode", "chunk_bytes", "residency", "comm_aware") if k in run}
        data = {**data, "schema_version": 2, "run": {**run, "offload": fields}}
    if data.get("schema_version") == 2:
        data = {**data, "schema_version": RUN_REPORT_SCHEMA_VERSION}
    return data


def load_reports(paths: Sequence[str | Path]) -> list[RunReport]:
    """RunReports from .json files (one report) or .jsonl files (one per line); version 1 reports are upgraded."""
    out = []
    for p in paths:
        path = Path(p)
        try:
            text = read_text(path, "run report")
        except FileError as exc:
            raise RunError(str(exc)) from None
        lines = [ln for ln in text.splitlines() if ln.strip()] if path.suffix == ".jsonl" else [text]
        for i, line in enumerate(lines):
            where = f"{str(path)!r}{f' line {i + 1}' if len(lines) > 1 else ''}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"run report {where} is not JSON: {exc}") from None
            except RecursionError:
                raise RunError(f"run report {where} is nested too deeply to be a run report") from None
            data = _upgrade(data) if isinstance(data, dict) else data
            if not isinstance(data, dict) or data.get("schema_version") != RUN_REPORT_SCHEMA_VERSION:
                raise RunError(f"{where} is not a run report of schema_version {RUN_REPORT_SCHEMA_VERSION} "
                               "(write it with `chunkflow run`)")
            try:
                out.append(RunReport.model_validate(data))
            except ValidationError as exc:
                raise RunError(f"run report {where} is malformed: {field_errors(exc)}") from None
            except (TypeError, ValueError, RecursionError) as exc:  # a section's own check (its offload setting's)
                raise RunError(f"run report {where} is malformed: {exc}") from None
    if not out:
        raise RunError("no run reports given")
    return out


def rel_error(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or predicted == 0:
        return None
    return (measured - predicted) / predicted


# ----------------------------------------------------------------------------------------- measurement


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
    memory: list[MemorySample]


def save_latents(path: str, latents) -> None:
    """Final latents as safetensors ({"latents": ...}, on the CPU), written whole or not at all."""
    from safetensors.torch import save_file

    from chunkflow_planner.files import atomic_path

    with atomic_path(path, ".safetensors") as tmp:
        save_file({"latents": latents.detach().to("cpu").contiguous()}, tmp)


def denoise(model, spec: ModelSpec, w: Workload, inputs: dict, device, warmup: int, steps: int,
            guidance: float = 5.0, on_step: Callable[[int, float], None] | None = None,
            cfg_batched: bool = False) -> Timing:
    """`warmup` + `steps` flow-matching Euler steps of `cfg_passes` forwards each (with `cfg_batched`, one forward of
    the passes stacked along the batch, chunkflow.cfg); the timed steps' times, and the
    memory after each of them (allocated and reserved device bytes, host RSS: a leak shows as a slope).

    Peak memory statistics are reset after the warm-up, so they cover the timed steps only.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from chunkflow.cfg import split_passes, stack_passes
    from chunkflow.hostmem import rss_bytes
    from chunkflow.timing import time_on

    cuda = device.type == "cuda"
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0 if spec.is_video else 3.0)
    scheduler.set_timesteps(warmup + steps, device=device)
    latents = inputs["hidden_states"]
    t_in = inputs["timestep"]
    scale = _timestep_scale(spec)
    times: list[float] = []
    memory: list[MemorySample] = []

    def one_step(t):
        nonlocal latents
        kwargs = dict(inputs, hidden_states=latents, timestep=torch.full_like(t_in, float(t) * scale))
        if cfg_batched and w.cfg_passes > 1:
            preds = [out[0] for out in split_passes(model(**stack_passes([kwargs] * w.cfg_passes, w.batch)),
                                                    w.cfg_passes)]
        else:
            preds = [model(**kwargs)[0] for _ in range(w.cfg_passes)]
        pred = preds[0] if len(preds) == 1 else preds[1] + guidance * (preds[0] - preds[1])
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]

    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            if i == warmup and cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            _, dt = time_on(cuda, lambda: one_step(t))  # timing only: outside the runtime's hot path
            if i >= warmup:
                times.append(dt)
                memory.append(MemorySample(
                    step=i, allocated_bytes=torch.cuda.memory_allocated(device) if cuda else None,
                    reserved_bytes=torch.cuda.memory_reserved(device) if cuda else None, host_rss_bytes=rss_bytes()))
            if on_step is not None:
                on_step(i, dt)
    peak_a = torch.cuda.max_memory_allocated(device) if cuda else None
    peak_r = torch.cuda.max_memory_reserved(device) if cuda else None
    return Timing(times, peak_a, peak_r, latents, memory)


def environment(device) -> dict[str, str | None]:
    import diffusers
    import torch

    from importlib.metadata import PackageNotFoundError, version

    triton = transformers = None
    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        pass
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):  # the names PyTorch's builds install it under
        try:
            triton = version(dist)
            break
        except PackageNotFoundError:
            pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu, torch=torch.__version__,
                diffusers=diffusers.__version__, triton=triton, transformers=transformers,
                command=shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]))  # quoted: it runs again as printed


def measured_of(timing: Timing, stats: dict | None) -> Measured:
    return Measured(
        step_times_s=timing.times, median_step_s=statistics.median(timing.times),
        peak_allocated_bytes=timing.peak_allocated, peak_reserved_bytes=timing.peak_reserved,
        pinned_host_bytes=(stats or {}).get("pinned_bytes", 0),
        achieved_residency=(stats or {}).get("achieved_residency"), memory_trace=timing.memory,
    )


def make_report(env: dict, plan: Plan, run: RunConfig, hw, m: Measured, p: Predicted,
                stats: dict | None) -> RunReport:
    """The run's report; errors only where the run's device is the kind the plan's hardware (`hw`) describes."""
    comparable = run.device.startswith("cpu") == hw.device_is_host
    err = RelErrors(step_time=rel_error(m.median_step_s, p.step_time_s) if comparable else None,
                    peak_memory=rel_error(m.peak_allocated_bytes, p.peak_memory_bytes) if comparable else None)
    hw_name = hw.name
    return RunReport(**env, hardware=hw_name, plan=plan, run=run, measured=m, predicted=p, rel_error=err, stats=stats)


# ------------------------------------------------------------------------------------------ one plan


@dataclass
class RunOptions:
    """How to run (the offload setting itself is an OffloadConfig)."""

    device: str | None = None
    weights: str | None = None
    variant: str | None = None
    warmup: int = 1
    steps: int | None = None
    profile: str | None = None
    seed: int = 0
    latents: str | None = None  # save the final latents here (safetensors)
    repeat: int = 1  # with --prompt: generations measured after the warm-up (their median is reported)

    def check(self) -> None:
        if self.steps is not None and not 1 <= self.steps <= MAX_STEPS:
            raise RunError(f"--steps must be between 1 and {MAX_STEPS}, got {self.steps}")
        if not 0 <= self.seed <= MAX_SEED:  # (components draw with seed + a few hundred)
            raise RunError(f"--seed must be between 0 and 2**62 ({MAX_SEED}), got {self.seed}")
        if self.warmup < 0:
            raise RunError(f"--warmup must be >= 0, got {self.warmup}")
        if self.repeat < 1:
            raise RunError(f"--repeat must be at least 1, got {self.repeat}")
        if self.repeat > 1 and self.warmup == 0:
            raise RunError("--repeat measures generations after a warm-up one: a process's first generation pays "
                           "its start-up, which the plan predicts apart. Use --warmup 1 (the default with --repeat)")
        if self.variant is not None and self.weights is None:
            raise RunError("--variant picks files in a weights directory; give --weights DIR with it")


def _place(o: RunOptions, world: int, plan: Plan, log: Callable[[str], None]):
    """(rank, device): join the torchrun job under WORLD_SIZE > 1 (SP = world), else the requested device."""
    if world > 1:
        from chunkflow.parallel import init_distributed

        rank, _, device = init_distributed()
        if rank == 0 and plan.parallel.sp_degree != world:
            log(f"note: the plan is for SP={plan.parallel.sp_degree}, this run has {world} processes; "
                f"predicting for SP={world}")
        return rank, device
    if plan.parallel.sp_degree > 1:
        log(f"note: the plan is for SP={plan.parallel.sp_degree} ({plan.parallel.sp_degree} processes) and this run is "
            f"one process: predicting for SP=1; to run the plan, launch it with `torchrun --nproc-per-node "
            f"{plan.parallel.sp_degree} -m chunkflow.cli run ...`")
    from chunkflow.runtime.resolve import resolve_device

    return 0, resolve_device(o.device, hint="--device cpu")


def run_plan(plan: Plan, cfg: OffloadConfig, o: RunOptions, progress: Callable[[int, int], Any] | None = None,
             log: Callable[[str], None] = lambda s: None) -> RunReport | None:
    """Build the plan's model under `cfg`, run warm-up and timed steps, and report (rank 0; None on other ranks)."""
    import torch

    from chunkflow.models.build import build_transformer
    from chunkflow.models.inputs import make_inputs
    from chunkflow.runtime.storage import Fp8RoundedWeightsWarning

    o.check()
    if o.repeat != 1:
        raise RunError("--repeat counts measured generations and needs --prompt; a synthetic run times --steps "
                       "denoising steps")
    try:
        spec = get_model(plan.model.name)
    except CatalogError as exc:
        raise RunError(f"the plan's model {plan.model.name!r} is not in the catalog: {exc}") from None
    hw = hardware_of(plan, o.profile)
    w = plan.workload.to_workload()
    steps = o.steps if o.steps is not None else min(DEFAULT_MAX_STEPS, w.steps)
    world = torchrun_world()
    rank, device = _place(o, world, plan, log)
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    model, handle = build_transformer(spec, weights=o.weights, dtype=dtype, device=device, config=cfg, seed=o.seed,
                                      variant=o.variant)
    if world > 1:
        from chunkflow.parallel import enable_sequence_parallel

        enable_sequence_parallel(model, spec, world)
    log(f"built {spec.name} ({'random' if o.weights is None else o.weights} weights, {cfg.label}) "
        f"in {time.perf_counter() - t0:.1f} s on {device}")
    inputs = make_inputs(spec, w, dtype, device, seed=o.seed)
    total = o.warmup + steps
    cb = (lambda i, dt: progress(i + 1, total)) if progress is not None else None
    try:
        timing = denoise(model, spec, w, inputs, device, o.warmup, steps, on_step=cb, cfg_batched=cfg.cfg_batched)
        stats = handle.stats().as_dict()
    finally:
        with warnings.catch_warnings():  # the run is done with the weights: their fp8 rounding is no news
            warnings.simplefilter("ignore", Fp8RoundedWeightsWarning)
            handle.remove()
    if rank != 0:
        return None
    if o.latents:
        save_latents(o.latents, timing.latents)
    run = RunConfig(offload=cfg, device=str(device), dtype=str(dtype), weights=o.weights or "random",
                    warmup=o.warmup, steps=steps, world_size=world, sp_degree=world)
    pred = predict(spec, w, hw, cfg, world)
    return make_report(environment(device), plan, run, hw, measured_of(timing, stats), pred, stats)
