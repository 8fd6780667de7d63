"""The stored formats' decode rates (issue 52), as the planner prices them (chunkflow_planner/formats.py): on this
device, a linear weight of each format dequantized as its layer does it in each forward, timed, the median of
repeats, in GB/s of dequantized output (HardwareSpec.format_decode_gbps):
- GGUF (q8_0, q6_k, q5_k, q4_k, q4_0): diffusers' own `dequantize_gguf_tensor` on a GGUFParameter of that type,
  then `.to(bfloat16)`: GGUFLinear.forward_native's two steps (diffusers' fused CUDA kernels, where its optional
  `kernels` package brings them, multiply without dequantizing: not what chunkflow runs);
- fp8-scaled: `w.to(bfloat16) * scale`, as the format's readers dequantize it.
The weights are valid blocks of random bytes with finite scales (the values do not change the kernels' time). On the
CPU (chunkflow's CPU mode) it measures the CPU's rates, smaller, as calibrate does its other figures there.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

GPU_SHAPE = (4096, 4096)  # 16M weights: 32 MB dequantized, about a FLUX linear
CPU_SHAPE = (256, 4096)
GPU_REPEATS, CPU_REPEATS = 20, 3
# ggml type -> byte ranges of each quant block's fp16 scale fields (set to small finite values)
_SCALE_FIELDS = {"Q8_0": [(0, 2)], "Q4_0": [(0, 2)], "Q4_K": [(0, 2), (2, 4)], "Q5_K": [(0, 2), (2, 4)],
                 "Q6_K": [(208, 210)]}


def gguf_weight(gguf_type: str, rows: int, cols: int, device):  # noqa: ANN001, ANN201 - torch types
    """A GGUFParameter of `gguf_type` holding a (rows, cols) weight: random quant blocks with finite scales."""
    import gguf
    import numpy as np
    import torch
    from diffusers.quantizers.gguf.utils import GGUFParameter

    qtype = getattr(gguf.GGMLQuantizationType, gguf_type)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for lo, hi in _SCALE_FIELDS[gguf_type]:
        scale = (rng.random((rows, cols // block)) * 0.01 + 0.001).astype(np.float16)
        raw[:, :, lo:hi] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    data = torch.from_numpy(raw.reshape(rows, cols // block * size)).to(device)
    return GGUFParameter(data, requires_grad=False, quant_type=qtype)


def _dequantizer(fmt: str, rows: int, cols: int, device) -> Callable[[], object]:  # noqa: ANN001
    """The layer's dequantization of one weight of `fmt`, as a call."""
    import torch

    if fmt == "fp8-scaled":
        g = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn).to(device)
        scale = torch.tensor(0.01, dtype=torch.float32, device=device)
        return lambda: w.to(torch.bfloat16) * scale.to(torch.bfloat16)
    from chunkflow_planner.formats import FORMATS
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    weight = gguf_weight(FORMATS[fmt].gguf_type, rows, cols, device)
    return lambda: dequantize_gguf_tensor(weight).to(torch.bfloat16)


def measure_format(fmt: str, device, shape: tuple[int, int] | None = None,  # noqa: ANN001
                   repeats: int | None = None) -> dict:
    """{gbps, median_s, nbytes, times_s} of one format's dequantization on `device` (CUDA events there, the wall
    clock on the CPU), after a warm-up call."""
    import torch

    cuda = device.type == "cuda"
    rows, cols = shape or (GPU_SHAPE if cuda else CPU_SHAPE)
    repeats = repeats or (GPU_REPEATS if cuda else CPU_REPEATS)
    run = _dequantizer(fmt, rows, cols, device)
    out = run()
    if not bool(torch.isfinite(out.float()).all()):
        raise RuntimeError(f"{fmt}'s dequantization gave non-finite values: its rate is not measured")
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    nbytes = rows * cols * 2
    return dict(gbps=nbytes / median / 1e9, median_s=median, nbytes=nbytes, times_s=times)


def measure_formats(device, log: Callable[[str], None], formats: tuple[str, ...] | None = None) -> tuple[dict, dict]:  # noqa: ANN001
    """(profile fields, raw rows): format_decode_gbps for every stored format whose reader is installed (GGUF
    needs diffusers' GGUF support and the gguf package); a format left out stays supposed in the planner."""
    from chunkflow_planner.formats import FORMATS

    names = formats or tuple(n for n, f in FORMATS.items() if f.quantized)
    rates: dict[str, float] = {}
    raw: dict[str, dict] = {}
    for fmt in names:
        try:
            row = measure_format(fmt, device)
        except ImportError as exc:  # gguf or diffusers' GGUF support missing: that format stays supposed
            log(f"{fmt} decode rate not measured ({exc}); `pip install gguf` measures it")
            continue
        except RuntimeError as exc:
            log(f"{fmt} decode rate not measured: {exc}")
            continue
        rates[fmt], raw[fmt] = float(f"{row['gbps']:.3g}"), row
        log(f"{fmt}: dequantizes {row['nbytes'] / 2**20:.0f} MiB in {row['median_s'] * 1e3:.3f} ms "
            f"({row['gbps']:.3g} GB/s of bf16 output)")
    return ({"format_decode_gbps": rates} if rates else {}), raw
