"""The fp8 -> compute-dtype cast of streamed weights (runtime/fp8cast.py): the Triton kernel gives PyTorch's bits,
and the runtime uses it only where it checked that on the device."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import chunkflow.runtime.fp8cast as fp8cast
from chunkflow.runtime.fp8cast import BLOCK, FAST_DTYPES, cast_into, cast_kernel_name

BITS = {2: torch.int16, 4: torch.int32}


def _same_bits(got: torch.Tensor, want: torch.Tensor, nan_too: bool = True) -> bool:
    """Bit for bit (so -0.0 counts); NaN payloads aside, a NaN where the reference has one (if nan_too)."""
    nan = want.isnan()
    bits = BITS[want.element_size()]
    return (not nan_too or torch.equal(nan, got.isnan())) and torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def _every_fp8(device="cpu") -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


def test_the_kernel_takes_only_the_casts_it_can_do(monkeypatch):
    """With the device's kernel said to be Triton's, `cast_into` hands it exactly the contiguous same-size fp8 ->
    float casts on one device, and gives everything else to PyTorch's copy (which must still be right)."""
    launched = []
    monkeypatch.setattr(fp8cast, "cast_kernel_name", lambda device: "triton")
    monkeypatch.setattr(fp8cast, "launch", lambda dst, src: launched.append((dst, src)) or dst.copy_(src))
    src = torch.randn(64, 48).to(torch.float8_e4m3fn)
    cases = {
        "contiguous bf16": (torch.empty(64, 48, dtype=torch.bfloat16), src, True),
        "contiguous fp32": (torch.empty(64, 48), src, True),
        "an offset view": (torch.empty(64 * 48 + 8, dtype=torch.bfloat16)[8:].view(64, 48), src, True),
        "a strided target": (torch.empty(48, 64, dtype=torch.bfloat16).t(), src, False),
        "a strided source": (torch.empty(48, 64, dtype=torch.bfloat16), src.t(), False),
        "not fp8": (torch.empty(64, 48, dtype=torch.bfloat16), torch.randn(64, 48), False),
        "an integer target": (torch.empty(64, 48, dtype=torch.int32), src, False),
        "empty": (torch.empty(0, dtype=torch.bfloat16), src[:0, 0], False),
    }
    for what, (dst, s, kernel) in cases.items():
        launched.clear()
        cast_into(dst, s)
        assert bool(launched) == kernel, what
        assert torch.equal(dst, s.to(dst.dtype)), what


def test_pytorchs_copy_where_there_is_no_gpu_and_when_asked(monkeypatch):
    assert cast_kernel_name(torch.device("cpu")) == "torch"
    every = _every_fp8()
    for dtype in FAST_DTYPES:
        dst = torch.full((256,), 3.0, dtype=dtype)
        cast_into(dst, every)
        assert _same_bits(dst, every.to(dtype))
    fp8cast.fast_cast_kernel.cache_clear()
    monkeypatch.setenv(fp8cast.CHOICE_ENV, "torch")
    try:
        assert fp8cast.fast_cast_kernel(0) == "torch"  # decided before any CUDA call
    finally:
        fp8cast.fast_cast_kernel.cache_clear()


def test_triton_kernel_gives_pytorchs_bits_in_the_interpreter():
    """The kernel itself (offsets, the tail's mask, the target dtype), run by Triton's CPU interpreter on sizes that
    do and do not fill whole programs. The interpreter's fp8 NaN differs from hardware's (checked on the GPU)."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from chunkflow.runtime.fp8cast import launch, FAST_DTYPES, BLOCK
        bits = {2: torch.int16, 4: torch.int32}
        gen = torch.Generator().manual_seed(0)
        for n in (1, 255, 256, BLOCK - 1, BLOCK, 2 * BLOCK + 17):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            src[: min(n, 256)] = torch.arange(min(n, 256), dtype=torch.uint8)
            src = src.view(torch.float8_e4m3fn)
            for dtype in FAST_DTYPES:
                for lo in (0, 3):  # also views that start inside their storage, on both sides
                    buf = torch.cat([torch.zeros(lo, dtype=torch.uint8), src.view(torch.uint8)]).view(torch.float8_e4m3fn)
                    dst = torch.full((n + 5 + 2 * lo,), 3.0, dtype=dtype)  # poisoned, and 5 elements past the end
                    launch(dst[2 * lo : 2 * lo + n], buf[lo:])
                    want = src.to(dtype)
                    ok = ~want.isnan()
                    got = dst[2 * lo : 2 * lo + n]
                    assert torch.equal(got[ok].view(bits[dst.element_size()]), want[ok].view(bits[dst.element_size()])), (n, dtype, lo)
                    assert bool((dst[: 2 * lo] == 3.0).all()) and bool((dst[2 * lo + n :] == 3.0).all()), "wrote outside"
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", FAST_DTYPES)
def test_cuda_cast_gives_pytorchs_bits(dtype):
    """On a GPU: the kernel the runtime picked gives `stored.to(dtype)`'s bits on every fp8 value (NaN included) and
    on a large random tensor whose size is not a whole number of programs."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.importorskip("triton")
        assert cast_kernel_name(dev) == "triton"
    src = _every_fp8(dev)
    dst = torch.full((256,), 3.0, dtype=dtype, device=dev)
    cast_into(dst, src)
    assert _same_bits(dst, src.to(dtype))
    big = torch.randint(0, 256, (5 * BLOCK + 3,), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    out = torch.full((big.numel() + 7,), 3.0, dtype=dtype, device=dev)
    cast_into(out[: big.numel()], big)
    assert _same_bits(out[: big.numel()], big.to(dtype)) and bool((out[big.numel():] == 3.0).all())


@pytest.fixture
def fresh_choice(monkeypatch):
    """fast_cast_kernel decided anew (its per-device cache emptied before and after), on a pretend Hopper."""
    fp8cast.fast_cast_kernel.cache_clear()
    monkeypatch.delenv(fp8cast.CHOICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    yield monkeypatch
    fp8cast.fast_cast_kernel.cache_clear()


def test_the_fallback_to_pytorchs_copy_is_said_once_per_device(fresh_choice):
    """No Triton on a GPU that could use it: PyTorch's copy, with one warning per device (the plan priced the
    kernel); a GPU with no fp8 conversion takes PyTorch's copy silently unless the kernel was asked for."""
    fresh_choice.setattr(fp8cast, "_triton_kernel", lambda: None)
    with pytest.warns(fp8cast.Fp8CastFallbackWarning, match="Triton could not be imported"):
        assert fp8cast.fast_cast_kernel(0) == "torch"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp8cast.fast_cast_kernel(0) == "torch"  # decided once: no second warning
        fresh_choice.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
        assert fp8cast.fast_cast_kernel(1) == "torch"  # an A100: nothing to warn about
    fresh_choice.setenv(fp8cast.CHOICE_ENV, "triton")
    with pytest.warns(fp8cast.Fp8CastFallbackWarning, match="no fp8 conversion"):
        assert fp8cast.fast_cast_kernel(2) == "torch"
    fresh_choice.setenv(fp8cast.CHOICE_ENV, "fast please")
    with pytest.warns(UserWarning, match="is not 'torch', 'auto' or 'triton'"):
        fp8cast.fast_cast_kernel(3)


def test_a_kernel_that_fails_or_differs_is_not_used(fresh_choice):
    """The check on all 256 fp8 values: a kernel that raises, or gives other bits, leaves the cast to PyTorch's copy
    with a warning saying why (run here on CPU tensors, as the check would on the GPU)."""
    fresh_choice.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    fresh_choice.setattr(torch, "arange", _on_cpu(torch.arange))
    fresh_choice.setattr(fp8cast, "_triton_kernel", lambda: object())  # a Triton there (launch is stubbed below)

    def raises(dst, src):
        raise RuntimeError("PTX not supported")

    fresh_choice.setattr(fp8cast, "launch", raises)
    with pytest.warns(fp8cast.Fp8CastFallbackWarning, match="RuntimeError: PTX not supported"):
        assert fp8cast.fast_cast_kernel(0) == "torch"

    def off_by_one_bit(dst, src):
        dst.copy_(src)
        dst.view(torch.uint8)[0] ^= 1

    fresh_choice.setattr(fp8cast, "launch", off_by_one_bit)
    with pytest.warns(fp8cast.Fp8CastFallbackWarning, match="differed from PyTorch's"):
        assert fp8cast.fast_cast_kernel(1) == "torch"
    fresh_choice.setattr(fp8cast, "launch", lambda dst, src: dst.copy_(src))
    assert fp8cast.fast_cast_kernel(2) == "triton"  # the same bits on every value and dtype: used


def _on_cpu(arange):
    """torch.arange with any CUDA device asked for made on the CPU (the check's tensors, on a machine with no GPU)."""
    return lambda *a, device=None, **kw: arange(*a, **kw)


def test_the_kernel_is_launched_on_its_tensors_device(monkeypatch):
    """Triton launches on the current device's current stream: `launch` makes the tensors' device current."""
    entered = []

    class Guard:
        def __init__(self, device):
            entered.append(torch.device(device))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Kernel:
        def __getitem__(self, grid):
            return lambda src, dst, n, **kw: entered.append(("launch", n, grid))

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(fp8cast, "_triton_kernel", lambda: Kernel())
    src = torch.empty(3 * BLOCK + 1, dtype=torch.float8_e4m3fn, device="meta")
    fake = type("T", (), {"device": torch.device("cuda", 1), "numel": lambda self: src.numel()})()
    fp8cast.launch(fake, fake)
    assert entered == [torch.device("cuda", 1), ("launch", 3 * BLOCK + 1, (4,))]
