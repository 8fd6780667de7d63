"""The exponent-pack format (exponent_pack.py) decoded on a device by a Triton kernel: one program a group of GROUP
words, each word on its own: its sign-mantissa byte, its K index bits from the group's planes, its exponent from the
chunk's table or, for an escape, from the group's escapes (its rank among the group's escapes is a prefix sum).
One read of each encoded byte and one write of each decoded one, so it runs near the device's memory rate. Runs on a
CUDA device, and in Triton's CPU interpreter (TRITON_INTERPRET=1) where the tests check it against the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from chunkflow.runtime.codecs.exponent_pack import GROUP, sections


try:  # the kernel is built where Triton is installed; without it nothing here runs
    import triton
    import triton.language as tl
except Exception:  # not installed, or broken
    triton = None


def available() -> bool:
    """Whether the Triton decoder can be built here."""
    return triton is not None


DESC = 9  # int64 columns of a chunk's row in a decode table: its groups, words, K, where its encoded bytes start
# in the source buffer, where its decoded bytes go in the output, then its sections (sm, planes, starts, escapes)
# relative to its start


CONFIGS = ((2, 0, 4), (1, 0, 4), (2, 1, 4), (1, 1, 4), (1, 1, 8))  # (groups a program, escape ranks by popcount,
# warps): the decode's launch shapes; `Decode.tune` times them on the device and keeps the fastest (on one H200, 336 MB
# of output, 2026-12-03: 280-430 GB/s among such shapes, docs/data/h200-codec/kernels-3.json)


if triton is not None:
    @triton.jit
    def _popc(x):
        """Set bits of each int32 (SWAR)."""
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24) & 0xFF

    @triton.jit
    def _decode_kernel(data, out, desc, G: tl.constexpr, D: tl.constexpr, GPP: tl.constexpr, POPC: tl.constexpr):
        row = desc + tl.program_id(1).to(tl.int64) * D  # the chunk
        words = tl.load(row + 1).to(tl.int32)  # int32 math within a chunk (its words fit), 64-bit for base pointers
        K = tl.load(row + 2).to(tl.int32)
        src = data + tl.load(row + 3)
        dst = (out + tl.load(row + 4)).to(tl.pointer_type(tl.int16))
        j = tl.arange(0, G)
        for q in tl.static_range(GPP):  # GPP groups of the chunk (programs past its last group do nothing)
            g = tl.program_id(0) * GPP + q
            i = g * G + j
            valid = i < words
            if K == 0:  # kept raw: the words as they are
                lo = tl.load(src + 2 * i, mask=valid, other=0).to(tl.int32)
                hi = tl.load(src + 2 * i + 1, mask=valid, other=0).to(tl.int32)
                word = lo | (hi << 8)
            else:
                s = tl.load(src + tl.load(row + 5) + i, mask=valid, other=0).to(tl.int32)
                plane = (src + tl.load(row + 6) + (g * K * (G // 8)).to(tl.int64)).to(tl.pointer_type(tl.int32))
                idx = tl.zeros([G], dtype=tl.int32)
                every = tl.full([G], -1, dtype=tl.int32)  # each word's 32-bit plane words ANDed: its escapes' mask
                for p in range(K):
                    w = tl.load(plane + p * (G // 32) + (j >> 5), mask=valid, other=0)
                    idx |= ((w >> (j & 31)) & 1) << p
                    every &= w
                escape = (1 << K) - 1
                esc = idx == escape
                e_tab = tl.load(src + idx, mask=valid & (idx < escape), other=0).to(tl.int32)
                if POPC:  # rank among the group's escapes: those of the words of 32 before, then those before it
                    r = tl.arange(0, G // 32)
                    m = tl.full([G // 32], -1, dtype=tl.int32)
                    for p in range(K):
                        m &= tl.load(plane + p * (G // 32) + r, mask=g * G + r * 32 < words, other=0)
                    c = _popc(m)
                    before = tl.reshape(tl.broadcast_to((tl.cumsum(c, axis=0) - c)[:, None], [G // 32, 32]), [G])
                    rank = before + _popc(every & ~(-1 << (j & 31)))
                else:
                    esc_i = esc.to(tl.int32)
                    rank = tl.cumsum(esc_i, axis=0) - esc_i
                first = tl.load((src + tl.load(row + 7)).to(tl.pointer_type(tl.int32)) + g, mask=g * G < words,
                                other=0)
                e_esc = tl.load(src + tl.load(row + 8) + first + rank, mask=valid & esc, other=0).to(tl.int32)
                e = tl.where(esc, e_esc, e_tab)
                word = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
            tl.store(dst + i, word.to(tl.int16), mask=valid)


class Chunk(NamedTuple):
    """One encoded chunk of a decode: its bytes at `src` of the source buffer, decoded to `dst` of the output."""

    src: int  # a multiple of 16
    dst: int  # even
    nbytes: int
    k: int
    n_escapes: int


class Decode:
    """Chunks decoded together by one launch (a block's, once its encoded bytes are on the device): the decode table
    is built once, on `device`; `run(source, out)` launches on the current stream."""

    def __init__(self, chunks: list[Chunk], device: torch.device):
        rows, most = [], 0
        self.odd: list[tuple[int, int]] = []  # (source byte, output byte) of each chunk's odd last byte
        for c in chunks:
            if c.src % 16 or c.dst % 2:
                raise ValueError(f"a chunk's encoded bytes start at a multiple of 16 and its output at an even byte "
                                 f"(got {c.src}, {c.dst})")
            words = c.nbytes // 2
            lay = sections(c.nbytes, c.k, c.n_escapes)
            if words:
                groups = -(-words // GROUP)
                rows.append([groups, words, c.k, c.src, c.dst, lay.sm, lay.planes, lay.starts, lay.escapes])
                most = max(most, groups)
            if c.nbytes & 1:
                self.odd.append((c.src + (lay.tail if c.k else c.nbytes - 1), c.dst + c.nbytes - 1))
        self.grid = (most, len(rows))  # a program a group of a chunk: chunks of one size waste none
        self.table = torch.tensor(rows or [[0] * DESC], dtype=torch.int64, device=device)

    def run(self, source: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int] = CONFIGS[0]) -> None:
        """Decode into `out` (flat uint8) from `source` (flat uint8), both on the table's device, with a launch shape
        of CONFIGS (all give the same bytes)."""
        if self.grid[1]:
            per, popc, warps = config
            _decode_kernel[(-(-self.grid[0] // per), self.grid[1])](source, out, self.table, G=GROUP, D=DESC,
                                                                     GPP=per, POPC=popc, num_warps=warps)
        for s, d in self.odd:
            out[d : d + 1].copy_(source[s : s + 1], non_blocking=True)


    def tune(self, source: torch.Tensor, out: torch.Tensor, repeat: int = 5) -> tuple[int, int, int]:
        """The fastest of CONFIGS for this decode on this CUDA device (each timed `repeat` times with CUDA events
        after a first run that compiles it): what a tier keeps for all its decodes. Synchronizes the device."""
        best, best_t = CONFIGS[0], float("inf")
        for config in CONFIGS:
            self.run(source, out, config)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                self.run(source, out, config)
            end.record()
            end.synchronize()
            t = start.elapsed_time(end)
            if t < best_t:
                best, best_t = config, t
        return best


def decode_into(data: torch.Tensor, nbytes: int, k: int, n_escapes: int, out: torch.Tensor,
                config: tuple[int, int, int] = CONFIGS[0]) -> None:
    """Decode one chunk's encoded bytes `data` (flat uint8 on the device, 16-byte aligned) into `out` (flat uint8,
    `nbytes`, on the same device, 2-byte aligned), on the current stream."""
    Decode([Chunk(0, 0, nbytes, k, n_escapes)], data.device).run(data, out, config)
