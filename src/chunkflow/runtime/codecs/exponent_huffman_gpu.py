"""The exponent-Huffman format (exponent_huffman.py) decoded on a device by a Triton kernel: one program a group of
GROUP_SEGMENTS segments, one lane a segment. Each lane counts the codes that start in its segment (pass 1), the
group's prefix sum of the counts plus the group's first word gives each lane its first word, and each lane decodes
its codes again, writing every word's two bytes (pass 2). Each code is one lookup in the chunk's decode table
(2**MAX_CODE_BITS symbols and lengths). Runs on a CUDA device, and in Triton's CPU interpreter
(TRITON_INTERPRET=1) where the tests check it against the CPU reference.
"""

from __future__ import annotations

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
    def _window(stream, pos, active, CODE_BITS: tl.constexpr):
        """The CODE_BITS bits of the stream from bit `pos` of each active lane (MSB first)."""
        byte = pos >> 3
        b0 = tl.load(stream + byte, mask=active, other=0).to(tl.int32)
        b1 = tl.load(stream + byte + 1, mask=active, other=0).to(tl.int32)
        b2 = tl.load(stream + byte + 2, mask=active, other=0).to(tl.int32)
        w = (b0 << 16) | (b1 << 8) | b2
        return (w >> (24 - CODE_BITS - (pos & 7))) & ((1 << CODE_BITS) - 1)

    @triton.jit
    def _decode_kernel(stream, gaps, groups, sm, sym_table, len_table, out, segments, bits, max_codes,
                       SEG: tl.constexpr, GROUP: tl.constexpr, CODE_BITS: tl.constexpr):
        pid = tl.program_id(0)
        lane = pid * GROUP + tl.arange(0, GROUP)
        valid = lane < segments
        packed = tl.load(gaps + (lane >> 1), mask=valid, other=0).to(tl.int32)
        gap = (packed >> ((lane & 1) * 4)) & 0xF
        start = lane * SEG + gap
        end = tl.minimum((lane + 1) * SEG, bits)
        pos = start
        count = tl.zeros([GROUP], dtype=tl.int32)
        for _ in range(max_codes):  # pass 1: the codes that start in each lane's segment
            active = valid & (pos < end)
            n = tl.load(len_table + _window(stream, pos, active, CODE_BITS), mask=active, other=0).to(tl.int32)
            pos += n
            count += active.to(tl.int32)
        first = tl.load(groups + pid) + tl.cumsum(count, axis=0) - count
        pos = start
        idx = first
        for _ in range(max_codes):  # pass 2: each code's word, its two bytes
            active = valid & (pos < end)
            window = _window(stream, pos, active, CODE_BITS)
            n = tl.load(len_table + window, mask=active, other=0).to(tl.int32)
            e = tl.load(sym_table + window, mask=active, other=0).to(tl.int32)
            s = tl.load(sm + idx, mask=active, other=0).to(tl.int32)
            tl.store(out + 2 * idx, (((e & 1) << 7) | (s & 0x7F)).to(tl.uint8), mask=active)
            tl.store(out + 2 * idx + 1, ((s & 0x80) | (e >> 1)).to(tl.uint8), mask=active)
            pos += n
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
    guard = torch.cuda.device(data.device) if data.device.type == "cuda" else _nothing()
    with guard:
        kernel[grid](data[enc.stream_at:], data[enc.gaps_at:], groups, data[enc.sm_at:], sym, ln, out,
                     enc.segments, enc.bits, max_codes(enc), SEG=SEGMENT_BITS, GROUP=GROUP_SEGMENTS,
                     CODE_BITS=MAX_CODE_BITS, num_warps=NUM_WARPS)
    if enc.nbytes % 2:
        out[enc.nbytes - 1:].copy_(data[enc.tail_at:])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
