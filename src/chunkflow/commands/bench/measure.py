"""Measure a sweep: build the model once, offload it per configuration, run its workloads, predict each point.

Per point: `warmup` + `steps` denoising steps of one forward each (the loop of `chunkflow run`); the median step
time (CUDA events on the GPU), peak GPU memory allocated over the timed steps, and where the step went:
  collective      timing events around every collective (`probes.CollectiveTimer`; the awareness fences before a
                  collective are not counted)
  prefetch stall  timing events around the compute stream's waits on the copy stream (`probes.StallTimer`)
  compute         none's step minus none's collective time at the same workload (the step with nothing streamed)
  overhead        the rest: step - compute - collective - prefetch stall (hooks, slot copies, launch gaps)
The final latents are compared with none's (`torch.equal`, on every rank under torchrun): offload must not
change a bit. Under torchrun every rank runs the same sweep with Ulysses SP = world size; rank 0's timings and
memory are reported and the predictions are for SP = world size.
"""

from __future__ import annotations

import math
import statistics
import warnings
from typing import Callable

from chunkflow.commands.bench.baselines import apply_baseline
from chunkflow.commands.bench.sweep import BenchSpec
from chunkflow_planner.catalog import HardwareSpec, ModelSpec
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.overlap import analyse
from chunkflow_planner.predict import predict
from chunkflow_planner.workload import tokens

COLUMNS = [
    "model", "axis", "value", "frames", "batch", "height", "width", "tokens", "sp", "mode", "chunk_bytes",
    "residency", "achieved_residency", "measured_step_s", "predicted_step_s", "err_step", "measured_peak_bytes",
    "predicted_peak_bytes", "err_peak", "peak_reserved_bytes", "pinned_bytes", "collective_s", "prefetch_stall_s",
    "fence_stall_s", "compute_s", "overhead_s", "n_collectives", "pred_compute_s", "pred_collective_s",
    "pred_stall_s", "pred_overhead_s", "bit_identical", "f_block", "f_star", "i_block", "i_star", "regime",
    "critical", "hardware", "device", "host_rss_bytes", "weight_dtype", "fp8_cast",
]
OPTIONAL_COLUMNS = ("host_rss_bytes", "weight_dtype", "fp8_cast")  # absent from bench.csv files written before they were kept


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def measure_point(model, handle, spec: ModelSpec, w, device, warmup: int, steps: int):
    """(Timing, collective s, ready+fence stall s, fence stall s, collectives per step) of one workload. Without a
    handle (a baseline offloader) nothing but the step is timed: the probes are NaN."""
    import torch

    from chunkflow.models.inputs import make_inputs
    from chunkflow.probes import CollectiveTimer, StallTimer
    from chunkflow.commands.steps import denoise

    colls: list[float] = []
    stalls: list[float] = []
    fences: list[float] = []
    counts: list[int] = []

    cuda = device.type == "cuda"
    timer, stall = CollectiveTimer(cuda), StallTimer(cuda)

    def on_step(i: int, dt: float) -> None:
        if i >= warmup:
            colls.append(timer.total_ms() / 1e3)
            counts.append(timer.count)
            st = stall.totals()
            stalls.append((st["ready"] + st["fence"]) / 1e3)
            fences.append(st["fence"] / 1e3)
        timer.reset()
        stall.reset()

    inputs = make_inputs(spec, w, torch.bfloat16, device, seed=0)
    if handle is None:
        timing = denoise(model, spec, w, inputs, device, warmup, steps)
        return timing, math.nan, math.nan, math.nan, 0
    with handle.observing(timer, stall):
        timing = denoise(model, spec, w, inputs, device, warmup, steps, on_step=on_step,
                         cfg_batched=handle.cfg.cfg_batched)
    return timing, _median(colls), _median(stalls), _median(fences), int(_median(counts))


def _bench_model(spec: ModelSpec, bench: BenchSpec, device, sp: int):
    """The sweep's transformer (random weights): block weights on the host, the rest on the device, compiled and
    made sequence-parallel as the bench asks; each configuration offloads from here."""
    import torch

    from chunkflow.models.build import build_transformer

    model, h0 = build_transformer(spec, weights=None, dtype=torch.bfloat16, device=device, config="none")
    h0.remove()
    if bench.compile != "off":  # compiled once, before offload: every configuration (and none) runs compiled blocks
        model.compile_repeated_blocks(fullgraph=bench.compile == "regional-fullgraph")
    if sp > 1:
        from chunkflow.parallel import enable_sequence_parallel

        enable_sequence_parallel(model, spec, sp)
    return model


def run_bench(spec: ModelSpec, bench: BenchSpec, hw: HardwareSpec, *, device, sp: int = 1,
              progress: Callable[[], None] = lambda: None, log: Callable[[str], None] = lambda s: None,
              on_row: Callable[[list[dict]], None] = lambda rows: None):
    """Measure and predict every point of the sweep; a pandas DataFrame with COLUMNS (the same on every rank).

    `on_row(rows)` is called after each point with the rows so far (breakdown not yet filled in), so a caller
    can keep a partial CSV of a sweep that might be cut short.
    """
    import pandas as pd
    import torch

    import chunkflow
    from chunkflow.runtime.storage import Fp8RoundedWeightsWarning

    cuda = device.type == "cuda"
    model = _bench_model(spec, bench, device, sp)
    rows: list[dict] = []
    ref: dict[int, torch.Tensor] = {}

    def measure(cfg: OffloadConfig | str, handle, v: int) -> None:
        if cuda:
            torch.cuda.empty_cache()
        w = bench.workload(spec, v, bench.steps)
        timing, *probes = measure_point(model, handle, spec, w, device, bench.warmup, bench.steps)
        if isinstance(cfg, OffloadConfig) and cfg.mode == "none":
            ref[v] = timing.latents.clone()
        same = bool(torch.equal(timing.latents, ref[v])) if v in ref else None
        rows.append(_row(spec, bench, hw, sp, cfg, v, w, timing, probes, same,
                         handle.stats().as_dict() if handle is not None else {}, device))
        r = rows[-1]
        pred = "not modelled" if math.isnan(r["predicted_step_s"]) else f"{r['predicted_step_s']:.4f} s predicted"
        log(f"{r['label']:>26} {bench.axis} {v}: {r['measured_step_s']:.4f} s measured, {pred}")
        del r["label"]
        on_row(rows)
        progress()

    for cfg, values in bench.points():
        handle = chunkflow.offload(model, cfg, device=device)
        try:
            for v in values:
                measure(cfg, handle, v)
        finally:
            with warnings.catch_warnings():  # timing only: the fp8-rounded weights are no news here
                warnings.simplefilter("ignore", Fp8RoundedWeightsWarning)
                handle.remove()
    for name in bench.baselines:  # last: a baseline stays applied to the model
        apply_baseline(name, model, device)
        for v in bench.values:
            measure(name, None, v)
    del model, ref
    if cuda:
        torch.cuda.empty_cache()
    _fill_breakdown(rows)
    _all_ranks_identical(rows)
    return pd.DataFrame(rows, columns=COLUMNS)


def _row(spec: ModelSpec, bench: BenchSpec, hw: HardwareSpec, sp: int, cfg: OffloadConfig | str, v: int, w, timing,
         probes: list, same: bool | None, stats: dict, device) -> dict:
    """One CSV row: the point, what was measured (timing, probes = collective s, stall s, fence s, collectives
    per step), what the planner predicts for it (nothing for a baseline: `cfg` is its name), and the overlap
    analysis of its workload."""
    from chunkflow.hostmem import rss_bytes

    coll, stall, fence, ncoll = probes
    med = statistics.median(timing.times)
    a = analyse(spec, w, hw, sp, cfg=cfg if isinstance(cfg, OffloadConfig) else None)
    peak = timing.peak_allocated
    if isinstance(cfg, OffloadConfig):
        p = predict(spec, w, hw, cfg, sp)
        setting = dict(mode=cfg.mode, chunk_bytes=cfg.chunk_bytes, residency=cfg.residency, label=cfg.label,
                       weight_dtype=cfg.weight_dtype, fp8_cast=cfg.fp8_cast)
        # times are compared on a GPU with a GPU profile only: a GPU profile's prediction measured on the CPU, or the
        # CPU profile's nominal times, would give an error that means nothing
        comparable = peak is not None and not hw.pipeline.device_is_host
        pred = dict(predicted_step_s=p.step_time_s,
                    err_step=(med - p.step_time_s) / p.step_time_s if comparable else math.nan,
                    predicted_peak_bytes=p.peak_memory_bytes,
                    err_peak=(peak - p.peak_memory_bytes) / p.peak_memory_bytes if peak is not None else None,
                    pred_compute_s=p.compute_s, pred_collective_s=p.collective_s + p.contention_stall_s,
                    pred_stall_s=p.prefetch_stall_s, pred_overhead_s=p.overhead_s)
    else:
        setting = dict(mode=cfg, chunk_bytes=None, residency=0.0, label=cfg, weight_dtype="bf16", fp8_cast="compute")
        pred = dict.fromkeys(("predicted_step_s", "err_step", "predicted_peak_bytes", "err_peak", "pred_compute_s",
                              "pred_collective_s", "pred_stall_s", "pred_overhead_s"), math.nan)
    return dict(
        model=spec.name, axis=bench.axis, value=v, frames=w.frames, batch=w.batch, height=w.height, width=w.width,
        tokens=tokens(spec, w), sp=sp, **setting, achieved_residency=stats.get("achieved_residency", math.nan),
        measured_step_s=med, measured_peak_bytes=peak, peak_reserved_bytes=timing.peak_reserved,
        pinned_bytes=stats.get("pinned_bytes", math.nan), collective_s=coll, prefetch_stall_s=stall,
        fence_stall_s=fence, compute_s=None, overhead_s=None, n_collectives=ncoll, bit_identical=same, **pred,
        f_block=a.F_block, f_star=a.F_star, i_block=a.I_block, i_star=a.I_star, regime=a.regime,
        critical=a.critical.value, hardware=hw.name, device=str(device), host_rss_bytes=rss_bytes(),
    )


def _fill_breakdown(rows: list[dict]) -> None:
    """compute = none's step - none's collective time at the same workload; overhead = what is left."""
    compute = {r["value"]: r["measured_step_s"] - r["collective_s"] for r in rows if r["mode"] == "none"}
    for r in rows:
        c = compute.get(r["value"])
        if c is None:
            r["compute_s"] = r["overhead_s"] = math.nan
            continue
        r["compute_s"] = c
        r["overhead_s"] = 0.0 if r["mode"] == "none" else (
            r["measured_step_s"] - c - r["collective_s"] - r["prefetch_stall_s"])  # NaN for a baseline


def _all_ranks_identical(rows: list[dict]) -> None:
    """Under torchrun: bit_identical is true only where every rank's output matched none's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    flags = [r["bit_identical"] for r in rows]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flags)
    for i, r in enumerate(rows):
        vals = [g[i] for g in gathered]
        r["bit_identical"] = None if any(x is None for x in vals) else all(vals)
