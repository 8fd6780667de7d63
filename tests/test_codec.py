"""The exponent-pack codec (runtime/codecs/exponent_pack.py): every chunk round-trips bit for bit whatever its bytes
(random and trained-like bf16, every 16-bit pattern, NaN/Inf/subnormal-heavy tensors, one exponent only, fp32 and
fp16 bytes, random bytes, odd and tiny sizes, chunk boundaries anywhere in a tensor), bf16 weights shrink to the
ratio the issue asks, the torch encoder writes the same bytes on any device, and the Triton decoder (run by Triton's
CPU interpreter) gives the reference's bytes for many chunks in one launch without writing outside them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from chunkflow.runtime.codecs.exponent_pack import GROUP, decode, encode, encoded_size, sections


def _bytes(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(-1).view(torch.uint8).clone()


def _roundtrip(data: torch.Tensor):
    enc = encode(data)
    out = torch.full((data.numel(),), 0xAB, dtype=torch.uint8)
    decode(enc, out)
    assert torch.equal(out, data)
    assert enc.stored <= max(data.numel(), 0) or enc.raw  # never larger than the chunk
    return enc


def _all_patterns() -> torch.Tensor:
    w = torch.arange(65536, dtype=torch.int32)
    return _bytes(torch.where(w >= 32768, w - 65536, w).to(torch.int16))


@pytest.mark.parametrize("kind,most", [("normal", 0.71), ("uniform", 0.70), ("laplace", 0.73)])
def test_bf16_weights_round_trip_and_shrink_by_more_than_a_quarter(kind, most):
    g = torch.Generator().manual_seed(1)
    n = 3 * GROUP * 64 + 17
    values = {"normal": lambda: torch.randn(n, generator=g) * 0.02,
              "uniform": lambda: (torch.rand(n, generator=g) * 2 - 1) / 64,
              "laplace": lambda: torch.distributions.Laplace(0.0, 0.02).sample((n,))}[kind]()
    enc = _roundtrip(_bytes(values.to(torch.bfloat16)))
    assert not enc.raw and enc.k in (2, 3)
    assert enc.stored / enc.nbytes < most


def test_every_16_bit_pattern_round_trips():
    _roundtrip(_all_patterns())


def test_nan_inf_and_subnormals_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(50_000, generator=g) * 0.02
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -1e-40, 3e38])
    v[torch.randint(0, v.numel(), (5_000,), generator=g)] = special[torch.randint(0, 8, (5_000,), generator=g)]
    data = _bytes(v.to(torch.bfloat16))
    nan = _bytes(torch.tensor([0x7FC1, -1, 0x7F81, -0x7F], dtype=torch.int16))  # NaN payloads kept as they are
    _roundtrip(torch.cat([data, nan]))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 31, 32, 33, 2 * GROUP - 1, 2 * GROUP, 2 * GROUP + 1, 6 * GROUP + 5])
def test_odd_and_tiny_sizes_round_trip(n):
    g = torch.Generator().manual_seed(n)
    data = _bytes((torch.randn(n // 2 + 1, generator=g) * 0.02).to(torch.bfloat16))[:n].clone()
    _roundtrip(data)


def test_one_exponent_only_and_constant_chunks():
    enc = _roundtrip(_bytes(torch.full((20_000,), 0.75, dtype=torch.bfloat16)))
    assert enc.k == 1 and enc.n_escapes == 0
    _roundtrip(torch.zeros(10_001, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_float_bytes_round_trip_and_never_grow(dtype):
    """fp32 (a block's norms) and fp16 words are read as 16-bit words too: exact, and kept raw where they would not
    shrink."""
    g = torch.Generator().manual_seed(3)
    data = _bytes((torch.randn(30_000, generator=g) * 0.02).to(dtype))
    enc = _roundtrip(data)
    assert enc.stored <= data.numel()


def test_random_bytes_are_kept_raw():
    data = torch.randint(0, 256, (100_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    enc = _roundtrip(data)
    assert enc.raw and enc.stored == data.numel()


def test_chunk_boundaries_anywhere_in_a_tensor_round_trip():
    """A block's chunks split tensors wherever the chunk size falls (even bytes in a layout, any byte here)."""
    g = torch.Generator().manual_seed(5)
    tensor = _bytes((torch.randn(40_000, generator=g) * 0.05).to(torch.bfloat16))
    for cut in (1, 2, 4095, 4096, 17_777, 40_001):
        for a, b in ((0, cut), (cut, tensor.numel())):
            _roundtrip(tensor[a:b].clone())


def test_views_at_odd_bytes_encode_and_decode_in_place():
    """Chunks are views of a block's bytes: one starting at an odd byte (an odd chunk size) is read, and one decoded
    to an odd byte written, without a 16-bit view of it, to the same bytes as an aligned copy."""
    g = torch.Generator().manual_seed(9)
    block = _bytes((torch.randn(3 * GROUP + 5, generator=g) * 0.02).to(torch.bfloat16))
    for a, b in ((1, 4001), (3, 2 * GROUP + 2), (1, block.numel())):
        view = block[a:b]
        assert view.storage_offset() % 2
        enc = encode(view)
        assert torch.equal(enc.data, encode(view.clone()).data)  # (words across two values: most stay raw)
        out = torch.full((view.numel() + 2,), 0xAB, dtype=torch.uint8)
        decode(enc, out[1 : 1 + view.numel()])
        assert torch.equal(out[1 : 1 + view.numel()], view) and out[0] == 0xAB and out[-1] == 0xAB
    aligned = block[2 : 2 * GROUP + 3]  # words on the values: coded, then decoded to an odd byte
    enc = encode(aligned)
    out = torch.full((aligned.numel() + 2,), 0xAB, dtype=torch.uint8)
    decode(enc, out[1 : 1 + aligned.numel()])
    assert enc.k > 0 and torch.equal(out[1 : 1 + aligned.numel()], aligned) and out[0] == out[-1] == 0xAB


@given(st.binary(min_size=0, max_size=5000), st.integers(0, 255))
@settings(max_examples=60, deadline=None)
def test_any_bytes_round_trip(blob, exponent):
    """Arbitrary bytes, and the same bytes with every word's exponent forced to one value (a skewed count)."""
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
    _roundtrip(data.clone())
    if data.numel() >= 2:
        w = data[: data.numel() // 2 * 2].view(torch.int16).to(torch.int32) & 0xFFFF
        w = (w & ~(0xFF << 7)) | (exponent << 7)
        _roundtrip(torch.where(w >= 32768, w - 65536, w).to(torch.int16).view(torch.uint8).clone())


def test_the_layout_matches_the_format():
    enc = encode(_bytes((torch.randn(3 * GROUP + 7) * 0.02).to(torch.bfloat16)))
    lay = sections(enc.nbytes, enc.k, enc.n_escapes)
    assert enc.stored == lay.size == encoded_size(enc.nbytes, enc.k, enc.n_escapes)
    assert all(x % 16 == 0 for x in (lay.sm, lay.planes, lay.starts, lay.escapes))
    starts = enc.data[lay.starts : lay.starts + 4 * (enc.groups + 1)].view(torch.int32)
    assert starts[0] == 0 and starts[-1] == enc.n_escapes and bool((starts[1:] >= starts[:-1]).all())
    assert lay.planes - lay.sm >= enc.words and lay.starts - lay.planes == enc.groups * enc.k * GROUP // 8


def test_the_encoder_is_deterministic_and_device_independent_in_its_table():
    """Ties in the exponent counts are broken by value: the same bytes encode to the same bytes every time."""
    data = _bytes(torch.tensor([0.5, 1.0, 2.0, 4.0] * 5000, dtype=torch.bfloat16))
    a, b = encode(data), encode(data.clone())
    assert torch.equal(a.data, b.data)


def test_the_triton_decoder_gives_the_reference_bytes_in_the_interpreter():
    """The GPU decoder (runtime/codecs/exponent_pack_gpu.py), run by Triton's CPU interpreter: several chunks in
    one launch (coded with different K, raw, an odd byte, one of several groups), each placed where its row says,
    nothing written between or after them."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from chunkflow.runtime.codecs.exponent_pack import GROUP, encode
        from chunkflow.runtime.codecs.exponent_pack_gpu import Chunk, Decode, decode_into
        g = torch.Generator().manual_seed(7)
        b = lambda v: v.contiguous().view(-1).view(torch.uint8).clone()
        parts = [b((torch.randn(3 * GROUP + 11, generator=g) * 0.02).to(torch.bfloat16)),
                 torch.randint(0, 256, (777,), dtype=torch.uint8, generator=g),
                 b((torch.randn(2 * GROUP, generator=g)).to(torch.bfloat16))[:4 * GROUP - 1].clone(),
                 b(torch.full((3000,), 0.75, dtype=torch.bfloat16)),
                 b((torch.randn(500, generator=g) * 0.02).to(torch.float32))]
        encs = [encode(x) for x in parts]
        assert {e.k for e in encs} >= {0, 1, 3}, [e.k for e in encs]
        src = torch.zeros(sum(-(-e.stored // 16) * 16 for e in encs), dtype=torch.uint8)
        chunks, so, do = [], 0, 0
        for e in encs:
            src[so:so + e.stored] = e.data
            chunks.append(Chunk(so, do, e.nbytes, e.k, e.n_escapes))
            so += -(-e.stored // 16) * 16
            do += e.nbytes + (e.nbytes & 1) + 2
        out = torch.full((do + 8,), 0xAB, dtype=torch.uint8)
        Decode(chunks, torch.device("cpu")).run(src, out)
        pos = 0
        for x, e in zip(parts, encs):
            assert torch.equal(out[pos:pos + e.nbytes], x), (e.k, e.nbytes)
            assert bool((out[pos + e.nbytes:pos + e.nbytes + (e.nbytes & 1) + 2] == 0xAB).all()), "wrote outside"
            pos += e.nbytes + (e.nbytes & 1) + 2
        one = torch.zeros(parts[0].numel(), dtype=torch.uint8)
        decode_into(encs[0].data, encs[0].nbytes, encs[0].k, encs[0].n_escapes, one)
        assert torch.equal(one, parts[0])
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_odd_chunk_sizes_through_the_streams_gpu_path_in_the_interpreter():
    """issue 51: a block's tail in chunks of an odd size, encoded by the codec stream (every other chunk keeps its
    odd first byte as it is) and decoded as the GPU path does it (each decode group's bytes staged, one Triton
    launch, the odd first bytes copied after), in Triton's CPU interpreter: the block's exact bytes, nothing
    written past them; chunks large enough to shrink shrink as much as even ones."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from types import SimpleNamespace
        from chunkflow.runtime.codecs import CODECS
        from chunkflow.runtime.codecs.stream import CodecStream
        g = torch.Generator().manual_seed(0)
        for C in (1001, 65_537):
            V = 300_007
            R = (V // 3) // C * C
            A = R - R % 16
            b = SimpleNamespace(name="b", nbytes=V, resident_bytes=R, slot_start=A,
                                chunks=[(a, min(a + C, V)) for a in range(R, V, C)])
            vals = (torch.randn(V // 2 + 1, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)[:V].clone()
            cs = CodecStream(CODECS["exponent-pack"])
            cs.device = torch.device("cpu")
            blk, pieces = cs.encode(b, vals[R:])
            buf = torch.zeros(blk.nbytes, dtype=torch.uint8)
            for at, d in pieces:
                buf[at:at + d.numel()] = d
            slot = torch.full((V - A + 8,), 0xAB, dtype=torch.uint8)
            groups = {id(x): x for x in cs._groups_of(blk).values()}.values()
            assert any(x.heads is not None for x in groups)
            for x in groups:
                stage = buf[x.start:x.start + x.nbytes].clone()
                x.decode.run(stage, slot)
                slot.index_copy_(0, x.heads[1], stage.index_select(0, x.heads[0]))
            assert torch.equal(slot[R - A:V - A], vals[R:]) and bool((slot[V - A:] == 0xAB).all()), C
            assert C < 4096 or blk.stored_bytes < 0.72 * blk.raw_bytes, blk.stored_bytes / blk.raw_bytes
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_the_encoder_works_in_slices_and_writes_the_same_bytes(monkeypatch):
    """The encoder holds intermediates for SLICE_WORDS words at a time (its transient memory's bound at a load):
    slices of two groups write the bytes of one pass, and decode exactly."""
    import chunkflow.runtime.codecs.exponent_pack as ep

    torch.manual_seed(9)
    data = _bytes((torch.distributions.Laplace(0.0, 0.02).sample((5 * GROUP + 333,))).to(torch.bfloat16))
    whole = encode(data)
    monkeypatch.setattr(ep, "SLICE_WORDS", 2 * GROUP)
    sliced = ep.encode(data)
    assert torch.equal(sliced.data, whole.data) and sliced.n_escapes == whole.n_escapes > 0
    _roundtrip(data)
