"""The cast of fp8-stored weights into their compute dtype on the device, before a block runs.

PyTorch's own copy kernel converts float8_e4m3fn in software: about 620 GB/s of bf16 output on an H200, a sixth of
its memory bandwidth, so the cast cost more than the copies it saved on compute-heavy blocks (Qwen-Image: 1.1 ms of
a 6 ms block). On a GPU that converts fp8 in hardware (compute capability 8.9 and up) with Triton installed, a
one-pass Triton kernel does the same cast instead. Both are exact: every float8_e4m3fn value is a bfloat16,
float16 and float32 value, so the bits are those of `stored.to(compute_dtype)` (diffusers' layerwise casting).
`fast_cast_kernel` checks that on all 256 fp8 values once per device (the handle asks at offload time) before the
kernel is used; where it cannot be used, PyTorch's copy does the cast and a warning says why, since the planner
prices the cast at the rate `chunkflow calibrate` measured for the kernel the runtime uses.

`CHUNKFLOW_FP8_CAST=torch` makes the runtime use PyTorch's copy (to compare the two), `triton` asks for the kernel
and warns where it cannot run; it is read once per device, at the first fp8 offload on it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

BLOCK = 8192  # fp8 elements per Triton program: 32 per thread with 8 warps, read as two 16-byte loads
NUM_WARPS = 8
FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIT_VIEWS = {2: torch.int16, 4: torch.int32}  # compare casts bit for bit (-0.0 too)
CHOICE_ENV = "CHUNKFLOW_FP8_CAST"  # "torch": PyTorch's copy; unset/"auto": the Triton kernel where it can; "triton": that,
# with a warning where it cannot


class Fp8CastFallbackWarning(UserWarning):
    """The fast fp8 cast cannot run on a device: PyTorch's (slower) copy casts there, with the same bits."""


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
    """Cast contiguous `src` into contiguous `dst` (same number of elements, one device) with the Triton kernel, on
    that device's current stream."""
    n = src.numel()
    guard = torch.cuda.device(src.device) if src.device.type == "cuda" else contextlib.nullcontext()
    with guard:  # Triton launches on the current device's current stream: make it the tensors' device
        _triton_kernel()[(-(-n // BLOCK),)](src, dst, n, BLOCK=BLOCK, num_warps=NUM_WARPS)


def _fallback(device_index: int, why: str) -> str:
    warnings.warn(f"chunkflow: fp8 weights on cuda:{device_index} are cast by PyTorch's copy kernel, not the fast "
                  f"Triton kernel ({why}); same bits, but slower than `chunkflow calibrate`'s rate where that was "
                  "measured with the kernel", Fp8CastFallbackWarning, stacklevel=3)
    return "torch"


@functools.lru_cache(maxsize=None)
def fast_cast_kernel(device_index: int) -> str:
    """'triton' where the Triton kernel runs on this CUDA device and gives PyTorch's bits for every fp8 value (and
    every compute dtype), else 'torch' (PyTorch's copy kernel), decided once per device."""
    choice = os.environ.get(CHOICE_ENV, "").strip().lower()
    if choice == "torch":
        return "torch"
    if choice not in ("", "auto", "triton"):
        warnings.warn(f"chunkflow: {CHOICE_ENV}={os.environ[CHOICE_ENV]!r} is not 'torch', 'auto' or 'triton'; "
                      "using 'auto'", stacklevel=2)
    if torch.cuda.get_device_capability(device_index) < (8, 9):  # no hardware fp8 conversion: PyTorch's copy it is
        return "torch" if choice != "triton" else _fallback(device_index, "the GPU has no fp8 conversion (< sm_89)")
    if _triton_kernel() is None:
        return _fallback(device_index, "Triton could not be imported")
    try:
        with torch.cuda.device(device_index):
            src = torch.arange(256, dtype=torch.uint8, device=f"cuda:{device_index}").view(torch.float8_e4m3fn)
            for dtype in FAST_DTYPES:
                want = src.to(dtype)
                got = torch.full_like(want, 7.0)
                launch(got, src)
                nan, bits = want.isnan(), BIT_VIEWS[want.element_size()]
                if not (torch.equal(nan, got.isnan()) and torch.equal(want[~nan].view(bits), got[~nan].view(bits))):
                    return _fallback(device_index, f"its {dtype} cast differed from PyTorch's")
    except Exception as exc:  # a Triton that cannot compile or launch here
        return _fallback(device_index, f"{type(exc).__name__}: {str(exc)[:200]}")
    return "triton"


def kernel_fits(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the Triton kernel can do this cast: fp8 into a float dtype, contiguous, same size, one device."""
    return (src.dtype == torch.float8_e4m3fn and dst.dtype in FAST_DTYPES and dst.device == src.device
            and src.numel() == dst.numel() and src.numel() > 0 and src.is_contiguous() and dst.is_contiguous())


def cast_kernel_name(device: torch.device) -> str:
    """Which kernel `cast_into` uses for fp8 weights on `device`: 'triton' or 'torch'."""
    if device.type != "cuda":
        return "torch"
    return fast_cast_kernel(device.index if device.index is not None else torch.cuda.current_device())


def cast_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src.to(dst.dtype), for fp8-stored weights: the Triton kernel where `cast_kernel_name` says so for
    the device and the tensors fit it (`kernel_fits`), else PyTorch's copy."""
    if kernel_fits(dst, src) and cast_kernel_name(src.device) == "triton":
        launch(dst, src)
    else:
        dst.copy_(src)
