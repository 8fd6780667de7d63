"""The cast of fp8-stored weights into their compute dtype on the device, before a block runs.

PyTorch's own copy kernel converts float8_e4m3fn in software: about 630 GB/s of bf16 output on an H200, a sixth of
its memory bandwidth, so the cast cost more than the copies it saved on compute-heavy blocks (Qwen-Image: 1.1 ms of
a 6 ms block). On a GPU that converts fp8 in hardware (compute capability 8.9 and up) with Triton installed, a
one-pass Triton kernel does the same cast instead. Both are exact: every float8_e4m3fn value is a bfloat16,
float16 and float32 value, so the bits are those of `stored.to(compute_dtype)` (diffusers' layerwise casting);
`fast_cast_kernel` checks that on all 256 fp8 values once per device before the kernel is used, and otherwise
PyTorch's copy does the cast.
"""

from __future__ import annotations

import functools
import os

import torch

BLOCK = 8192  # fp8 elements per Triton program: 32 per thread with 8 warps, read as two 16-byte loads
NUM_WARPS = 8
FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIT_VIEWS = {2: torch.int16, 4: torch.int32}  # compare casts bit for bit (-0.0 too)
DISABLE_ENV = "CHUNKFLOW_FP8_CAST"  # "torch": always PyTorch's copy (to compare the two)


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    """The Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or broken: PyTorch's copy does the cast
        return None

    @triton.jit
    def cast_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(dst.dtype.element_ty), mask=mask)

    return cast_kernel


def launch(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Cast contiguous `src` into contiguous `dst` (same number of elements) with the Triton kernel, on the
    current stream."""
    import triton

    n = src.numel()
    _triton_kernel()[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK, num_warps=NUM_WARPS)


@functools.lru_cache(maxsize=None)
def fast_cast_kernel(device_index: int) -> str:
    """'triton' where the Triton kernel runs on this CUDA device and gives PyTorch's bits for every fp8 value (and
    every compute dtype), else 'torch' (PyTorch's copy kernel)."""
    if os.environ.get(DISABLE_ENV, "").lower() == "torch" or _triton_kernel() is None:
        return "torch"
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return "torch"  # no hardware fp8 conversion there
    try:
        src = torch.arange(256, dtype=torch.uint8, device=f"cuda:{device_index}").view(torch.float8_e4m3fn)
        for dtype in FAST_DTYPES:
            want = src.to(dtype)
            got = torch.full_like(want, 7.0)
            launch(got, src)
            nan, bits = want.isnan(), BIT_VIEWS[want.element_size()]
            if not (torch.equal(nan, got.isnan()) and torch.equal(want[~nan].view(bits), got[~nan].view(bits))):
                return "torch"
    except Exception:  # a Triton that cannot compile for this GPU: PyTorch's copy does the cast
        return "torch"
    return "triton"


def cast_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src.to(dst.dtype), for fp8-stored weights: the Triton kernel where `fast_cast_kernel` allows it and
    both tensors are contiguous on one CUDA device, else PyTorch's copy."""
    if (src.is_cuda and src.dtype == torch.float8_e4m3fn and dst.dtype in FAST_DTYPES and dst.device == src.device
            and src.numel() == dst.numel() and src.numel() and src.is_contiguous() and dst.is_contiguous()
            and fast_cast_kernel(src.device.index if src.device.index is not None else torch.cuda.current_device())
            == "triton"):
        launch(dst, src)
    else:
        dst.copy_(src)


def cast_kernel_name(device: torch.device) -> str:
    """Which kernel `cast_into` uses for fp8 weights on `device`: 'triton' or 'torch'."""
    if device.type != "cuda":
        return "torch"
    return fast_cast_kernel(device.index if device.index is not None else torch.cuda.current_device())
