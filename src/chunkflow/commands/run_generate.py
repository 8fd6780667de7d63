"""`chunkflow run --prompt`: build the plan's whole pipeline with its placements, generate, write the video or image,
and report each phase measured against the plan.

The run report (`reports.RunReport`) gains a `generation` section: per phase the measured time and peak GPU memory
(reserved plus context: what runs out) against the plan's prediction, the process's peak host memory against the
predicted host memory, the whole generation's time. Its `measured` section holds the denoising steps, compared with
the transformer's predicted step time, as for a synthetic run.

The plan predicts a process's first generation, its one-time start-up included (`PhasePrediction.startup_s`). With
`--warmup N` the measured generation comes after N others: it is compared with the prediction less the start-up, and
the first generation's phase times are kept too (`first_phase_times_s`), from which `chunkflow calibrate
--from-report` measures the start-up. With `--repeat N` N generations are measured after the warm-up: each phase's
time is their median (every time kept in `measured_times_s`, so a miss can be told from run-to-run spread), its peak
memory the largest, the transformer's counters in `stats` (forwards, bytes copied) the sum over them; the output
written is the last generation's. The objects alive once the pipeline is built
(torch, diffusers, transformers, the components: hundreds of thousands) are moved out of the garbage collector's
reach for the generations (`gc.freeze`), and what each generation leaves alive before the next, so that a full
collection, which scans every unfrozen object, does not land in a phase at random with most of the process to scan;
each phase's time in the collector is reported (`gc_s`).

Under torchrun (WORLD_SIZE > 1) the run is Ulysses sequence parallel over the processes (chunkflow.parallel): every
rank joins the job, builds the whole pipeline with the plan's placements as one process does (the same offload
calls in the same order on every rank: nothing here depends on the rank), turns on sequence parallelism on every
transformer of the pipeline (Wan2.2-A14B's two experts) once they are placed, and runs the same generations from the
same seed; every rank holds the whole latents after each step (diffusers gathers the transformer's output). The
ranks agree that every one of them built its pipeline before any enters the generation's collectives
(commands.ranks.together). Rank 0 alone writes the output, the latents and the report, whose phases are rank 0's,
with the SP degree in `run`; a plan made for another SP degree is said and predicted for the world size.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from chunkflow.launch import torchrun_world
from chunkflow.pipeline_setup import PipelineSetup, setup_pipeline
from chunkflow.reports import GcCollection, GenerationResult, PhaseResult
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.plan import Plan
from chunkflow_planner.units import format_bytes


@dataclass
class GenerateOptions:
    prompt: str
    negative_prompt: str | None = None
    guidance: float | None = None
    out: str | None = None
    latents: str | None = None
    image: Any = None  # the image to animate or edit (a PIL image, checked; or a path)
    cache: Any = None  # the step cache (chunkflow_planner.cache.CacheSetting), enabled once the pipeline is built


def run_generation(plan: Plan, cfg: OffloadConfig, o, g: GenerateOptions,
                   progress: Callable[[str, int | None, int | None], None] | None = None,
                   log: Callable[[str], None] = lambda s: None):
    """Build, generate, write, report (a RunReport with its `generation` section; None on a torchrun rank other
    than 0, which writes nothing)."""
    from chunkflow.commands.steps import save_latents

    o.check()
    world = torchrun_world()
    enabled: list = []  # the step cache's run (chunkflow.caches.CacheRun), enabled by _setup where --cache is given

    def enable_cache(setup: PipelineSetup) -> None:
        from chunkflow.caches import CacheRun

        enabled.append(CacheRun.enable(g.cache, setup.built, setup.w.steps, log))

    setup = _setup(plan, cfg, o, progress, log, image=g.image is not None, world=world,
                   before_parallel=enable_cache if g.cache is not None else None)
    try:
        runs = _generations(setup, cfg, o, g, progress, log, enabled[0] if enabled else None)
        host = _host_memory(setup.world)  # every rank, while the pipeline (and its shared copies) is still held
    finally:
        setup.built.discard()  # the run is done with it: free, do not copy the weights back
    if setup.rank != 0:
        return None
    pixels = None
    if g.out:
        pixels = _write_output(g.out, runs.last.output, setup.spec, setup.built.random_weights, log)
    if g.latents and runs.last.latents is not None:
        save_latents(g.latents, runs.last.latents)
    report = _report(plan, cfg, o, g, setup, runs, host)
    report.generation.output_pixels = pixels
    report.generation.cache = _with_planned(runs.cache, plan, setup.w.steps)
    return report


def _with_planned(result, plan: Plan, steps: int):
    """The cache's result with the plan's hit rate and computed steps beside it, where the plan priced this very
    setting (and, for the computed steps, these steps)."""
    c, wc = plan.prediction.cache, plan.workload.cache
    if result is None or c is None or wc is None or wc.setting != result.setting:
        return result
    planned = c.skipped_steps / max(1, plan.workload.steps)
    return result.model_copy(update=dict(planned_hit_rate=planned, planned_source=wc.hit_rate_source,
                                         planned_computed_steps=c.computed_steps if steps == plan.workload.steps
                                         else None))


def _setup(plan: Plan, cfg: OffloadConfig, o, progress, log, image: bool = False, world: int = 1,
           before_parallel: Callable[[PipelineSetup], None] | None = None) -> PipelineSetup:
    """The run's device (commands.steps._place: the torchrun job joined where `world` > 1, its notes on SP said),
    then the pipeline built (setup_pipeline), `before_parallel(setup)` (the step cache's hooks), and, where `world`
    > 1, sequence parallel on every transformer; every rank's build agreed on before any generates
    (commands.ranks.together). The setup's `rank` is this process's. The cache's hooks go on first because diffusers
    runs the hook registered last outermost: where a model splits the tokens in a hook on its first block (Wan),
    the split then wraps the cache's head hook, which sees this rank's share, as its tail hook does."""
    from chunkflow.commands.steps import _place

    rank, device = _place(o, world, plan, log)

    def build() -> PipelineSetup:
        setup = setup_pipeline(plan, cfg, device, weights=o.weights, variant=o.variant, profile=o.profile,
                               seed=o.seed, steps=o.steps, progress=progress, log=log, image=image,
                               transformers=o.transformers)
        if before_parallel is not None:
            before_parallel(setup)
        if world > 1:
            from chunkflow.parallel import enable_sequence_parallel

            for name in setup.built.names("transformer"):  # after their offload, as run_plan does
                enable_sequence_parallel(getattr(setup.built.pipe, name), setup.spec, world)
            log(f"sequence parallel (Ulysses) over {world} processes on "
                f"{', '.join(setup.built.names('transformer'))}; rank 0 writes and reports")
        return setup

    if world > 1:
        from chunkflow.commands.ranks import together

        setup = together(build)
    else:
        setup = build()
    setup.rank, setup.world = rank, world
    return setup


@dataclass
class _Runs:
    """The generations run: the measured ones' phases and step times, the first's phase times when it was a
    warm-up, the transformer's counters over the measured ones, and the last generation (its output is written)."""

    measured: list  # (phases, step times) per measured generation; their outputs are not kept
    first: dict[str, float] | None
    first_parts: dict[str, dict[str, float]] | None
    stats: dict
    last: Any  # chunkflow.generate.Generation
    encode_cached: list[bool]  # per measured generation: its encode ran no text encoder (the prompt cache)
    disk_reads: dict[str, int]  # component -> bytes it read from the checkpoint's files a measured generation
    cache: Any = None  # reports.CacheResult: what the step cache skipped in the measured generations (--cache)
    decode: Any = None  # the stored format's decode measured (runtime/codecs/probe.DecodeProbe), or None


def _generations(setup: PipelineSetup, cfg: OffloadConfig, o, g: GenerateOptions, progress, log,
                 cache=None) -> _Runs:
    """The warm-up and measured generations, with the long-lived objects frozen out of the collector's reach.
    `cache`: the step cache's run (chunkflow.caches.CacheRun), whose measured part is reported."""
    freeze = gc.get_freeze_count() == 0  # a host process that froze its own objects keeps its freeze
    if freeze:
        gc.collect()
        gc.freeze()  # the long-lived objects: a full collection no longer scans them (module docstring)
    try:
        return _generate_all(setup, cfg, o, g, progress, log, freeze, cache)
    finally:
        if freeze:
            gc.unfreeze()


def _generate_all(setup: PipelineSetup, cfg: OffloadConfig, o, g: GenerateOptions, progress, log, freeze: bool,
                  cache=None) -> _Runs:
    from chunkflow.generate import generate

    steps = setup.w.steps
    handle = setup.built.handles["transformer"]
    first = first_parts = gen = None
    measured: list = []
    cached: list[bool] = []
    stats_before: dict = {}
    reads_before: dict[str, int] = {}
    for i in range(o.warmup + o.repeat):
        gen = None  # an earlier output must not sit in host memory while the next generation runs
        if freeze and i:  # what the last generation left alive joins the frozen objects, so a full collection
            gc.collect()  # inside the next one has only that generation's to scan (one in a Wan2.2-A14B
            gc.freeze()  # denoise took 318 ms with the pipeline alone frozen; what it spent them on is unknown)
        if setup.built.prompts is not None:  # each generation measured whole, as the plan predicts it: its
            setup.built.prompts.clear()  # prompt encoded again (a library caller's repeats reuse it; generate())
        if i == o.warmup:  # the handle's counters of the measured generations alone
            stats_before = handle.stats().as_dict()
            reads_before = setup.built.disk_reads()
            if cache is not None:
                cache.mark(setup.built)
        k = i - o.warmup
        tag = (f"warm-up {i + 1}/{o.warmup}: " if k < 0 else f"generation {k + 1}/{o.repeat}: " if o.repeat > 1
               else "")
        cb = (lambda i, n, tag=tag: progress(tag + "denoise", i, n)) if progress is not None else None
        counted = {"denoise": steps}  # a bar counts denoising steps; encode and decode have nothing to count
        phase = ((lambda name, tag=tag: progress(tag + name, 0 if name in counted else None, counted.get(name)))
                 if progress is not None else None)
        gen = generate(setup.built, setup.w, g.prompt, negative=g.negative_prompt, guidance=g.guidance, steps=steps,
                       seed=o.seed, on_step=cb, on_phase=phase, cfg_batched=cfg.cfg_batched, image=g.image)
        if i == 0 and o.warmup:
            first = {name: m.time_s for name, m in gen.phases.items()}
            first_parts = {name: m.parts_s for name, m in gen.phases.items() if m.parts_s}
            log("first generation (start-up included): "
                + ", ".join(f"{name} {t:.3f} s" for name, t in first.items()))
        if gen.encode_cached:
            log(f"{tag}encode: the prompt was encoded before in this process; no text encoder ran")
        if k >= 0:
            measured.append((gen.phases, gen.step_times_s))
            cached.append(gen.encode_cached)
            if o.repeat > 1:
                log(f"generation {k + 1}/{o.repeat}: "
                    + ", ".join(f"{name} {m.time_s:.3f} s" for name, m in gen.phases.items()))
    stats = _counted_since(handle.stats().as_dict(), stats_before)
    reads = _disk_reads(setup, reads_before, len(measured), log)
    done = cache.result(setup.built, steps, len(measured)) if cache is not None else None
    return _Runs(measured, first, first_parts, stats, gen, cached, reads, done, _measure_decode(handle, log))


COUNTERS = ("forwards", "h2d_bytes_issued", "refreshes", "relayouts", "blocks_computed", "blocks_skipped",
            "skipped_h2d_bytes")  # the handle's counters a report gives for the measured generations alone


def _counted_since(stats: dict, before: dict) -> dict:
    """The handle's stats with its counters less their values at the measured generations' start."""
    for key in COUNTERS:
        if isinstance(stats.get(key), int) and isinstance(before.get(key), int):
            stats[key] -= before[key]
    return stats


def _disk_reads(setup: PipelineSetup, before: dict[str, int], generations: int, log) -> dict[str, int]:
    """Bytes each component read from the checkpoint's files a measured generation, said against the plan."""
    reads = {name: (n - before.get(name, 0)) // max(1, generations) for name, n in setup.built.disk_reads().items()}
    for name, n in reads.items():
        want = setup.planned_disk_reads.get(name)
        plan_text = f", planned {format_bytes(want)}" if want else ""
        if want and setup.w.steps != setup.plan_steps:  # a transformer's reads grow with the steps
            plan_text += f" for the plan's {setup.plan_steps} steps"
        log(f"{name}: {format_bytes(n)} read from the checkpoint's files a generation{plan_text} "
            f"({setup.placements.get(name, 'stream')})")
    return reads


def _measure_decode(handle, log):
    """The transformer's stored-format decode measured on its device after the generations (None: no such weights,
    or not offloaded)."""
    module = getattr(handle, "module", None)
    if module is None:
        return None
    from chunkflow.models.discover import discover_blocks
    from chunkflow.runtime.codecs.probe import measure_decode, module_layouts

    if handle.layouts:  # offloaded: its blocks as laid out, decoded on its device
        probe = measure_decode(handle.layouts, handle.device)
    else:  # placed whole: its weights decode where they are
        device = next((p.device for p in module.parameters()), None)
        probe = (measure_decode(module_layouts(module, discover_blocks(module)), device) if device is not None
                 else None)
    if probe is not None:
        log(f"decode: {format_bytes(probe.decoded_bytes_per_forward)} of weights a forward, measured at "
            f"{probe.gbps:.0f} GB/s: {probe.seconds_per_forward * 1e3:.1f} ms a forward")
    return probe


def _decode_result(plan: Plan, cfg: OffloadConfig, runs: _Runs, steps: int, compared: bool):
    """The run report's decode: the probe's forward scaled to the step's forwards (counted where the transformer is
    offloaded; else the guidance passes run apart), against the plan's."""
    from chunkflow.reports import DecodeResult, rel_error

    probe = runs.decode
    if probe is None:
        return None
    forwards = runs.stats.get("forwards") or 0
    passes = 1 if cfg.cfg_batched else plan.workload.cfg_passes
    per_step = forwards / max(1, steps * len(runs.measured)) if forwards else passes
    measured = probe.seconds_per_forward * per_step
    f = plan.format
    planned = f.decode_s_per_step if f is not None else None
    return DecodeResult(decoded_bytes_per_step=round(probe.decoded_bytes_per_forward * per_step),
                        measured_s_per_step=measured, measured_gbps=probe.gbps, planned_s_per_step=planned,
                        planned_gbps=dict(f.decode_gbps) if f is not None else {},
                        error=rel_error(measured, planned) if compared and planned else None)


def _host_memory(world: int) -> tuple[int, list[int], int] | None:
    """Under torchrun (collective: every rank calls it): the host's peak memory, each rank's own (its peak less the
    shared segments' pages it counts, chunkflow.hostmem) summed and each shared segment added once, with each rank's
    own and the shared bytes; None in one process. Ranks of one job on one host (the plans' SP runs)."""
    if world <= 1:
        return None
    import torch.distributed as dist

    from chunkflow.hostmem import own_peak_bytes

    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, own_peak_bytes())
    own = [o for o, _ in got]
    segments: dict[int, int] = {}
    for _, sizes in got:
        segments.update(sizes)
    shared = sum(segments.values())
    return sum(own) + shared, own, shared


def _report(plan: Plan, cfg: OffloadConfig, o, g: GenerateOptions, setup: PipelineSetup, runs: _Runs,
            host: tuple[int, list[int], int] | None = None):
    """The RunReport: the denoising steps as a synthetic run's `measured`, and the `generation` section."""
    import torch

    from chunkflow.commands.steps import environment, make_report
    from chunkflow.reports import Measured, MemorySample, RunConfig, computed_step_times, rel_error
    from chunkflow_planner.predict import predict

    device, steps, measured = setup.device, setup.w.steps, runs.measured
    # the plan's phases are compared on its kind of device, run with its SP degree (another's are not this run's)
    compared = device.type == "cuda" and plan.parallel.sp_degree == setup.world
    phases_of = combine_phases([ph for ph, _ in measured])
    dn = phases_of["denoise"].measurement
    # a class that reports no step: each step its generation's mean (the phase over its steps), not the phase
    times = [t for ph, st in measured for t in (st or [ph["denoise"].time_s / steps] * steps)]
    counted = computed_step_times(times, runs.cache)
    result = Measured(step_times_s=times, median_step_s=statistics.median(counted or times),
                      median_steps_counted=len(counted) if counted else None,
                      peak_allocated_bytes=dn.peak_allocated_bytes, peak_reserved_bytes=dn.peak_reserved_bytes,
                      pinned_host_bytes=runs.stats.get("pinned_bytes", 0),
                      achieved_residency=runs.stats.get("achieved_residency"),
                      memory_trace=[MemorySample(step=steps, allocated_bytes=dn.peak_allocated_bytes,
                                                 reserved_bytes=dn.peak_reserved_bytes,
                                                 host_rss_bytes=dn.host_rss_bytes)])
    pred = predict(setup.spec, setup.w, setup.hw, cfg, setup.world)
    run = RunConfig(offload=cfg, device=str(device), dtype=str(torch.bfloat16), weights=str(setup.folder or "random"),
                    warmup=o.warmup, steps=steps, world_size=setup.world, sp_degree=setup.world)
    report = make_report(environment(device), plan, run, setup.hw, result, pred, runs.stats)
    # the denoise phase's allocation holds the rest of the pipeline's tensors too (placed components, embeddings,
    # latents): not the transformer's step peak the plan predicts alone; each phase's peak is compared instead
    report = report.model_copy(update={"rel_error": report.rel_error.model_copy(update={"peak_memory": None})})
    same_steps = steps == plan.workload.steps
    phases = _phase_results(plan, phases_of, o.warmup, compared, same_steps)
    pp = plan.prediction.phases
    gen_times = [sum(m.time_s for m in ph.values()) for ph, _ in measured]
    gen_time = statistics.median(gen_times)
    pred_time = None
    if same_steps and plan.prediction.generation_time_s is not None:
        pred_time = plan.prediction.generation_time_s - (
            sum(getattr(pp, n).startup_s for n in ("encode", "denoise", "decode")) if pp and o.warmup else 0.0)
    pred_host = plan.prediction.host_memory_bytes
    host_peak, comparable = runs.last.host_peak_bytes, setup.comparable
    if host is not None:  # the plan's host memory is the host's under SP: compared with all ranks' together
        comparable = comparable and plan.parallel.sp_degree == setup.world
    report.generation = GenerationResult(
        prompt=g.prompt, negative_prompt=g.negative_prompt, seed=o.seed, guidance=g.guidance, steps=steps, out=g.out,
        components=setup.placements, vae_tiling=setup.tiling, phases=phases, generation_time_s=gen_time,
        predicted_generation_time_s=pred_time if compared else None,
        generation_time_error=rel_error(gen_time, pred_time) if compared else None,
        host_peak_bytes=host_peak, predicted_host_memory_bytes=pred_host if comparable else None,
        host_memory_error=(rel_error(host[0] if host is not None else host_peak, pred_host)
                           if comparable and pred_host else None),
        host_peak_per_host_bytes=host[0] if host is not None else None,
        host_peak_per_rank_bytes=host[1] if host is not None else None,
        host_shared_bytes=host[2] if host is not None else None,
        gpu_budget_bytes=plan.memory_budget_bytes, host_budget_bytes=plan.host_memory_budget_bytes,
        warmup_generations=o.warmup, measured_generations=len(measured), generation_times_s=gen_times,
        first_phase_times_s=runs.first, first_parts_s=runs.first_parts, load=setup.load,
        encode_cached=runs.encode_cached, disk_read_bytes=runs.disk_reads,
        predicted_disk_read_bytes=setup.planned_disk_reads, decode=_decode_result(plan, cfg, runs, steps, compared))
    return report


def _phase_results(plan: Plan, phases_of: dict, warmup: int, cuda: bool, same_steps: bool) -> dict:
    """phase -> PhaseResult: measured against the plan's phase (compared on the plan's kind of device only)."""
    from chunkflow.reports import rel_error

    pp = plan.prediction.phases
    phases = {}
    for name, runs in phases_of.items():
        m = runs.measurement
        p = getattr(pp, name) if pp is not None else None
        t_pred = expected_time(p, warmup) if p and cuda else None
        phases[name] = PhaseResult(
            measured_time_s=m.time_s, measured_times_s=runs.times_s, gc_s=runs.gc_s, parts_s=runs.parts_s,
            gc_longest=runs.gc_longest,
            predicted_parts_s=dict(p.parts_s) if p and cuda else {}, measured_peak_memory_bytes=m.peak_memory_bytes,
            measured_peak_allocated_bytes=m.peak_allocated_bytes, measured_host_rss_bytes=m.host_rss_bytes,
            predicted_time_s=t_pred,
            predicted_peak_memory_bytes=p.peak_memory_bytes if p and cuda else None,
            time_error=rel_error(m.time_s, t_pred) if t_pred is not None and same_steps else None,
            memory_error=rel_error(m.peak_memory_bytes, p.peak_memory_bytes) if p and cuda else None)
    return phases


@dataclass
class PhaseRuns:
    """One phase over the measured generations: `measurement` has the median time, the largest peaks and host
    memory; the lists hold one entry per generation."""

    measurement: Any  # chunkflow.generate.PhaseMeasurement
    times_s: list[float]
    gc_s: list[float]
    gc_longest: list[GcCollection | None]
    parts_s: dict[str, list[float]]  # component -> seconds in its forwards, one per generation


def combine_phases(runs: list[dict]) -> dict[str, PhaseRuns]:
    """phase -> PhaseRuns over the measured generations."""
    from chunkflow.generate import PhaseMeasurement

    def most(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    out = {}
    for name in runs[0]:
        ms = [r[name] for r in runs]
        each = [m.time_s for m in ms]
        peak = max(ms, key=lambda m: m.peak_memory_bytes or 0)  # reserved and context of the same phase
        out[name] = PhaseRuns(
            PhaseMeasurement(time_s=statistics.median(each), peak_allocated_bytes=most(m.peak_allocated_bytes for m in ms),
                             peak_reserved_bytes=peak.peak_reserved_bytes, context_bytes=peak.context_bytes,
                             host_rss_bytes=max(m.host_rss_bytes for m in ms)),
            times_s=each, gc_s=[m.gc_s for m in ms], gc_longest=[m.gc_longest for m in ms],
            parts_s={part: [m.parts_s.get(part, 0.0) for m in ms]
                     for part in sorted({k for m in ms for k in m.parts_s})})
    return out


def expected_time(p, warmup: int) -> float:
    """The plan's time for a phase (PhasePrediction) of the measured generation: the first of the process pays the
    start-up, one after `warmup` others does not."""
    return p.time_s - (p.startup_s if warmup else 0.0)


def _write_output(out: str, frames, spec, random_weights: bool, log) -> "OutputPixels":
    """Write the video or image(s); what their 8-bit pixels hold (OutputPixels), for saying what was written."""
    import numpy as np

    from chunkflow.media import image_names, to_uint8_frames, write_media
    from chunkflow.reports import OutputPixels

    arr = frames.float().cpu().numpy() if hasattr(frames, "cpu") else np.asarray(frames, dtype=np.float32)
    if random_weights and not np.isfinite(arr).all():
        log("note: the random weights produced non-finite pixels; they are written as 0")
        arr = np.nan_to_num(arr, nan=0.0, posinf=1.0, neginf=0.0)
    px = to_uint8_frames(arr)
    lo, hi = (int(v) for v in np.percentile(px, [1, 99]))
    pixels = OutputPixels(low=lo, high=hi, grey=bool(np.abs(px.astype(np.int16) - px.mean(axis=-1, keepdims=True)
                                                             .astype(np.int16)).max() <= 2))
    if spec.is_video:
        write_media(out, arr, fps=spec.pipeline.fps or 16)
        return pixels
    if arr.ndim == 4 and arr.shape[0] > 1:
        names = image_names(out, arr.shape[0])
        for name, img in zip(names, arr):
            write_media(name, img)
        log(f"{arr.shape[0]} images written as {names[0]} ... {names[-1]}")
        return pixels
    write_media(out, arr)
    return pixels
