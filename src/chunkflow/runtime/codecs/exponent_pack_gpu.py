"""The exponent-pack format (exponent_pack.py) decoded on a device by a Triton kernel: one program a group of GROUP
words, each word on its own: its sign-mantissa byte, its K index bits from the group's planes, its exponent from the
chunk's table or, for an escape, from the group's escapes (its rank among the group's escapes is a prefix sum).
One read of each encoded byte and one write of each decoded one, so it runs near the device's memory rate. Runs on a
CUDA device, and in Triton's CPU interpreter (TRITON_INTERPRET=1) where the tests check it against the reference.
"""

from __future__ import annotations

import torch

from chunkflow.runtime.codecs.exponent_pack import GROUP, sections

NUM_WARPS = 8

try:  # the kernel is built where Triton is installed; without it nothing here runs
    import triton
    import triton.language as tl
except Exception:  # not installed, or broken
    triton = None


def available() -> bool:
    """Whether the Triton decoder can be built here."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _decode_kernel(data, out, words, sm_at, planes_at, starts_at, escapes_at,
                       K: tl.constexpr, G: tl.constexpr):
        g = tl.program_id(0)
        j = tl.arange(0, G)
        i = g.to(tl.int64) * G + j
        valid = i < words
        s = tl.load(data + sm_at + i, mask=valid, other=0).to(tl.int32)
        idx = tl.zeros([G], dtype=tl.int32)
        plane = data + planes_at + g.to(tl.int64) * (K * G // 8)
        for p in tl.static_range(K):
            w = tl.load((plane + p * (G // 8)).to(tl.pointer_type(tl.int32)) + (j >> 5))
            idx |= ((w >> (j & 31)) & 1) << p
        esc = idx == (1 << K) - 1
        e_tab = tl.load(data + idx, mask=valid & (idx < (1 << K) - 1), other=0).to(tl.int32)
        esc_i = esc.to(tl.int32)
        rank = tl.cumsum(esc_i, axis=0) - esc_i
        first = tl.load((data + starts_at).to(tl.pointer_type(tl.int32)) + g)
        e_esc = tl.load(data + escapes_at + first + rank, mask=valid & esc, other=0).to(tl.int32)
        e = tl.where(esc, e_esc, e_tab)
        word = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
        tl.store(out + i, word.to(tl.int16), mask=valid)


def decode_into(data: torch.Tensor, nbytes: int, k: int, n_escapes: int, out: torch.Tensor) -> None:
    """Decode one chunk's encoded bytes `data` (flat uint8 on the device) into `out` (flat uint8, `nbytes`, on the
    same device, 2-byte aligned), on the current stream."""
    if k == 0:
        out.copy_(data[:nbytes], non_blocking=True)
        return
    lay = sections(nbytes, k, n_escapes)
    words = nbytes // 2
    groups = -(-words // GROUP)
    if words:
        _decode_kernel[(groups,)](data, out[: 2 * words].view(torch.int16), words, lay.sm, lay.planes, lay.starts,
                                  lay.escapes, K=k, G=GROUP, num_warps=NUM_WARPS)
    if nbytes & 1:
        out[-1:].copy_(data[lay.tail : lay.tail + 1], non_blocking=True)
