"""`chunkflow calibrate`: measure this machine's factors and write a hardware profile the planner reads.

What is measured, and how each number enters the planner:
- **GEMM rate**: a bf16 n^3 matmul, median of CUDA-event timings after warm-up (`gemm_tflops`, for reference).
  P_peak stays the datasheet figure of the matching catalog GPU (else the measured GEMM rate); eta is relative
  to it, so the choice cancels in T_comp = F / (eta P_peak).
- **eta_comp(F)**: one block of each block list of `--model` (the real diffusers class, built with a single
  layer per list, random bf16 weights) timed with CUDA events around the block (forward hooks) at several token
  counts; eta = F_block(S) / (P_peak t) with the planner's F (flops.py). Stored as `eta_comp_curve`
  ([F, eta] pairs; the planner interpolates in log F and clamps at the ends); the scalar `eta_comp` is the
  curve's median, the fallback and summary. Each model's own curve (`eta_comp_curves`) is then scaled to one or
  two forwards of the whole model (every block, no offload) where it fits on the GPU: on an H200 the whole
  Wan2.2-TI2V-5B forward ran 5.3% slower at 704x1280 than its blocks timed alone, FLUX.1-dev's 2.9%, Qwen-Image's
  0.9%. A scale outside FORWARD_SCALE_RANGE (a launch-bound toy model on the CPU) is recorded, not applied.
- **H2D**: pinned-source copies of C = 1..256 MB, back to back, the same total bytes per size; per-copy time
  t(C) is fitted as t0 + C / BW in relative error over every repeat, with a robust loss (scipy's soft_l1: a
  stray slow copy does not move t0). BW (asymptotic) -> `h2d_link_gbps`,
  t0 -> `dma_startup_us`, and **eta_pref = 1**: steptime.py charges every copy t0 plus its bytes at eta_pref
  BW, so with the fitted pair the model reproduces the measured t(C) for every chunk size, including a whole
  block (layerwise); folding the size effect into eta_pref as well would count it twice.
- **Collectives** (only under torchrun, WORLD_SIZE > 1, NCCL): the all-to-all bandwidth of a Ulysses-sized
  exchange (`coll_gbps` = local bytes / time, as steptime.t_all_to_all uses it) and its slowdown while a 512 MB
  H2D copy is in flight on another stream (`contention`). With one process these keep the base entry's values.

`refit` adjusts a profile from `chunkflow run` reports: eta_comp (curve and scalar) by the ratio of predicted
to measured compute in `none` runs, `block_overhead_us` from offload-vs-none gaps where the prefetch is
predicted hidden, and `startup_s` from generations run with --warmup (the first less a later one). The fitting functions are pure (no torch) and tested on synthetic measurements.
"""

from __future__ import annotations

import datetime
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from chunkflow.commands.calibrate.fit import (
    FORWARD_SCALE_RANGE, H2DFit, coll_bandwidth_gbps, contention_factor, eta_curve, fit_h2d, fit_vae_rows,
    scale_to_forwards,
)
from chunkflow.commands.calibrate.points import default_points, one_block_spec  # noqa: F401 (re-exported)
from chunkflow.commands.calibrate.host import CalibrationError
from chunkflow.commands.calibrate.profile import base_hardware, make_profile
from chunkflow.launch import torchrun_world
from chunkflow.timing import time_on, timing_event
from chunkflow_planner.catalog import PEAK_TFLOPS_RANGE, HardwareSpec, ModelSpec, Workload
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.flops import F_kind
from chunkflow_planner.workload import tokens


MB = 10**6


MB = 10**6
H2D_SIZES = tuple(c * MB for c in (1, 2, 4, 8, 16, 32, 64, 128, 256))


H2D_SIZES = tuple(c * MB for c in (1, 2, 4, 8, 16, 32, 64, 128, 256))
H2D_TOTAL = 512 * MB


@dataclass
class Calibration:
    profile: HardwareSpec
    raw: dict[str, Any] = field(default_factory=dict)


Progress = Callable[[str, int], Callable[[], None]]  # (description, total) -> advance()


def _no_progress(desc: str, total: int) -> Callable[[], None]:
    return lambda: None


def measure_gemm(device, n: int, warmup: int = 3, repeats: int = 20, progress: Progress = _no_progress) -> float:
    """Median bf16 n^3 GEMM rate in TFLOP/s."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    step = progress(f"bf16 GEMM {n}^3", warmup + repeats)
    times = []
    for i in range(warmup + repeats):
        _, t = time_on(device.type == "cuda", lambda: torch.matmul(a, b))
        if i >= warmup:
            times.append(t)
        step()
    return 2 * n**3 / statistics.median(times) / 1e12




def measure_blocks(spec: ModelSpec, device, points: Iterable[Workload], warmup: int = 2, repeats: int = 5,
                   progress: Progress = _no_progress) -> list[dict[str, float]]:
    """Per workload: the summed FLOPs and median times of one block of each block list (forward hooks), and every
    timed repeat (`samples_s`)."""
    import torch

    from chunkflow.models.build import build_transformer

    points = list(points)
    one = one_block_spec(spec)
    model, handle = build_transformer(one, weights=None, dtype=torch.bfloat16, device=device, config="none")
    blocks = [getattr(model, g.diffusers_list)[0] for g in one.blocks]
    cuda = device.type == "cuda"
    marks: dict[int, list] = {}

    def pre(mod, args, kwargs=None):
        marks[id(mod)] = [timing_event(cuda)]
        marks[id(mod)][0].record()

    def post(mod, args, out):
        marks[id(mod)].append(timing_event(cuda))
        marks[id(mod)][1].record()

    def blocks_time(inputs) -> float:
        model(**inputs)
        marks[id(blocks[-1])][1].synchronize()
        return sum(marks[id(b)][0].elapsed_time(marks[id(b)][1]) / 1e3 for b in blocks)

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    rows = []
    step = progress(f"{spec.name} block at {len(points)} sizes", len(points) * (warmup + repeats))
    try:
        samples = _timed_samples(one, device, points, warmup, repeats, step, blocks_time)
        for w, ts in zip(points, samples):
            S = tokens(spec, w)
            F = sum(F_kind(g.kind, w.batch, S, spec.text_len, spec.d, spec.f) for g in spec.blocks)
            rows.append(dict(frames=w.frames, batch=w.batch, tokens=S, flops=F, time_s=statistics.median(ts),
                             samples_s=ts))
    finally:
        for h in hooks:
            h.remove()
        handle.remove()
        del model
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _timed_samples(spec: ModelSpec, device, points: Sequence[Workload], warmup: int, repeats: int,
                   step: Callable[[], None], timed: Callable[[dict], float]) -> list[list[float]]:
    """Per workload: `repeats` timings `timed(inputs)` after `warmup` untimed ones, on inputs of `spec`
    (models.inputs.make_inputs); calibrate keeps their median and their spread about it."""
    import torch

    from chunkflow.models.inputs import make_inputs

    out = []
    with torch.no_grad():
        for w in points:
            inputs = make_inputs(spec, w, torch.bfloat16, device, seed=0)
            samples = []
            for i in range(warmup + repeats):
                t = timed(inputs)
                if i >= warmup:
                    samples.append(t)
                step()
            out.append(samples)
            del inputs
    return out


def measure_forward(spec: ModelSpec, device, points: Sequence[Workload], warmup: int = 1, repeats: int = 3,
                    progress: Progress = _no_progress) -> list[dict[str, float]]:
    """Per workload: median seconds of one forward of the whole transformer (every block, random bf16 weights, no
    offload), one guidance pass, and every timed repeat (`samples_s`)."""
    import torch

    from chunkflow.models.build import build_transformer

    model, handle = build_transformer(spec, weights=None, dtype=torch.bfloat16, device=device, config="none")
    cuda = device.type == "cuda"
    step = progress(f"{spec.name} whole forward at {len(points)} size(s)", len(points) * (warmup + repeats))
    try:
        samples = _timed_samples(spec, device, points, warmup, repeats, step,
                                 lambda inputs: time_on(cuda, lambda: model(**inputs))[1])
        rows = [dict(model=spec.name, frames=w.frames, batch=w.batch, tokens=tokens(spec, w),
                     time_s=statistics.median(ts), samples_s=ts) for w, ts in zip(points, samples)]
    finally:
        handle.remove()
        del model
        if cuda:
            torch.cuda.empty_cache()
    return rows


def forward_points(spec: ModelSpec, hw: HardwareSpec, free_bytes: float | None, cpu: bool = False) -> list[Workload]:
    """The calibration sizes a whole forward is timed at: the middle one and the largest whose forward without
    offload fits in `free_bytes` (None: no limit), one guidance pass; none if the middle one does not fit."""
    from chunkflow_planner.memory import device_need, estimate_memory
    from chunkflow_planner.offload import OffloadConfig

    pts = [w.model_copy(update={"cfg_passes": 1, "steps": 1}) for w in default_points(spec, cpu)]
    none = OffloadConfig(mode="none")

    def fits(w: Workload) -> bool:
        m = estimate_memory(spec, w, none)
        return free_bytes is None or device_need(m.peak, m.activations, hw) * 1.2 < free_bytes

    mid = pts[len(pts) // 2]
    if not fits(mid):
        return []
    top = max((w for w in pts if fits(w)), key=lambda w: tokens(spec, w) * w.batch)
    return [mid] if top == mid else [mid, top]


def _whole_forwards(specs: list[ModelSpec], s: _Setup, hw: HardwareSpec, cpu_smoke: bool, progress: Progress,
                    log: Callable[[str], None]) -> tuple[dict[str, list[tuple[float, float]]], list[dict[str, Any]]]:
    """Each model's curve scaled to whole forwards where one fits on the GPU (module docstring), and the rows."""
    import torch

    curves = dict(hw.eta_comp_curves)
    rows: list[dict[str, Any]] = []
    for spec in specs:
        if spec.name not in curves:
            continue
        free = torch.cuda.mem_get_info(s.device)[0] if s.device.type == "cuda" else None
        points = forward_points(spec, hw, free, cpu_smoke)
        if not points:
            log(f"{spec.name}: a whole forward does not fit on this GPU; its curve is from one block alone")
            continue
        measured = None
        try:
            measured = measure_forward(spec, s.device, points, progress=progress)
        except torch.cuda.OutOfMemoryError:
            pass
        if measured is None:  # out of the except block: the failed forward's frames are gone, its memory freeable
            torch.cuda.empty_cache()
            log(f"{spec.name}: a whole forward ran out of GPU memory; its curve is from one block alone")
            continue
        curve, scaled = scale_to_forwards(spec, hw, measured)
        rows += scaled
        k = scaled[0]["scale"]
        ran = (f"{spec.name}: whole forwards at {', '.join(str(r['tokens']) for r in measured)} tokens ran "
               f"{1 / k:.3f}x the time its blocks timed alone predict")
        if curve is None:  # launch-bound toys (the CPU smoke) or a broken measurement: not a GPU's sustained rate
            log(ran + f"; outside {FORWARD_SCALE_RANGE[0]}-{FORWARD_SCALE_RANGE[1]}, its curve is left as measured")
            continue
        curves[spec.name] = curve
        log(ran + f"; its curve x{k:.3f}")
    return curves, rows


def measure_h2d(device, sizes: Sequence[int] = H2D_SIZES, total: int = H2D_TOTAL, repeats: int = 3,
                progress: Progress = _no_progress) -> list[dict[str, float]]:
    """Per chunk size: median per-copy time of back-to-back non_blocking copies from a pinned source, and each
    repeat's (`samples_s`: the H2D fit's samples)."""
    import torch

    cuda = device.type == "cuda"
    total = max(total, max(sizes))
    src = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    rows = []
    step = progress("pinned H2D copies", len(sizes) * (repeats + 1))
    for C in sizes:
        n = max(1, total // C)

        def copies():
            for i in range(n):
                dst[i * C:(i + 1) * C].copy_(src[i * C:(i + 1) * C], non_blocking=True)

        samples = []
        for r in range(repeats + 1):  # the first is a warm-up
            _, t = time_on(cuda, copies)
            if r:
                samples.append(t / n)
            step()
        rows.append(dict(chunk_bytes=C, copies=n, time_per_copy_s=statistics.median(samples),
                         gbps=C / statistics.median(samples) / 1e9, samples_s=samples))
    del src, dst
    return rows


def measure_collectives(device, local_bytes: int = 56 * MB, h2d_bytes: int = 512 * MB, repeats: int = 10,
                        progress: Progress = _no_progress) -> dict[str, float]:
    """Under torchrun: all-to-all time alone and with an H2D copy in flight on another stream (max over ranks), and
    this rank's timings alone (`idle_s`: their spread is the collectives' fit quality)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    world = dist.get_world_size()
    x = torch.randn(local_bytes // 2, device=device, dtype=torch.bfloat16)
    x = x[: (x.numel() // world) * world]
    y = torch.empty_like(x)
    host = torch.empty(h2d_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(h2d_bytes, dtype=torch.uint8, device=device)
    copy_stream = torch.cuda.Stream(device)
    step = progress(f"all-to-all over {world} GPUs", 2 * (repeats + 2))

    def a2a():
        dist.all_to_all_single(y, x)

    idle, busy = [], []
    for i in range(repeats + 2):
        dist.barrier()
        torch.cuda.synchronize(device)
        _, t = time_on(True, a2a)
        if i >= 2:
            idle.append(t)
        step()
    for i in range(repeats + 2):
        dist.barrier()
        torch.cuda.synchronize(device)
        with torch.cuda.stream(copy_stream):
            dev.copy_(host, non_blocking=True)
        _, t = time_on(True, a2a)
        torch.cuda.synchronize(device)
        if i >= 2:
            busy.append(t)
        step()
    both = torch.tensor([statistics.median(idle), statistics.median(busy)], device=device, dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    t_idle, t_busy = both.tolist()
    del host, dev
    return dict(world=world, local_bytes=x.numel() * 2, t_idle_s=t_idle, t_busy_s=t_busy, idle_s=idle,
                coll_gbps=coll_bandwidth_gbps(x.numel() * 2, t_idle), contention=contention_factor(t_busy, t_idle))


@dataclass(frozen=True)
class _Setup:
    """Where and how large to measure: the device, its name, the GEMM size and the H2D copy sizes."""

    device: Any
    name: str
    gemm_n: int
    sizes: tuple[int, ...]
    total: int
    world: int


def _setup(cpu_smoke: bool, gemm_n: int) -> _Setup:
    import torch

    if cpu_smoke:
        return _Setup(torch.device("cpu"), "cpu", 256, tuple(c * 2**10 for c in (64, 128, 256, 512, 1024)),
                      4 * 2**20, 1)
    if not torch.cuda.is_available():
        raise CalibrationError("CUDA is not available on this machine: calibrate measures a GPU "
                               "(use --cpu-smoke to exercise the code paths on the CPU)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    return _Setup(device, torch.cuda.get_device_name(device), gemm_n, H2D_SIZES, H2D_TOTAL, torchrun_world())


def _curves(specs: list[ModelSpec], s: _Setup, peak: float, cpu_smoke: bool, progress: Progress,
            log: Callable[[str], None]) -> tuple[dict[str, list[tuple[float, float]]], list[dict[str, Any]]]:
    """Each model's own eta_comp(F) curve (attention-heavy and GEMM-heavy blocks differ), and the raw rows."""
    curves: dict[str, list[tuple[float, float]]] = {}
    blocks: list[dict[str, Any]] = []
    for spec in specs:
        rows = measure_blocks(spec, s.device, default_points(spec, cpu_smoke), progress=progress)
        blocks += [dict(r, model=spec.name) for r in rows]
        curves[spec.name] = eta_curve([r["flops"] for r in rows], [r["time_s"] for r in rows], peak * 1e12)
        log(f"eta_comp(F) of {spec.name}: " + ", ".join(f"{F:.2e} FLOP -> {e:.3f}" for F, e in curves[spec.name]))
    return curves, blocks


def _peer_link() -> str:
    """How the GPUs of this torchrun job reach each other: pcie when NCCL is told to avoid P2P, else by probing."""
    import torch

    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "pcie"
    return "nvlink" if torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1) else "pcie"


def _operator_model(specs, blocks, s, peak: float, cpu_smoke: bool, base_hw: HardwareSpec, progress, log):
    """The operator model's tables (GEMM and attention efficiency by shape, memory bandwidth), its memory-pass scale
    fitted to the blocks just timed, the device memory torch does not count, the CPU's matmul rate and this
    process's host memory: profile fields, and the raw rows."""
    from chunkflow.commands.calibrate.ops import (ATTN_HEAD_DIM, ATTN_HEADS, fit_mem_ops_scale,
                                                  measure_attention_grid, measure_cpu_tflops, measure_fp8_cast,
                                                  measure_gemm_grid, measure_hbm)
    from chunkflow.commands.calibrate.host import measure_host
    from chunkflow.runtime.fp8cast import cast_kernel_name
    small = dict(ms=(16, 64), nks=(32, 64)) if cpu_smoke else {}
    gemm = measure_gemm_grid(s.device, peak, progress=progress, **small)
    small_attn = dict(lens=(16, 64), heads=2, head_dim=16) if cpu_smoke else {}
    attn = measure_attention_grid(s.device, peak, progress=progress, **small_attn)
    attn_masked = measure_attention_grid(s.device, peak, progress=progress, masked=True, **small_attn)
    half = dict(small_attn, heads=4, head_dim=8) if cpu_smoke else dict(heads=2 * ATTN_HEADS,
                                                                         head_dim=ATTN_HEAD_DIM // 2)
    attn_half = measure_attention_grid(s.device, peak, progress=progress, **half)  # the same width, half the dim
    hbm = measure_hbm(s.device, 2**24 if cpu_smoke else 2 * 2**30)
    cast = measure_fp8_cast(s.device, 2**22 if cpu_smoke else 2**30)
    cast_kernel = cast_kernel_name(s.device)
    update: dict[str, Any] = dict(gemm_eta=gemm, attn_eta=attn, attn_eta_masked=attn_masked, hbm_gbps=hbm,
                                  attn_eta_head_dims={ATTN_HEAD_DIM // 2: attn_half}, fp8_cast_gbps=cast)
    scale = fit_mem_ops_scale(blocks, base_hw.model_copy(update=dict(update, peak_tflops=peak)))
    cpu_residuals: list[list[float]] = []  # each CPU matmul shape's repeats about their median: the `cpu` fit
    update.update(mem_ops_scale=scale, cpu_tflops=measure_cpu_tflops(256 if cpu_smoke else 1024, cpu_residuals))
    host, host_raw = measure_host(s.device, update["cpu_tflops"], cpu_smoke, cpu_residuals)
    update.update(host)
    log(f"operator model: GEMM eta {min(r[3] for r in gemm):.2f}-{max(r[3] for r in gemm):.2f} over {len(gemm)} shapes, "
        f"attention {min(r[2] for r in attn):.2f}-{max(r[2] for r in attn):.2f} (masked "
        f"{min(r[2] for r in attn_masked):.2f}-{max(r[2] for r in attn_masked):.2f}), memory {hbm:.0f} GB/s, memory passes "
        f"x{scale:.2f}; fp8 cast {cast:.0f} GB/s ({cast_kernel}); CPU {update['cpu_tflops']:.2f} TFLOP/s")
    log("host: a text-encoder layer dispatches " + ", ".join(
        f"{arch} {us:.0f} us" for arch, us in host["text_layer_host_us"].items()) + " on the GPU path; CPU "
        f"GEMM eta {min(r[3] for r in host['cpu_gemm_eta']):.2f}-{max(r[3] for r in host['cpu_gemm_eta']):.2f}, "
        f"memory {host['cpu_mem_gbps']:.0f} GB/s")
    return update, dict(gemm=gemm, attention=attn, attention_masked=attn_masked, hbm_gbps=hbm, mem_ops_scale=scale,
                        fp8_cast_gbps=cast, fp8_cast_kernel=cast_kernel, host=host_raw, cpu_residuals=cpu_residuals)


def _disk_rates(extra: dict, device, cpu_smoke: bool, weights: str | None, log) -> dict | None:
    """The load's rates into `extra` (disk_read_gbps, page_cache_gbps; pin_gbps on a GPU); the raw rows."""
    from chunkflow.commands.calibrate.disk import (SAMPLE_BYTES, SMOKE_SAMPLE_BYTES, disk_folder, measure_disk, measure_fault,
                                          measure_load_startup, measure_pin)

    folder, how, sampled = disk_folder(weights, cpu_smoke)
    try:
        d = measure_disk(folder, SMOKE_SAMPLE_BYTES if cpu_smoke else SAMPLE_BYTES, log, sample=sampled)
    except (OSError, ChunkflowError) as exc:
        log(f"disk not timed ({how}): {exc}; load times will not be predicted")
        return None
    d["chosen_by"] = how
    extra["page_cache_gbps"] = d["page_cache_gbps"]
    if d["disk_read_gbps"] is not None:
        extra["disk_read_gbps"] = d["disk_read_gbps"]
    d["host_fault_runs_gbps"], d["pin_runs_gbps"] = [], []
    extra["host_fault_gbps"] = d["host_fault_gbps"] = measure_fault(SMOKE_SAMPLE_BYTES if cpu_smoke else 2**30,
                                                                    rates=d["host_fault_runs_gbps"])
    log(f"new host memory at its first touch: {extra['host_fault_gbps']:.2f} GB/s")
    try:
        extra["load_startup_s"] = d["load_startup_s"] = measure_load_startup()
        log(f"a process's first pipeline build outside its reads: {extra['load_startup_s']:.2f} s")
    except (OSError, ValueError) as exc:
        log(f"load start-up not measured: {exc}")
    if device.type == "cuda":
        extra["pin_gbps"] = d["pin_gbps"] = measure_pin(rates=d["pin_runs_gbps"])
        log(f"page-locking host memory: {extra['pin_gbps']:.1f} GB/s")
    if sampled:  # the load path on the folder's own files (issue 55); load_fit compares it with the model
        from chunkflow.commands.calibrate.loadpath import LOAD_SAMPLE_BYTES, SMOKE_LOAD_BYTES, measure_load_path

        d["load_path"] = measure_load_path(folder, SMOKE_LOAD_BYTES if cpu_smoke else LOAD_SAMPLE_BYTES,
                                           device.type == "cuda", log=log)
    return d


def _load_fit(disk: dict | None, hw: HardwareSpec, on: str, log: Callable[[str], None]):
    """The `load` FitQuality from the load path `_disk_rates` timed, against `hw` (loadpath.load_fit); None where
    none was timed."""
    from chunkflow.commands.calibrate.loadpath import load_fit

    raw = (disk or {}).get("load_path")
    return load_fit(raw, hw, on, log) if raw else None


def _process_rss() -> int:
    """Host memory of a process that has started CUDA and loaded torch, diffusers and transformers but holds no
    weights and ran no pipeline's kernels: what the load holds besides its copies (`process_start_host_bytes`), and
    `process_host_bytes` where no start-up probe ran (the probes' figure, after their text encoder, block and VAE
    calls, replaces that: _with_fits)."""
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    from chunkflow.hostmem import rss_bytes

    return rss_bytes()


def vae_owners() -> dict[str, ModelSpec]:
    """Each catalog VAE by name, with the first catalog model whose pipeline uses it (its latent shape, tiling)."""
    from chunkflow_planner.catalog import load_models

    owners: dict[str, ModelSpec] = {}
    for spec in load_models().values():
        if spec.pipeline is not None:
            owners.setdefault(spec.pipeline.vae.name, spec)
    return owners


def _vae_owners(cpu_smoke: bool, folders: Sequence[str], log) -> dict[str, ModelSpec]:
    """The VAEs calibrate times, each with a model using it: every catalog VAE (the tiny one alone for --cpu-smoke),
    and the VAE of each pipeline folder (--weights, --vae-weights) that is not one of them (folder_vae.py)."""
    from chunkflow.commands.calibrate.folder_vae import folder_vae_owner

    owners = vae_owners()
    if cpu_smoke:
        owners = {n: sp for n, sp in owners.items() if n == "tiny-wan-vae"}
    else:  # the tiny pipelines' VAEs are for CPU tests (tiled, their small tiles take longer than the real ones)
        owners = {n: sp for n, sp in owners.items() if not n.startswith("tiny")}
    for weights in folders:
        folder = folder_vae_owner(weights, set(owners), log)
        if folder is not None:
            owners[folder.pipeline.vae.name] = folder
    return owners


def _vae_fits(s, cpu_smoke: bool, progress, log, folders: Sequence[str] = ()):
    """Every VAE _vae_owners names decoded at a few sizes, tiled and not (tiled alone for a class that decodes only
    tiled), and fitted: the fits, the raw rows, and the fits' residuals pooled over the VAEs ({vae_time,
    vae_memory}, and under `fitted` the coefficients fitted to each: fit.fit_vae_rows). A folder's VAE that fails to
    decode (out of memory at calibrate's sizes, a class that cannot run here) is logged as not timed; the rest go on."""
    owners = _vae_owners(cpu_smoke, folders, log)
    date = datetime.date.today().isoformat()
    fits, raw = {}, []
    residuals: dict[str, Any] = {"vae_time": [], "vae_memory": [], "fitted": {"vae_time": 0, "vae_memory": 0}}
    step = progress("VAE decodes", len(owners))
    for name, spec in owners.items():
        try:
            rows, trows = _vae_decodes(spec, s.device, cpu_smoke)
        except Exception as exc:  # noqa: BLE001 - a folder's VAE is the user's code; a catalog VAE's failure is ours
            if spec.derived is None:
                raise
            log(f"VAE {name} from {spec.derived.source}: not timed, its decode failed ({type(exc).__name__}: "
                f"{str(exc)[:200]}); plans of that folder keep the price `chunkflow plan` lists as not timed")
            _free_device_memory(s.device)
            step()
            continue
        where = f" from {spec.derived.source}" if spec.derived is not None else ""
        fit, res = fit_vae_rows(spec, rows, trows, f"chunkflow calibrate {date} on {s.name}: "
                                f"{len(rows) or len(trows)} decodes{where}")
        for k in ("vae_time", "vae_memory"):
            residuals[k] += res[k]
            residuals["fitted"][k] += res["fitted"][k]
        fits[name] = fit
        raw += rows + trows
        _log_vae_fit(name, fit, log)
        step()
    return fits, raw, residuals


def _vae_decodes(spec: ModelSpec, device, cpu_smoke: bool) -> tuple[list[dict], list[dict]]:
    """The VAE of `spec` decoded at calibrate's sizes: (untiled rows, tiled rows); a class that decodes only tiled has
    no untiled rows, one without enable_tiling no tiled ones."""
    from chunkflow.commands.calibrate.ops import measure_vae, vae_points

    plain, tiled = vae_points(spec, cpu_smoke)
    tiled = tiled if _tiles(spec) else []
    rows = [] if spec.pipeline.vae.tiled_only else measure_vae(spec, device, plain, tiled=False)
    trows = measure_vae(spec, device, tiled, tiled=True) if tiled else []
    return rows, trows


def _free_device_memory(device) -> None:
    """What a failed decode left in the CUDA allocator's cache given back (nothing to do on the CPU)."""
    import gc

    import torch

    gc.collect()
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.empty_cache()


def _folders(weights: str | None, vae_weights: Sequence[str]) -> list[str]:
    """The pipeline folders whose VAEs calibrate times: --weights, then each --vae-weights, each once."""
    return list(dict.fromkeys(([weights] if weights is not None else []) + list(vae_weights)))


def _tiles(spec: ModelSpec) -> bool:
    """Whether the VAE's diffusers class can decode tiled (enable_tiling)."""
    import diffusers

    return callable(getattr(getattr(diffusers, spec.pipeline.vae.cls, None), "enable_tiling", None))


def _log_vae_fit(name: str, fit: dict, log) -> None:
    tiled_rate = ""
    if fit.get("tiled"):
        t = fit["tiled"]
        tiled_rate = (f"; tiled {t['time_per_call'] * 1e3:.1f} ms/decoder call" if t.get("time_per_call")
                      else f"; tiled {t['time_per_voxel'] * 1e9:.2f} ns/voxel")
    log(f"VAE {name}: decode peak {fit['mem_const'] / 1e9:.2f} GB + {fit['mem_per_px']:.0f} B/px + "
        f"{fit['mem_per_voxel']:.1f} B/voxel, {fit['time_per_voxel'] * 1e9:.2f} ns/voxel{tiled_rate}")


def _peak(gemm: float, given: float | None, catalog: HardwareSpec | None, cpu_smoke: bool) -> float:
    """P_peak the efficiencies are expressed against: the one given, else the catalog GPU's datasheet peak, else
    the measured GEMM rate; a rate too low for a profile to describe is refused (the smoke run's is raised)."""
    peak = given or (catalog.peak_tflops if catalog is not None else gemm)
    if peak >= PEAK_TFLOPS_RANGE[0]:
        return peak
    if not cpu_smoke:  # a machine too busy to measure (the smoke run's numbers mean nothing anyway)
        raise CalibrationError(
            f"the bf16 GEMM ran at {gemm * 1e3:.2f} GFLOP/s, below the {PEAK_TFLOPS_RANGE[0] * 1e3:g} GFLOP/s a "
            "profile can describe: the device was too busy to time; run calibrate again when it is idle, or give "
            "--peak-tflops")
    return PEAK_TFLOPS_RANGE[0]


def _source_note(date: str, s, gemm: float, peak: float, base_hw: HardwareSpec, matched: bool, curves: dict,
                 h2d_rows: list[dict], coll: dict | None) -> str:
    """The profile's `source`: how each of its figures was measured."""
    sizes = len(next(iter(curves.values())))
    return (f"chunkflow calibrate {date} on {s.name}: GEMM {s.gemm_n}^3 {gemm:.0f} TFLOP/s; P_peak {peak:g} "
            f"({'datasheet of ' + base_hw.name if peak == base_hw.peak_tflops and matched else 'measured GEMM'}); "
            f"eta_comp curves from one block of {', '.join(curves)} at {sizes}+ sizes each, scaled to whole "
            f"forwards where they fit; H2D t(C) = t0 + C/BW fitted over {len(h2d_rows)} chunk sizes "
            f"({s.sizes[0] / 1e6:g}-{s.sizes[-1] / 1e6:g} MB), eta_pref 1 (DMA term carries the size effect)"
            + (f"; all-to-all and contention over {s.world} GPUs" if coll else
               f"; coll_gbps/contention from {base_hw.name}"))


def _collectives(s, progress: Progress, log: Callable[[str], None]) -> dict:
    """The all-to-all's rate over the torchrun world, alone and with H2D copies in flight."""
    coll = measure_collectives(s.device, progress=progress)
    log(f"all-to-all {coll['local_bytes'] / 1e6:.0f} MB: {coll['t_idle_s'] * 1e3:.3f} ms "
        f"({coll['coll_gbps']:.0f} GB/s), with H2D in flight x{coll['contention']:.2f}")
    return coll


def fit_records(h2d, blocks: Sequence[dict], forwards: Sequence[dict], vae: dict[str, Any], ops: dict,
                disk: dict | None, codec: dict | None, coll: dict | None, device: str, date: str
                ) -> dict[str, Any]:
    """The profile's `fits` (FitQuality by bands.FITS name, fit.fit_quality) from what calibrate measured: each a
    fit's residuals (measured / fitted - 1) or a repeated measurement's repeats about their median, with the
    parameters fitted to them (fit_quality's `fitted`: 1 a median, the coefficients of a fit); a figure measured
    once (the cold disk read, the load's start-up) has none, and the planner keeps its prior.
    - h2d: every repeat's per-copy time about the fitted t0 + C / BW;
    - compute: every timed repeat of a block (and of a whole forward) about the median the eta curve is made of,
      pooled over sizes and models (timing jitter), and each whole forward's misfit with the curve as scaled to
      them (fit.scale_to_forwards: the curve's own error, fit_quality's `misfits`; a scale applied is fitted to
      them, 1 a model);
    - vae_time, vae_memory: the decode fits' residuals, pooled over VAEs (ops.vae_residuals);
    - cpu: the CPU matmuls' repeats; text_host: each text-encoder forward timed; page_cache, host_fault, pin: their
      REPEATS; codec_decode: its decodes; collectives (torchrun): this rank's all-to-alls alone."""
    from chunkflow.commands.calibrate.fit import fit_quality

    on = f"chunkflow calibrate {date} on {device}"
    text = (ops.get("host") or {}).get("text_layer_samples_us") or {}
    vae_fitted = vae.get("fitted") or {}
    parts: dict[str, tuple[dict[str, Any], str]] = {
        "h2d": (dict(residuals=list(h2d.residuals), fitted=h2d.fitted),
                f"{on}: {len(h2d.residuals)} timed copies about t0 + C/BW"),
        "compute": _compute_residuals(blocks, forwards, on),
        "vae_time": (dict(residuals=vae.get("vae_time", []), fitted=vae_fitted.get("vae_time", 0)),
                     f"{on}: VAE decode times about their fits"),
        "vae_memory": (dict(residuals=vae.get("vae_memory", []), fitted=vae_fitted.get("vae_memory", 0)),
                       f"{on}: VAE decode peaks about their fits"),
        "cpu": (pooled(ops.get("cpu_residuals", [])), f"{on}: CPU matmul repeats about their shape's median"),
        "text_host": (medians(text.values()), f"{on}: text-encoder forwards about their architecture's median"),
    }
    if disk:
        parts["page_cache"] = (medians([disk.get("warm_runs_s", [])]), f"{on}: warm reads about their median")
        parts["host_fault"] = (medians([disk.get("host_fault_runs_gbps", [])]), f"{on}: first touches")
        parts["pin"] = (medians([disk.get("pin_runs_gbps", [])]), f"{on}: page-locking repeats")
    if codec and codec.get("decode"):
        parts["codec_decode"] = (medians([codec["decode"].get("times_s", [])]), f"{on}: codec decodes")
    if coll:
        parts["collectives"] = (medians([coll.get("idle_s", [])]), f"{on}: all-to-alls over {coll['world']} GPUs")
    out = {}
    for name, (args, source) in parts.items():
        q = fit_quality(name, source=source, **args)
        if q is not None:
            out[name] = q
    return out


def _compute_residuals(blocks: Sequence[dict], forwards: Sequence[dict], on: str) -> tuple[dict[str, Any], str]:
    """fit_quality's arguments for the `compute` record and its source: the timings about their medians and, where
    whole forwards ran, each one's misfit against the curve as scaled to them (fit_records)."""
    args = medians(row.get("samples_s", []) for row in [*blocks, *forwards])
    source = f"{on}: block and whole-forward timings about each size's median"
    rows = [r for r in forwards if r.get("misfit") is not None]
    if not rows:
        return args, source
    misfits = [r["misfit"] for r in rows]
    source += (f"; {len(rows)} whole forward(s) against the curve as scaled to them "
               f"({', '.join(f'{m:+.1%}' for m in misfits)})")
    return dict(args, misfits=misfits, misfits_fitted=len({r["model"] for r in rows if r.get("applied")})), source


def pooled(groups: Iterable[Sequence[float]]) -> dict[str, Any]:
    """Groups of residuals, each about its own median, pooled: fit_quality's `residuals` (every one) and `fitted`
    (the medians: 1 a group that has any)."""
    groups = [list(g) for g in groups]
    return dict(residuals=[r for g in groups for r in g], fitted=sum(1 for g in groups if g))


def medians(groups: Iterable[Sequence[float]]) -> dict[str, Any]:
    """Groups of repeats of one measurement each, as residuals about their medians (fit.about_median), pooled."""
    from chunkflow.commands.calibrate.robust import about_median

    return pooled(about_median(g) for g in groups)


def calibrate(model: str | Sequence[str] = "wan2.2", *, cpu_smoke: bool = False, gemm_n: int = 8192, peak_tflops: float | None = None,
              base: str | None = None, peer_link: str | None = None, progress: Progress = _no_progress,
              log: Callable[[str], None] = lambda s: None, vaes: bool = True, weights: str | None = None,
              disk: bool = True, startup_processes: int = 3, vae_weights: Sequence[str] = ()) -> Calibration:
    """Measure and assemble a profile. Raises CalibrationError without CUDA (unless cpu_smoke). `weights`: the
    pipeline folder whose disk the load rates are measured on (calibrate_disk.disk_folder); `vae_weights`: more
    pipeline folders whose VAEs are timed (with `weights`'s) where the catalog lacks them; `disk`: measure them;
    `startup_processes`: cold processes the first model's start-up is measured over (startup.py; 0: none)."""
    import torch

    from chunkflow_planner.catalog import get_model

    names = [m.strip() for m in (model.split(",") if isinstance(model, str) else model) if m.strip()]
    specs = [get_model(n) for n in (["tiny-wan"] if cpu_smoke else names)]
    s = _setup(cpu_smoke, gemm_n)
    cold = _cold_startup(specs[0].name, startup_processes, s.device, log)  # before this process runs a kernel
    base_hw, base_note = base_hardware(s.name, s.world, base)
    log(f"device {s.name}; {base_note}")
    gemm = measure_gemm(s.device, s.gemm_n, progress=progress)
    log(f"bf16 GEMM {s.gemm_n}^3: {gemm:.1f} TFLOP/s")
    process_rss = _process_rss()
    matched = base is not None or "no catalog match" not in base_note
    peak = _peak(gemm, peak_tflops, base_hw if matched and not cpu_smoke else None, cpu_smoke)
    curves, blocks = _curves(specs, s, peak, cpu_smoke, progress, log)
    curve = curves[specs[0].name]
    h2d_rows, fit = _h2d_fit(s, progress, log)
    extra, ops_raw = _operator_model(specs, blocks, s, peak, cpu_smoke, base_hw, progress, log)
    extra["process_host_bytes"] = extra["process_start_host_bytes"] = process_rss
    folders = _folders(weights, vae_weights)
    vae_fits, vae_raw, vae_res = _vae_fits(s, cpu_smoke, progress, log, folders) if vaes else ({}, [], {})
    disk_raw, codec_raw, formats_raw = _device_figures(extra, s, cpu_smoke, weights, disk, log)
    coll = _collectives(s, progress, log) if s.world > 1 else None
    if coll is not None:
        peer_link = peer_link or _peer_link()
    date = datetime.date.today().isoformat()
    src = _source_note(date, s, gemm, peak, base_hw, matched, curves, h2d_rows, coll)
    profile = _measured_profile(base_hw, s, cpu_smoke, peer_link, src, peak=peak, gemm=gemm,
                                curve=curve, h2d=fit, coll=coll)
    profile = HardwareSpec(**{**profile.model_dump(), "eta_comp_curves": curves, **extra, "vae_decode": vae_fits})
    scaled, forwards = _whole_forwards(specs, s, profile, cpu_smoke, progress, log)
    fits = fit_records(fit, blocks, forwards, vae_res, ops_raw, disk_raw, codec_raw, coll, s.name, date)
    profile, startup_raw = _with_fits(profile, scaled, fits, disk_raw, specs[0].name, startup_processes, s, date, log,
                                      cold)
    raw = dict(date=date, device=s.name, torch=torch.__version__, world=s.world, gemm_n=s.gemm_n, gemm_tflops=gemm,
               peak_tflops=peak, blocks=blocks, eta_comp_curve=curve, eta_comp_curves=curves,
               h2d=h2d_rows, h2d_fit=dict(t0_us=fit.t0_s * 1e6, gbps=fit.bw_Bps / 1e9), collectives=coll,
               base=base_note, operators=ops_raw, vae=vae_raw, vae_residuals=vae_res, forwards=forwards, disk=disk_raw,
               codec=codec_raw, formats=formats_raw, startup=startup_raw, process_start_rss_bytes=process_rss)
    return Calibration(profile, raw)


def _h2d_fit(s: _Setup, progress: Progress, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], H2DFit]:
    """The host-to-device copies timed at each size (the raw rows) and t(C) = t0 + C / BW fitted to them."""
    h2d_rows = measure_h2d(s.device, s.sizes, s.total, progress=progress)
    fit = fit_h2d([r["chunk_bytes"] for r in h2d_rows for _ in r["samples_s"]],
                  [t for r in h2d_rows for t in r["samples_s"]])  # every repeat a sample (the robust loss: no median)
    log(f"H2D fit: t0 {fit.t0_s * 1e6:.2f} us, asymptotic {fit.bw_Bps / 1e9:.2f} GB/s")
    return h2d_rows, fit


def _device_figures(extra: dict, s: _Setup, cpu_smoke: bool, weights: str | None, disk: bool,
                    log: Callable[[str], None]) -> tuple[dict | None, dict | None, dict | None]:
    """The device memory torch does not count, and on rank 0 the disk's load rates, the codec and the stored
    formats, into `extra`; their raw rows (disk, codec, formats)."""
    from chunkflow.commands.calibrate.ops import measure_context_bytes

    extra["context_bytes"] = measure_context_bytes(s.device)  # last: cuBLAS, cuDNN and their kernels are loaded
    from chunkflow.launch import torchrun_rank

    # the disk is the machine's: rank 0 times it (ranks timing it together would share it and undo each other's
    # cold reads)
    disk_raw = _disk_rates(extra, s.device, cpu_smoke, weights, log) if disk and torchrun_rank() == 0 else None
    codec_raw = None
    if torchrun_rank() == 0:  # the codec's ratio on the user's weights and its decode rate on this GPU (issue 39)
        from chunkflow.commands.calibrate.codec import measure_codec

        codec_extra, codec_raw = measure_codec(weights, s.device, log)
        extra.update(codec_extra)
    formats_raw = None
    if torchrun_rank() == 0:  # the stored formats' dequantization on this device (issue 52)
        from chunkflow.commands.calibrate.formats import measure_formats

        formats_extra, formats_raw = measure_formats(s.device, log)
        extra.update(formats_extra)
    log(f"device memory torch does not count (CUDA context, libraries): {extra['context_bytes'] / 2**20:.0f} MiB")
    return disk_raw, codec_raw, formats_raw


def _measured_profile(base_hw: HardwareSpec, s: _Setup, cpu_smoke: bool, peer_link: str | None, src: str, *,
                      peak: float, gemm: float, curve: list[tuple[float, float]], h2d: H2DFit,
                      coll: dict | None) -> HardwareSpec:
    """The profile made of the base entry and the figures measured (profile.make_profile): the device's memory,
    the world's GPUs and its all-to-all where there are several."""
    import torch

    mem = torch.cuda.get_device_properties(s.device).total_memory if s.device.type == "cuda" else base_hw.memory_bytes
    return make_profile(
        base_hw, name=("cpu-smoke" if cpu_smoke else f"calibrated-{s.name.lower().replace(' ', '-')}"),
        peak_tflops=peak, gemm_tflops=gemm, curve=curve, h2d=h2d, memory_bytes=mem,
        gpus=s.world if s.world > 1 else None, coll_gbps=coll["coll_gbps"] if coll else None,
        contention=coll["contention"] if coll else None, peer_link=peer_link, source=src,
    )


def _with_fits(profile: HardwareSpec, scaled: dict, fits: dict[str, Any], disk_raw: dict | None, model: str,
               startup_processes: int, s: _Setup, date: str, log: Callable[[str], None],
               cold: dict[str, list[float]] | None = None) -> tuple[HardwareSpec, dict]:
    """The profile with its curves scaled to whole forwards, its fits (the load's and the start-up's added where
    they were measured) and the start-up's figures (a freshly started machine's, `cold`, with them); the
    start-up's raw rows."""
    load = _load_fit(disk_raw, profile, f"chunkflow calibrate {date} on {s.name}", log)
    if load is not None:
        fits["load"] = load
    startup, startup_raw = _startup(model, startup_processes, s.device, log, cold)
    if startup.get("fit") is not None:
        fits["startup"] = startup["fit"]
    # process_host_bytes: the probes' resident set, their kernels' libraries loaded (startup.py), where they ran;
    # libraries_warm_share: the libraries' cached share after them
    extra_startup = {k: startup[k] for k in ("startup_s", "startup_samples_s", "process_host_bytes",
                                             "libraries_warm_share") if k in startup}
    profile = HardwareSpec(**{**profile.model_dump(), "eta_comp_curves": scaled, "fits": fits, **extra_startup})
    return profile, startup_raw

def _device_name(device) -> str:
    return "cpu" if device.type != "cuda" else f"cuda:{device.index or 0}"


def _cold_startup(model: str, processes: int, device, log: Callable[[str], None]) -> dict[str, list[float]]:
    """A freshly started machine's start-up (startup.measure_cold_startup), on rank 0 alone; none with 0 processes."""
    from chunkflow.commands.calibrate.startup import measure_cold_startup
    from chunkflow.launch import torchrun_rank

    if processes <= 0 or torchrun_rank() != 0:
        return {}
    return measure_cold_startup(model, _device_name(device), log)


def _startup(model: str, processes: int, device, log: Callable[[str], None],
             cold: dict[str, list[float]] | None = None) -> tuple[dict[str, Any], dict]:
    """The start-up over `processes` cold processes on `device` and `cold`, a freshly started machine's samples
    (startup.calibrated_startup), on rank 0 alone; none with 0 processes."""
    from chunkflow.commands.calibrate.startup import calibrated_startup
    from chunkflow.launch import torchrun_rank

    if processes <= 0 or torchrun_rank() != 0:
        return {}, {}
    return calibrated_startup(model, processes, _device_name(device), log, cold)
