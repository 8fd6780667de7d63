"""A lossless codec for streamed weights, made to decode at the GPU's memory rate: each 16-bit word's 8 exponent bits
as a K-bit index into the chunk's table of its 2**K - 1 most frequent exponents (the last index: an escape, the
exponent kept whole in a byte list), its sign and 7 mantissa bits kept raw. This module is the format, its encoder
(torch: the same bytes on any device) and its reference decoder (torch, exact); exponent_pack_gpu.py decodes the same
bytes with a Triton kernel.

Why: bf16 weights carry about 2.5-3 bits of information in their 8 exponent bits and almost 8 in their sign and
mantissa; with K = 3 a word takes 8 + 3 bits plus 8 for each escaped exponent, so a chunk shrinks to about 0.69-0.71
of itself (random normal, uniform or Laplace values: docs/notes/codec-research/; 0.74 on trained CNN/OCR weights,
0.71 on their 2-D matrices: docs/data/codec-trained/); fewer bytes on a saturated
host-to-device link are a shorter step, bit for bit. A Huffman code gets nearer the entropy (0.66-0.68) but decodes
serially within a segment; every word here decodes on its own, so the decoder is one pass at the memory rate.

The format of one encoded chunk (`Encoded`: its bytes and the three numbers that place its sections):
- the chunk's bytes are read as little-endian 16-bit words w (an odd trailing byte is kept raw); a word's exponent
  is e = (w >> 7) & 0xFF and its sign-mantissa byte s = ((w >> 8) & 0x80) | (w & 0x7F): any 16 bits round-trip
  (NaN, Inf, subnormals, the low halves of float32 values, padding), only the ratio depends on what they hold;
- words are taken in groups of GROUP (one GPU program's share); a word's index i in [0, 2**K - 1) names table[i],
  index 2**K - 1 an escape, whose exponent is the next byte of its group's escapes;
- sections, each starting at a multiple of 16 bytes: the table (16 bytes, unused entries 0), the sign-mantissa bytes
  (one a word), the index planes (for each group and each bit p < K, GROUP bits as GROUP/32 little-endian uint32:
  bit j of word q is bit p of the index of the group's word 32q + j), each group's first escape (uint32, one more
  than the groups: the total), the escaped exponents (one byte each, in word order), the odd byte.
K is chosen per chunk (1 to 4) for the fewest bytes; a chunk that would not shrink is kept raw (`Encoded.raw`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 2048  # words a GPU program decodes; a multiple of 32
ALIGN = 16  # every section starts at a multiple of this
MAX_K = 4
SLICE_WORDS = GROUP * 2048  # words the encoder works on at once (8 MiB of a chunk): its transient memory's bound
NAME = "exponent-pack"
VERSION = 1

__all__ = ["Encoded", "encode", "decode", "encoded_size", "sections", "GROUP", "NAME", "VERSION"]


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Sections:
    """Where each section of an encoded chunk starts (bytes), and its total size."""

    table: int
    sm: int
    planes: int
    starts: int
    escapes: int
    tail: int
    size: int


def sections(nbytes: int, k: int, n_escapes: int) -> Sections:
    """The layout of a chunk of `nbytes` encoded with K = k and `n_escapes` escaped exponents."""
    words = nbytes // 2
    groups = -(-words // GROUP)
    sm = _up(16)
    planes = _up(sm + words)
    starts = _up(planes + groups * k * (GROUP // 8))
    escapes = _up(starts + 4 * (groups + 1))
    tail = escapes + n_escapes
    return Sections(0, sm, planes, starts, escapes, tail, tail + (nbytes & 1))


def encoded_size(nbytes: int, k: int, n_escapes: int) -> int:
    return sections(nbytes, k, n_escapes).size


@dataclass(frozen=True)
class Encoded:
    """One chunk encoded: `data` (uint8, on the device it was encoded on) to store and copy, and how to read it."""

    data: torch.Tensor
    nbytes: int  # the chunk's bytes, decoded
    k: int  # index bits a word (0: kept raw)
    n_escapes: int

    @property
    def raw(self) -> bool:
        return self.k == 0

    @property
    def words(self) -> int:
        return self.nbytes // 2

    @property
    def groups(self) -> int:
        return -(-self.words // GROUP)

    @property
    def stored(self) -> int:
        return int(self.data.numel())

    def layout(self) -> Sections:
        return sections(self.nbytes, self.k, self.n_escapes)


def _fields(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent, sign-mantissa) of each 16-bit word of a flat uint8 chunk, as int32; the chunk may start at any byte
    (an odd one is read byte by byte: a 16-bit view needs an even one)."""
    n = chunk.numel() // 2
    if chunk.storage_offset() % 2:
        b = chunk[: 2 * n].to(torch.int32)
        w = b[0::2] | (b[1::2] << 8)
    else:
        w = chunk[: 2 * n].view(torch.int16).to(torch.int32) & 0xFFFF
    return (w >> 7) & 0xFF, ((w >> 8) & 0x80) | (w & 0x7F)


def _choose(counts: torch.Tensor, words: int, nbytes: int) -> tuple[int, torch.Tensor, int]:
    """(K, the table's exponents by frequency, escapes) giving the fewest bytes; K = 0 where nothing shrinks."""
    # most frequent first, ties by exponent value (the same table on every device)
    order = torch.argsort(counts.to(torch.int64) * 256 + (255 - torch.arange(256, device=counts.device)),
                          descending=True)
    ranked = counts[order].cpu()
    cum = torch.cumsum(ranked.to(torch.int64), 0)
    best, best_k, best_esc = nbytes, 0, 0
    for k in range(1, MAX_K + 1):
        esc = words - int(cum[(1 << k) - 2])
        size = encoded_size(nbytes, k, esc)
        if size < best:
            best, best_k, best_esc = size, k, esc
    return best_k, order[: (1 << best_k) - 1] if best_k else order[:0], best_esc


def encode(chunk: torch.Tensor) -> Encoded:
    """Encode a flat uint8 chunk (any device; the result is on the same device). Works SLICE_WORDS words at a time,
    so that its transient memory stays under about 40 bytes a word of a slice whatever the chunk's size."""
    if chunk.dtype != torch.uint8 or chunk.dim() != 1:
        raise ValueError("encode takes a flat uint8 tensor")
    nbytes = chunk.numel()
    words = nbytes // 2
    dev = chunk.device
    if words == 0:
        return Encoded(chunk.clone(), nbytes, 0, 0)
    slices = [(a, min(a + SLICE_WORDS, words)) for a in range(0, words, SLICE_WORDS)]  # whole groups each
    counts = torch.zeros(256, dtype=torch.int64, device=dev)
    for a, b in slices:
        counts += torch.bincount(_fields(chunk[2 * a : 2 * b])[0], minlength=256)
    k, table, n_esc = _choose(counts, words, nbytes)
    if k == 0:
        return Encoded(chunk.clone(), nbytes, 0, 0)
    lay = sections(nbytes, k, n_esc)
    groups = -(-words // GROUP)
    out = torch.zeros(lay.size, dtype=torch.uint8, device=dev)
    out[: table.numel()] = table.to(torch.uint8)
    planes = out[lay.planes : lay.planes + groups * k * GROUP // 8].view(torch.int32).view(groups, k, GROUP // 32)
    escape = (1 << k) - 1
    lut = torch.full((256,), escape, dtype=torch.int32, device=dev)
    lut[table] = torch.arange(table.numel(), dtype=torch.int32, device=dev)
    shifts = torch.arange(32, device=dev)
    per_group, done = [], 0
    for a, b in slices:
        e, sm = _fields(chunk[2 * a : 2 * b])
        out[lay.sm + a : lay.sm + b] = sm.to(torch.uint8)
        g0, ng = a // GROUP, -(-(b - a) // GROUP)
        idx = torch.zeros(ng * GROUP, dtype=torch.int32, device=dev)
        idx[: b - a] = lut[e]
        for p in range(k):
            bit = ((idx >> p) & 1).view(ng, GROUP // 32, 32).to(torch.int64)
            packed = (bit << shifts).sum(-1)  # in [0, 2**32): the plane's words, as uint32
            planes[g0 : g0 + ng, p] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        is_esc = idx == escape
        is_esc[b - a :] = False
        per_group.append(is_esc.view(ng, GROUP).sum(1))
        escaped = e[is_esc[: b - a]].to(torch.uint8)
        out[lay.escapes + done : lay.escapes + done + escaped.numel()] = escaped
        done += escaped.numel()
    starts = torch.zeros(groups + 1, dtype=torch.int64, device=dev)
    starts[1:] = torch.cumsum(torch.cat(per_group), 0)
    out[lay.starts : lay.starts + 4 * (groups + 1)] = starts.to(torch.int32).view(torch.uint8)
    if nbytes & 1:
        out[lay.tail] = chunk[-1]
    return Encoded(out, nbytes, k, n_esc)


def decode(enc: Encoded | torch.Tensor, out: torch.Tensor, *, nbytes: int | None = None, k: int | None = None,
           n_escapes: int | None = None) -> torch.Tensor:
    """The reference decoder: write the chunk's bytes into `out` (flat uint8, its device; `enc` on the same device)
    and return it. Takes an Encoded, or its data and the three numbers."""
    if isinstance(enc, Encoded):
        data, nbytes, k, n_escapes = enc.data, enc.nbytes, enc.k, enc.n_escapes
    else:
        data = enc
    assert nbytes is not None and k is not None and n_escapes is not None
    if out.numel() != nbytes:
        raise ValueError(f"decode: out holds {out.numel()} bytes, the chunk {nbytes}")
    if k == 0:
        out.copy_(data[:nbytes])
        return out
    lay = sections(nbytes, k, n_escapes)
    words = nbytes // 2
    groups = -(-words // GROUP)
    dev = data.device
    table = data[: (1 << k) - 1].to(torch.int32)
    s = data[lay.sm : lay.sm + words].to(torch.int32)
    planes = data[lay.planes : lay.planes + groups * k * GROUP // 8].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    planes = planes.view(groups, k, GROUP // 32, 1)
    bits = (planes >> torch.arange(32, device=dev)) & 1  # (groups, k, GROUP/32, 32)
    idx = (bits << torch.arange(k, device=dev).view(1, k, 1, 1)).sum(1).view(-1)[:words]
    escape = (1 << k) - 1
    is_esc = idx == escape
    e = torch.zeros(words, dtype=torch.int32, device=dev)
    e[~is_esc] = table[idx[~is_esc]]
    e[is_esc] = data[lay.escapes : lay.escapes + n_escapes].to(torch.int32)
    w = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    if out.storage_offset() % 2:  # an odd start: written byte by byte (a 16-bit view needs an even one)
        out[0 : 2 * words : 2] = (w & 0xFF).to(torch.uint8)
        out[1 : 2 * words : 2] = (w >> 8).to(torch.uint8)
    else:
        out[: 2 * words].view(torch.int16).copy_(torch.where(w >= 2**15, w - 2**16, w).to(torch.int16))
    if nbytes & 1:
        out[-1] = data[lay.tail]
    return out
