"""The exponent-Huffman format (exponent_huffman.py) decoded on a device by a Triton kernel: one program a group of
GROUP_SEGMENTS segments, one lane a segment. Each lane counts the codes that start in its segment (pass 1), the
group's prefix sum of the counts plus the group's first word gives each lane its first word, and each lane decodes
its codes again, writing every word's two bytes (pass 2). A lane reads its segment's 64 bits and the 16 after them
once, into registers, and takes each code's window from them; each code is one lookup in the chunk's decode table
(2**MAX_CODE_BITS symbols and lengths). Runs on a CUDA device, and in Triton's CPU interpreter
(TRITON_INTERPRET=1) where the tests check it against the CPU reference.
"""

from __future__ import annotations

import contextlib

import torch

from chunkflow.runtime.codecs.exponent_huffman import (GROUP_SEGMENTS, MAX_CODE_BITS, SEGMENT_BITS, Encoded,
                                                       decode_table)

NUM_WARPS = 8


try:  # the kernel is built where Triton is installed; without it nothing here runs
    import triton
    import triton.language as tl
except Exception:  # not installed, or broken
    triton = None

if triton is not None:
    @triton.jit
    def _segment_bits(stream, lane, valid):
        """Each lane's 64 bits of the stream as an int64 (MSB first) and the 16 bits after them."""
        base = lane.to(tl.int64) * 8
        word = tl.zeros(lane.shape, dtype=tl.int64)
        for k in tl.static_range(8):
            word = (word << 8) | tl.load(stream + base + k, mask=valid, other=0).to(tl.int64)
        ext = (tl.load(stream + base + 8, mask=valid, other=0).to(tl.int64) << 8) \
            | tl.load(stream + base + 9, mask=valid, other=0).to(tl.int64)
        return word, ext

    @triton.jit
    def _window(word, ext, at, CODE_BITS: tl.constexpr):
        """CODE_BITS bits from bit `at` (0-63) of a lane's 64 bits and the 16 after them, from registers."""
        inside = at + CODE_BITS <= 64
        right = tl.where(inside, 64 - CODE_BITS - at, 0).to(tl.int64)
        left = tl.where(inside, 0, at + CODE_BITS - 64).to(tl.int64)
        w_in = word >> right
        w_out = (word << left) | (ext >> (16 - left))
        return (tl.where(inside, w_in, w_out) & ((1 << CODE_BITS) - 1)).to(tl.int32)

    @triton.jit
    def _decode_kernel(stream, gaps, groups, sm, sym_table, len_table, out, segments, bits, max_codes,
                       SEG: tl.constexpr, GROUP: tl.constexpr, CODE_BITS: tl.constexpr):
        pid = tl.program_id(0)
        lane = pid * GROUP + tl.arange(0, GROUP)
        valid = lane < segments
        packed = tl.load(gaps + (lane >> 1), mask=valid, other=0).to(tl.int32)
        gap = (packed >> ((lane & 1) * 4)) & 0xF
        end = tl.minimum(bits - lane * SEG, SEG)  # the lane's bits in which codes start
        word, ext = _segment_bits(stream, lane, valid)
        at = gap
        count = tl.zeros([GROUP], dtype=tl.int32)
        for _ in range(max_codes):  # pass 1: the codes that start in each lane's segment
            active = valid & (at < end)
            n = tl.load(len_table + _window(word, ext, at, CODE_BITS), mask=active, other=0).to(tl.int32)
            at += n
            count += active.to(tl.int32)
        first = tl.load(groups + pid) + tl.cumsum(count, axis=0) - count
        at = gap
        idx = first
        for _ in range(max_codes):  # pass 2: each code's word, its two bytes
            active = valid & (at < end)
            window = _window(word, ext, at, CODE_BITS)
            n = tl.load(len_table + window, mask=active, other=0).to(tl.int32)
            e = tl.load(sym_table + window, mask=active, other=0).to(tl.int32)
            s = tl.load(sm + idx, mask=active, other=0).to(tl.int32)
            tl.store(out + 2 * idx, (((e & 1) << 7) | (s & 0x7F)).to(tl.uint8), mask=active)
            tl.store(out + 2 * idx + 1, ((s & 0x80) | (e >> 1)).to(tl.uint8), mask=active)
            at += n
            idx += active.to(tl.int32)


def _kernel():
    """The Triton kernel, or None where Triton is not installed."""
    return _decode_kernel if triton is not None else None


def available() -> bool:
    """Whether Triton is installed (the kernel can be built)."""
    return _kernel() is not None


def tables(enc: Encoded, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's decode table (symbols, lengths) on `device`."""
    sym, ln = decode_table(enc.lengths)
    return torch.from_numpy(sym).to(device), torch.from_numpy(ln).to(device)


def max_codes(enc: Encoded) -> int:
    """The most codes that can start in one segment: its bits over the shortest code, and one more for a code
    that runs on from the segment before and ends inside it."""
    shortest = int(enc.lengths[enc.lengths > 0].min())
    return SEGMENT_BITS // shortest + 1


def decode_into(out: torch.Tensor, data: torch.Tensor, enc: Encoded,
                table: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Decode encoded chunk `data` (its bytes, uint8, on the device) into `out` (uint8, enc.nbytes, on the same
    device) on the device's current stream; `enc` holds the facts of its layout (host side), `table` its decode
    table on the device (tables(); made here where not given)."""
    if enc.raw:
        out.copy_(data[: enc.nbytes])
        return
    if table is None:
        table = tables(enc, data.device)
    sym, ln = table
    groups = data[enc.groups_at: enc.tail_at].view(torch.int32)  # little-endian uint32 word indices
    kernel = _kernel()
    grid = (-(-enc.segments // GROUP_SEGMENTS),)
    guard = torch.cuda.device(data.device) if data.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernel[grid](data[enc.stream_at:], data[enc.gaps_at:], groups, data[enc.sm_at:], sym, ln, out,
                     enc.segments, enc.bits, max_codes(enc), SEG=SEGMENT_BITS, GROUP=GROUP_SEGMENTS,
                     CODE_BITS=MAX_CODE_BITS, num_warps=NUM_WARPS)
    if enc.nbytes % 2:
        out[enc.nbytes - 1:].copy_(data[enc.tail_at:])


def encode_on(chunk: torch.Tensor) -> Encoded:
    """The chunk's bytes (uint8, on any device) encoded where they are, byte for byte as the CPU reference encodes
    them (exponent_huffman.encode): what a load runs on the GPU (the reference takes about a second a 16 MB chunk).
    Only the 256 code lengths are worked out on the host."""
    from chunkflow.runtime.codecs.exponent_huffman import canonical_codes, code_lengths, sections

    chunk = chunk.reshape(-1)
    n = chunk.numel()
    if n < 2:
        return Encoded(chunk.cpu().numpy().copy(), n, True)
    w = chunk[: n - n % 2].view(torch.int16).to(torch.int32) & 0xFFFF
    exps = (w >> 7) & 0xFF
    sm = (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)
    lengths = code_lengths(torch.bincount(exps, minlength=256).cpu().numpy())
    dev = chunk.device
    ln = torch.from_numpy(lengths.astype("int64")).to(dev)[exps]
    ends = torch.cumsum(ln, 0)
    starts = ends - ln
    bits = int(ends[-1])
    words = exps.numel()
    segments, padded, align, size = sections(n, words, bits, int(starts[-1]))
    if size >= n:
        return Encoded(chunk.cpu().numpy().copy(), n, True)
    codes = torch.from_numpy(canonical_codes(lengths).astype("int64")).to(dev)[exps]
    stream_bits = torch.zeros(padded, dtype=torch.uint8, device=dev)
    for k in range(int(lengths.max())):  # bit k of each code, for the codes that long
        has = ln > k
        stream_bits[starts[has] + k] = ((codes[has] >> (ln[has] - 1 - k)) & 1).to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=dev)
    stream = (stream_bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)
    seg_start = torch.arange(segments, dtype=torch.int64, device=dev) * SEGMENT_BITS
    first = torch.searchsorted(starts, seg_start)
    gaps = (starts[torch.clamp(first, max=words - 1)] - seg_start).to(torch.uint8)
    packed = torch.zeros((segments + 1) // 2, dtype=torch.uint8, device=dev)
    packed[:] = gaps[0::2]
    packed[: segments // 2] |= gaps[1::2] << 4
    starts_of_groups = first[::GROUP_SEGMENTS]
    groups = torch.empty(starts_of_groups.numel(), dtype=torch.int32, device=dev)  # dense, whatever its size
    groups.copy_(starts_of_groups)
    groups = groups.view(torch.uint8)
    parts = [sm, stream, packed, torch.zeros(align, dtype=torch.uint8, device=dev), groups, chunk[n - n % 2:]]
    at = [0]
    for p in parts:
        at.append(at[-1] + p.numel())
    data = torch.cat(parts).cpu().numpy()
    return Encoded(data, n, False, lengths, bits, segments, at[0], at[1], at[2], at[4], at[5])
