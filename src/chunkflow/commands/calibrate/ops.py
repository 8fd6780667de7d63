"""What `chunkflow calibrate` measures for the operator model (chunkflow_planner/ops.py) and the whole pipeline:
bf16 GEMM and attention efficiencies on a grid of shapes, device-memory bandwidth, the device memory torch does
not count (CUDA context and libraries), the host CPU's matmul rate, and the scale of the memory-bound operators
fitted to the real blocks calibrate timed.

Every function takes the device and returns plain numbers; nothing here writes files.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

GEMM_M = (128, 512, 2048, 8192, 32768)
GEMM_NK = (1024, 3072, 5120, 12288, 24576)
ATTN_LENS = (256, 1024, 4096, 16384, 65536)
ATTN_HEADS, ATTN_HEAD_DIM = 24, 128

Progress = Callable[[str, int], Callable[[], None]]


def _no_progress(desc: str, total: int) -> Callable[[], None]:
    return lambda: None


def _time(fn: Callable[[], object], cuda: bool, warmup: int = 2, repeats: int = 5,
          residuals: list[list[float]] | None = None) -> float:
    """Median seconds of fn() (CUDA events on the GPU, perf_counter on the CPU); the repeats / the median - 1
    appended to `residuals` where given, as one group (fit_quality counts a median fitted per group)."""
    from chunkflow.commands.calibrate.robust import about_median
    from chunkflow.timing import time_on

    for _ in range(warmup):
        fn()
    times = [time_on(cuda, fn)[1] for _ in range(repeats)]
    if residuals is not None:
        residuals.append(about_median(times))
    return statistics.median(times)


def gemm_rates(device, ms: Sequence[int], nks: Sequence[int], progress: Progress = _no_progress, warmup: int = 2,
               repeats: int = 5, residuals: list[list[float]] | None = None) -> list[tuple[float, float, float, float]]:
    """[M, N, K, TFLOP/s] of bf16 (M x K) @ (K x N) for every M in `ms` and N, K in `nks` on `device`; each
    shape's repeats about their median into `residuals`, a list a shape (_time)."""
    import torch

    cuda = device.type == "cuda"
    dt = torch.bfloat16
    rows = []
    step = progress("GEMM efficiency by shape", len(ms) * len(nks) ** 2)
    big_a = torch.randn(max(ms), max(nks), device=device, dtype=dt)
    big_b = torch.randn(max(nks), max(nks), device=device, dtype=dt)
    for m in ms:
        for n in nks:
            for k in nks:
                a, b = big_a[:m, :k], big_b[:k, :n]
                t = _time(lambda: torch.mm(a, b), cuda, warmup=warmup, repeats=repeats, residuals=residuals)
                rows.append((float(m), float(n), float(k), 2.0 * m * n * k / t / 1e12))
                step()
    del big_a, big_b
    return rows


def measure_gemm_grid(device, peak_tflops: float, ms: Sequence[int] = GEMM_M, nks: Sequence[int] = GEMM_NK,
                      progress: Progress = _no_progress) -> list[tuple[float, float, float, float]]:
    """[M, N, K, eta] for every M in `ms` and N, K in `nks`: bf16 (M x K) @ (K x N) against P_peak."""
    return [(m, n, k, min(1.0, rate / peak_tflops)) for m, n, k, rate in gemm_rates(device, ms, nks, progress)]


def measure_attention_grid(device, peak_tflops: float, lens: Sequence[int] = ATTN_LENS,
                           heads: int = ATTN_HEADS, head_dim: int = ATTN_HEAD_DIM, masked: bool = False,
                           progress: Progress = _no_progress) -> list[tuple[float, float, float]]:
    """[query tokens, key tokens, eta] for every pair of `lens`: bf16 scaled_dot_product_attention, batch 1;
    `masked`: given a boolean key-padding mask of shape (1, 1, 1, kv) hiding the last 5% of the keys, as
    HunyuanVideo masks its padded text (eta counts every key, as the operator model does)."""
    import torch
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    rows = []
    step = progress("attention efficiency by shape" + (" (masked)" if masked else ""), len(lens) ** 2)
    for q_len in lens:
        q = torch.randn(1, heads, q_len, head_dim, device=device, dtype=torch.bfloat16)
        for kv_len in lens:
            k = torch.randn(1, heads, kv_len, head_dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            mask = None
            if masked:
                mask = torch.ones(1, 1, 1, kv_len, device=device, dtype=torch.bool)
                mask[..., kv_len - max(1, kv_len // 20):] = False
            t = _time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), cuda)
            flops = 4.0 * heads * q_len * kv_len * head_dim
            rows.append((float(q_len), float(kv_len), min(1.0, flops / (t * peak_tflops * 1e12))))
            step()
    return rows


def measure_hbm(device, nbytes: int = 2 * 2**30) -> float:
    """Achieved device-memory bandwidth in GB/s: a device-to-device copy reads and writes `nbytes`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), device.type == "cuda")
    return 2 * nbytes / t / 1e9


def measure_fp8_cast(device, nbytes: int = 2**30) -> float:
    """bf16 GB/s of the fp8 storage cast: float8_e4m3fn weights cast into a bf16 buffer by the runtime's own cast
    (`runtime.fp8cast.cast_into`, what it does before each block with fp8 storage), for `nbytes` of bf16 output,
    as tensors of a large linear weight's size (32 MiB of bf16 each)."""
    import torch

    from chunkflow.runtime.fp8cast import cast_into

    n = nbytes // 2
    each = min(n, 2**24)
    src = torch.randn(n // each * each, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    pairs = [(dst[i : i + each], src[i : i + each]) for i in range(0, src.numel(), each)]

    def cast_all() -> None:
        for d, s in pairs:
            cast_into(d, s)

    t = _time(cast_all, device.type == "cuda")
    return 2 * src.numel() / t / 1e9


def measure_context_bytes(device) -> int:
    """Device memory in use beyond what torch's allocator reserved: the CUDA context, cuBLAS/cuDNN workspaces and
    kernels loaded so far (measure after the other measurements, so the libraries are loaded)."""
    import torch

    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def measure_cpu_tflops(n: int = 1024, residuals: list[list[float]] | None = None) -> float:
    """The host CPU's bf16 matmul rate (all threads), for text encoders placed on the CPU; its repeats about their
    median into `residuals`, as one list (_time)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    t = _time(lambda: torch.mm(a, b), False, warmup=1, repeats=3, residuals=residuals)
    return 2.0 * n**3 / t / 1e12


def fit_mem_ops_scale(rows: Sequence[dict], hw) -> float:
    """mem_ops_scale that makes the operator model fit the measured blocks best: time ~ t_GEMMs+attention + scale x
    t_memory-bound, in relative error with a robust loss (fit.robust_linear), within [0.05, 100]; rows carry
    `model`, `tokens`, `batch` and `time_s` of one block of each block list, as calibrate measures them."""
    from chunkflow.commands.calibrate.robust import robust_linear
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.ops import block_ops, split

    unit = hw.model_copy(update={"mem_ops_scale": 1.0})
    flops, mem, times = [], [], []
    for r in rows:
        spec = get_model(r["model"])
        t_flops = t_mem = 0.0
        for g in spec.blocks:
            a, b = split(block_ops(spec, g, r.get("batch", 1), r["tokens"], spec.text_len), unit)
            t_flops += a
            t_mem += b
        if r["time_s"] > 0:
            flops.append(t_flops)
            mem.append(t_mem)
            times.append(r["time_s"])
    if not any(m > 0 for m in mem):
        return 1.0
    (scale,) = robust_linear([[m] for m in mem], times, offset=flops, x0=[1.0])
    return max(0.05, min(100.0, scale))


# ---------------------------------------------------------------------------------------------- VAEs


def vae_points(spec, cpu: bool = False) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]]:
    """(untiled, tiled) decode sizes (batch, frames, height, width) for the VAE of catalog model `spec`: enough to
    separate the fit's terms (per pixel of a frame, per output voxel, constant) and one more (a fit through every
    decode it has says nothing of its spread: ops.vae_residuals), above the VAE's tile size for the tiled ones."""
    if cpu:
        if spec.is_video:
            return ([(1, 5, 64, 64), (1, 9, 64, 64), (1, 5, 128, 128), (1, 9, 128, 128)],
                    [(1, 5, 128, 128), (1, 9, 128, 128), (1, 13, 128, 128)])
        pts = [(1, 1, 64, 64), (1, 1, 128, 128)]
        return pts, pts[1:]
    if spec.is_video:  # up to sizes people generate: a decode's bytes per output voxel grow with the frame count,
        # so fits from short clips fall short on long ones (5-13 frame untiled fits were 25% over in memory at 81
        # frames on an H200); tiled decodes at two resolutions, so the time per decoder call averages edge tiles
        # of both (a fit per voxel from one resolution was 23% short at 480x832 x121)
        return ([(1, 5, 256, 448), (1, 21, 256, 448), (1, 13, 480, 832), (1, 41, 480, 832)],
                [(1, 21, 480, 832), (1, 21, 704, 1280), (1, 61, 704, 1280)])
    return ([(1, 1, 512, 512), (1, 1, 768, 768), (1, 1, 1024, 1024)],
            [(1, 1, 1536, 1536), (1, 1, 1792, 1792), (1, 1, 2048, 2048)])


def _warmup_frames(spec) -> int:
    """Frames whose decode runs the first and a later latent frame (5), and for a VAE tiled in time chunks one
    chunk more than a whole one (HunyuanVideo: 17); images 1."""
    vt = spec.vae_temporal
    if vt is None:
        return 1
    tiling = spec.pipeline.vae.tiling
    if tiling is not None and tiling.frames == "chunks":
        return 1 + vt * (tiling.tile_frames // vt)
    return 1 + vt


def measure_vae(spec, device, points, tiled: bool, warmup: bool = True) -> list[dict]:
    """Decode random latents at each point with model `spec`'s VAE (random weights, its dtype): seconds and
    the peak allocation above what was allocated before (weights and latents), per point. The warm-up decodes the
    first point's size at the fewest frames that take every path of its tiled decode (_warmup_frames), so every
    tile shape has run once."""
    import time

    import torch

    from chunkflow.models.components import meta_vae
    from chunkflow.models.meta import RandomSource
    from chunkflow.models.pipeline_build import DTYPES
    from chunkflow.api import offload

    vae_spec = spec.pipeline.vae
    dtype = DTYPES[vae_spec.dtype]
    vae = meta_vae(vae_spec, dtype)
    handle = offload(vae, "none", device=device, source=RandomSource(0, device, vae))
    if tiled:
        vae.enable_tiling()
    cuda = device.type == "cuda"
    s = spec.vae_spatial
    image_2d = not any(isinstance(m, torch.nn.Conv3d) for m in vae.modules())  # a video decoder takes frames

    def latents(b, f, h, w):
        lf = (f - 1) // (spec.vae_temporal or 1) + 1
        shape = (b, spec.latent_channels, h // s, w // s) if image_2d else (b, spec.latent_channels, lf, h // s, w // s)
        return torch.randn(shape, device=device, dtype=dtype)

    rows = []
    try:
        with torch.no_grad():
            if warmup:
                b, f, h, w = points[0]
                vae.decode(latents(b, min(f, _warmup_frames(spec)), h, w), return_dict=False)
            for b, f, h, w in points:
                z = latents(b, f, h, w)
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated(device)
                    base_reserved = torch.cuda.memory_reserved(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                vae.decode(z, return_dict=False)
                if cuda:
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
                held = torch.cuda.max_memory_reserved(device) - base_reserved if cuda else None
                rows.append(dict(vae=vae_spec.name, batch=b, frames=f, height=h, width=w, tiled=tiled, time_s=dt,
                                 peak_bytes=int(peak), reserved_bytes=None if held is None else int(held)))
                del z
    finally:
        handle.remove()
        del vae
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _lstsq(rows: list[dict], basis: Callable[[dict], list[float]], key: str) -> list[float]:
    """Coefficients of `key` on `basis`: in relative error with a robust loss (fit.robust_linear: a stray decode
    does not move them); where a value is not positive (peak memory on the CPU: 0), plain least squares (numpy)."""
    import numpy as np

    from chunkflow.commands.calibrate.robust import robust_linear

    A = [basis(r) for r in rows]
    y = [float(r[key]) for r in rows]
    if all(v > 0 for v in y):
        return robust_linear(A, y)
    return [float(c) for c in np.linalg.lstsq(np.array(A, dtype=float), np.array(y), rcond=None)[0]]


def fit_vae(rows: list[dict], video: bool, source: str, calls: Callable[[dict], int] | None = None) -> dict:
    """A VaeDecodeFit (as a dict) from measured decodes: memory on [1, H W, voxels] (video) or [1, voxels] (image),
    time on [1, voxels], or on [1, decoder calls] where `calls` counts them (tiled decodes), each in relative error
    with a robust loss (_lstsq); a negative slope is dropped and the rest refitted, and a negative time intercept
    gives way to a line through the origin (fitted the same way)."""
    px = lambda r: r["height"] * r["width"]  # noqa: E731
    vox = lambda r: r["batch"] * r["frames"] * px(r)  # noqa: E731
    if video and len({px(r) for r in rows}) > 1:
        c0, c_px, c_vox = _lstsq(rows, lambda r: [1.0, px(r), vox(r)], "peak_bytes")
        if c_px < 0 or c_vox < 0:
            (c0, c_vox), c_px = _lstsq(rows, lambda r: [1.0, vox(r)], "peak_bytes"), 0.0
    else:
        (c0, c_vox), c_px = _lstsq(rows, lambda r: [1.0, vox(r)], "peak_bytes"), 0.0
    size = calls or vox
    t0, rate = _lstsq(rows, lambda r: [1.0, float(size(r))], "time_s")
    if rate <= 0 or t0 < 0:  # a line through the origin: a negative intercept would price small decodes at 0 s
        (rate,), t0 = _lstsq(rows, lambda r: [float(size(r))], "time_s"), 0.0
    timing = dict(time_per_call=rate, time_per_voxel=0.0) if calls else dict(time_per_voxel=rate)
    slack = vae_slack(rows)
    return dict(mem_const=c0, mem_per_px=max(0.0, c_px), mem_per_voxel=max(0.0, c_vox), time_const=t0, **timing,
                source=source, **({} if slack is None else {"alloc_slack": slack}))


SLACK_MOST = 10.0  # VaeDecodeFit.alloc_slack's bound: a decode reserving more is priced at it


def vae_slack(rows: list[dict]) -> float | None:
    """The allocator's slack over decodes `rows`: what it reserved beyond each decode's peak allocation, per byte of
    that allocation (both over the decode's start, after emptying the cache), the median over the decodes, within
    [0, SLACK_MOST]; None where none was measured (the CPU: `reserved_bytes` None, or rows from before calibrate
    recorded it)."""
    held = [(r["reserved_bytes"] - r["peak_bytes"]) / r["peak_bytes"] for r in rows
            if r.get("reserved_bytes") is not None and r["peak_bytes"] > 0]
    return min(SLACK_MOST, max(0.0, statistics.median(held))) if held else None


def vae_residuals(rows: list[dict], fit: dict, calls: Callable[[dict], int] | None = None
                  ) -> tuple[list[float], list[float]]:
    """(time, memory) residuals of decodes `rows` about their fit (fit_vae's dict; `calls` as given to it): measured
    / fitted - 1 per decode. A fit with no more decodes than the coefficients it fitted (those not 0) passes through
    every one of them, so its residuals say nothing of its spread: it gives none; nor does memory measured as 0
    (the CPU)."""
    px = lambda r: r["height"] * r["width"]  # noqa: E731
    vox = lambda r: r["batch"] * r["frames"] * px(r)  # noqa: E731
    size = calls or vox
    rate = fit["time_per_call"] if calls else fit["time_per_voxel"]
    t_coef, m_coef = vae_coefficients(fit)
    from chunkflow.commands.calibrate.robust import relative_residuals

    time = relative_residuals([r["time_s"] for r in rows], [fit["time_const"] + rate * size(r) for r in rows]) \
        if len(rows) > t_coef else []
    mem = relative_residuals([r["peak_bytes"] for r in rows], [
        fit["mem_const"] + fit["mem_per_px"] * px(r) + fit["mem_per_voxel"] * vox(r) for r in rows]) \
        if len(rows) > m_coef and all(r["peak_bytes"] > 0 for r in rows) else []
    return time, mem


def vae_coefficients(fit: dict) -> tuple[int, int]:
    """(time, memory) coefficients a VAE fit (fit_vae's dict) fitted: those not 0 (a dropped term was not fitted)."""
    rate = fit["time_per_call"] if "time_per_call" in fit else fit["time_per_voxel"]
    return (sum(1 for c in (fit["time_const"], rate) if c != 0),
            sum(1 for c in (fit["mem_const"], fit["mem_per_px"], fit["mem_per_voxel"]) if c != 0))
