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
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from chunkflow.launch import torchrun_world
from chunkflow.pipeline_setup import MAX_SEED  # the seed a run builds random weights with
from chunkflow.reports import (Measured, MemorySample, RelErrors, RunConfig, RunError, RunReport, codec_stats,
                              rel_error)
from chunkflow_planner.catalog import CatalogError, ModelSpec, Workload
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.plan import Plan, model_of
from chunkflow_planner.workload import MAX_STEPS  # denoising steps a run takes, as a plan's
from chunkflow_planner.plan import hardware_of
from chunkflow_planner.predict import Predicted, predict

DEFAULT_MAX_STEPS = 5


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
    """Final latents as safetensors ({"latents": ...}, on the CPU), written whole or not at all (serialised here,
    written by write_atomic: a full disk is a FileError naming `path`, not safetensors' own error)."""
    from safetensors.torch import save

    from chunkflow_planner.files import write_atomic

    write_atomic(path, save({"latents": latents.detach().to("cpu").contiguous()}))


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
        **codec_stats(stats),
    )


def make_report(env: dict, plan: Plan, run: RunConfig, hw, m: Measured, p: Predicted,
                stats: dict | None) -> RunReport:
    """The run's report; errors only where the run's device is the kind the plan's hardware (`hw`) describes, and
    a time's only where the plan's times are predictions (a CPU plan's are nominal figures)."""
    comparable = run.device.startswith("cpu") == hw.pipeline.device_is_host
    timed = comparable and not hw.pipeline.device_is_host
    err = RelErrors(step_time=rel_error(m.median_step_s, p.step_time_s) if timed else None,
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
    transformer: str | None = None  # --transformer FILE: the transformer from a single file (a GGUF file)
    transformer_2: str | None = None  # --transformer-2 FILE: the second expert's (Wan2.2-A14B)
    cache: object = None  # with --prompts: the step cache every job runs with (chunkflow_planner.cache.CacheSetting)

    @property
    def transformers(self) -> dict[str, str]:
        """Transformer component -> the single file it is read from."""
        return {k: v for k, v in (("transformer", self.transformer), ("transformer_2", self.transformer_2)) if v}

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
        if self.transformers and self.weights is None:
            raise RunError("--transformer FILE reads the transformer from a file and the rest of the pipeline from "
                           "the folder: give --weights DIR with it")


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
            f"{plan.parallel.sp_degree} -m chunkflow run ...`")
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
        spec = model_of(plan)
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
