"""The exponent-Huffman codec's format and CPU reference (runtime/codecs/exponent_huffman.py): every chunk round-trips
bit for bit, whatever its bytes (random and trained-like bf16, every 16-bit pattern, NaN/Inf/subnormal-heavy
tensors, one exponent only, skewed counts that need the code lengths limited, odd sizes, chunk boundaries inside a
tensor and inside a word), Gaussian bf16 shrinks to under 0.70 of its bytes, and a damaged chunk is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from chunkflow.runtime.codecs.exponent_huffman import (GROUP_SEGMENTS, MAX_CODE_BITS, SEGMENT_BITS, code_lengths,
                                                       decode, encode)


def _bf16(values: torch.Tensor) -> np.ndarray:
    return values.to(torch.bfloat16).view(torch.uint8).numpy().copy()


def _roundtrip(data: np.ndarray):
    enc = encode(data)
    out = decode(enc)
    assert out.dtype == np.uint8 and np.array_equal(out, data)
    return enc


@pytest.mark.parametrize("std", [1e-3, 0.02, 1.0, 300.0])
def test_gaussian_bf16_round_trips_and_shrinks(std):
    g = torch.Generator().manual_seed(1)
    data = _bf16(torch.randn(300_001, generator=g) * std)  # several groups of segments, not a whole last one
    enc = _roundtrip(data)
    assert not enc.raw and enc.ratio < 0.70
    assert enc.segments > GROUP_SEGMENTS  # more than one group: the group starts are used


def test_every_16_bit_pattern_round_trips():
    data = np.arange(65536, dtype="<u2").view(np.uint8)
    _roundtrip(data)
    rng = np.random.default_rng(0)
    _roundtrip(rng.permutation(np.arange(65536, dtype="<u2")).view(np.uint8))


def test_nan_inf_and_subnormals_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50_000, generator=g) * 0.05
    x[::7] = float("nan")
    x[1::11] = float("inf")
    x[2::13] = float("-inf")
    x[3::5] = 1e-40  # subnormal in bf16
    x[4::17] = -0.0
    data = _bf16(x)
    w = data.view("<u2").copy()
    w[5::19] = 0x7FC1  # a NaN with payload bits
    w[6::23] = 0xFF81  # a negative signalling-style NaN
    enc = _roundtrip(w.view(np.uint8))
    assert not enc.raw


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 17, 255, 4097])
def test_odd_and_tiny_sizes_round_trip(n):
    g = torch.Generator().manual_seed(n)
    data = _bf16(torch.randn(n, generator=g))[: n] if n else np.zeros(0, dtype=np.uint8)
    data = np.concatenate([data, np.arange(n - data.size, dtype=np.uint8)])[:n]
    _roundtrip(data)


def test_one_exponent_only_and_constant_chunks():
    _roundtrip(_bf16(torch.full((10_000,), 1.5)))
    enc = _roundtrip(np.zeros(1 << 16, dtype=np.uint8))
    assert not enc.raw and enc.ratio < 0.6


def test_skewed_counts_keep_every_code_within_the_decoder_table():
    counts = np.zeros(256, dtype=np.int64)
    counts[:40] = [int(1.6 ** k) + 1 for k in range(40)]  # a Huffman tree far deeper than the table
    lengths = code_lengths(counts)
    assert lengths.max() == MAX_CODE_BITS
    assert sum(2.0 ** -int(l) for l in lengths if l) <= 1.0
    rng = np.random.default_rng(3)
    exps = rng.choice(40, size=200_000, p=counts[:40] / counts[:40].sum()).astype(np.uint16) + 100
    words = (exps << 7) | rng.integers(0, 128, exps.size).astype(np.uint16)
    _roundtrip(words.astype("<u2").view(np.uint8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=256, max_size=256))
def test_code_lengths_are_a_prefix_code_within_the_limit(counts):
    counts = np.array(counts, dtype=np.int64)
    lengths = code_lengths(counts)
    present = counts > 0
    assert (lengths[~present] == 0).all() and (lengths[present] >= 1).all()
    assert lengths.max(initial=0) <= MAX_CODE_BITS
    assert sum(2.0 ** -int(l) for l in lengths if l) <= 1.0


def test_chunk_boundaries_anywhere_in_a_tensor_round_trip():
    """A block's chunks cut its bytes at fixed offsets, inside a tensor and, for a block holding 1-byte tensors,
    inside a 16-bit word: each chunk round-trips on its own, and the chunks decoded end to end are the block."""
    g = torch.Generator().manual_seed(4)
    block = np.concatenate([_bf16(torch.randn(70_000, generator=g) * 0.02), np.arange(3, dtype=np.uint8),
                            torch.randn(5_000, generator=g).numpy().view(np.uint8),  # fp32 bytes
                            _bf16(torch.randn(30_000, generator=g))])
    for chunk in (4096, 4097, 65536 + 1):
        pieces = [block[i: i + chunk] for i in range(0, block.size, chunk)]
        out = [decode(encode(p)) for p in pieces]
        assert np.array_equal(np.concatenate(out), block)


def test_the_layout_matches_the_format():
    g = torch.Generator().manual_seed(5)
    data = _bf16(torch.randn(100_001, generator=g) * 0.02)
    enc = encode(data)
    assert enc.stream_at - enc.sm_at == enc.words
    assert enc.gaps_at - enc.stream_at == -(-enc.bits // SEGMENT_BITS) * SEGMENT_BITS // 8
    assert enc.segments in (-(-enc.bits // SEGMENT_BITS), -(-enc.bits // SEGMENT_BITS) - 1)
    assert enc.groups_at % 4 == 0 and 0 <= enc.groups_at - enc.gaps_at - (enc.segments + 1) // 2 < 4
    assert enc.tail_at - enc.groups_at == 4 * -(-enc.segments // GROUP_SEGMENTS)
    assert enc.data.size - enc.tail_at == data.size % 2


def test_a_damaged_chunk_is_refused():
    g = torch.Generator().manual_seed(6)
    enc = encode(_bf16(torch.randn(200_000, generator=g) * 0.02))
    data = enc.data.copy()
    data[enc.groups_at + 4] ^= 0x01  # the second group's first word
    from dataclasses import replace

    with pytest.raises(ValueError, match="damaged"):
        decode(replace(enc, data=data))


def test_the_triton_decoder_gives_the_reference_bytes_in_the_interpreter():
    """The GPU decoder (runtime/codecs/exponent_huffman_gpu.py), run by Triton's CPU interpreter: the bytes of the
    CPU reference for chunks of one and of several groups, an odd byte, one exponent only, skewed lengths, and a
    raw chunk; nothing written outside the output."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import numpy as np, torch
        from chunkflow.runtime.codecs.exponent_huffman import encode, decode
        from chunkflow.runtime.codecs.exponent_huffman_gpu import decode_into
        g = torch.Generator().manual_seed(7)
        bf = lambda v: v.to(torch.bfloat16).view(torch.uint8).numpy().copy()
        rng = np.random.default_rng(7)
        cases = [bf(torch.randn(40_001, generator=g) * 0.02), bf(torch.randn(3_000, generator=g))[:5_999],
                 bf(torch.full((2_000,), 0.75)), np.arange(65536, dtype="<u2").view(np.uint8)]
        exps = rng.choice(30, size=50_000, p=np.arange(1, 31) ** 4 / (np.arange(1, 31) ** 4).sum()).astype(np.uint16)
        cases.append(((exps + 90) << 7 | rng.integers(0, 256, exps.size).astype(np.uint16)).astype("<u2").view(np.uint8))
        for data in cases:
            enc = encode(data)
            out = torch.full((enc.nbytes + 8,), 0xAB, dtype=torch.uint8)
            decode_into(out[:enc.nbytes], torch.from_numpy(enc.data.copy()), enc)
            assert np.array_equal(out[:enc.nbytes].numpy(), data), (enc.raw, data.size)
            assert np.array_equal(out[:enc.nbytes].numpy(), decode(enc))
            assert bool((out[enc.nbytes:] == 0xAB).all()), "wrote outside"
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.parametrize("case", ["gauss", "odd", "constant", "patterns", "nan", "tiny"])
def test_the_torch_encoder_writes_the_reference_bytes(case):
    """encode_on (the encoder a load runs on the GPU, here on the CPU) gives the CPU reference's bytes and facts."""
    from chunkflow.runtime.codecs.exponent_huffman_gpu import encode_on

    g = torch.Generator().manual_seed(8)
    data = {"gauss": lambda: _bf16(torch.randn(200_003, generator=g) * 0.02),
            "odd": lambda: _bf16(torch.randn(9_000, generator=g))[:17_999],
            "constant": lambda: np.zeros(4096, dtype=np.uint8),
            "patterns": lambda: np.arange(65536, dtype="<u2").view(np.uint8),
            "nan": lambda: _bf16(torch.where(torch.rand(30_000, generator=g) < 0.2, torch.tensor(float("nan")),
                                             torch.randn(30_000, generator=g))),
            "tiny": lambda: np.array([7], dtype=np.uint8)}[case]()
    ref, got = encode(data), encode_on(torch.from_numpy(data.copy()))
    assert np.array_equal(got.data, ref.data)
    facts = ("nbytes", "raw", "bits", "segments", "sm_at", "stream_at", "gaps_at", "groups_at", "tail_at")
    assert [getattr(got, f) for f in facts] == [getattr(ref, f) for f in facts]
    assert (got.lengths is None) == (ref.lengths is None)
    assert ref.lengths is None or np.array_equal(got.lengths, ref.lengths)
