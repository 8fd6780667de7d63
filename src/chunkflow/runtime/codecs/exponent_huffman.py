"""A lossless codec for streamed 16-bit floats: each word's 8 exponent bits Huffman-coded, its sign and 7 mantissa
bits kept raw, laid out so that a GPU can decode it in parallel. This module is the format and its CPU reference
encoder and decoder (numpy, exact); a GPU decoder must produce the same bytes.

Why: bf16 weights of trained models carry about 2.6 bits of information in their 8 exponent bits, and almost 8 in
their sign and mantissa, so a chunk's bytes shrink to about (8 + 2.6) / 16 = 0.66-0.70 of themselves (DFloat11
measured 0.686 on FLUX.1-dev); fewer bytes on a saturated host-to-device link are a shorter step, bit for bit.

The format of one encoded chunk (`Encoded`, a flat uint8 array and the facts to decode it):
- the chunk's bytes are read as little-endian 16-bit words w (a trailing odd byte is kept raw); a word's exponent is
  e = (w >> 7) & 0xFF and its sign-mantissa byte s = ((w >> 8) & 0x80) | (w & 0x7F): any 16 bits round-trip (NaN,
  Inf, subnormals and non-float bytes included), only the ratio depends on what they hold;
- the exponents are coded with a canonical Huffman code over the chunk's own counts, every code at most
  MAX_CODE_BITS long (a GPU decodes each with one lookup in a table of 2**MAX_CODE_BITS entries), written MSB first
  into a bit stream padded to whole 64-bit segments;
- a segment (SEGMENT_BITS of the stream, one GPU thread's share) holds the codes that start in it: its `gap` (4
  bits: where its first code starts, less than MAX_CODE_BITS, since a code may run on from the segment before; the
  last code may run on into 64 bits of padding that are no segment) and, for each GROUP_SEGMENTS segments (one GPU
  thread block's share), the index of the group's first word (uint32), from which a block finds each thread's
  first word by a prefix sum of the codes counted in each segment;
- sections, in order: sign-mantissa bytes (one a word), the bit stream, the gaps (two a byte, low nibble first),
  zeros to a multiple of 4 bytes, the group starts (little-endian uint32), the odd byte.
A chunk that would not shrink is kept raw (`Encoded.raw`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

MAX_CODE_BITS = 12  # the decoder's table: 4096 entries of (symbol, length)
SEGMENT_BITS = 64  # a GPU thread decodes the codes that start in its 64 bits
GROUP_SEGMENTS = 256  # a GPU thread block's segments: one uint32 word index each

__all__ = ["Encoded", "encode", "decode", "code_lengths", "sections", "MAX_CODE_BITS", "SEGMENT_BITS", "GROUP_SEGMENTS"]


@dataclass(frozen=True)
class Encoded:
    """One chunk encoded: `data` the bytes to store and copy, and where its sections start."""

    data: np.ndarray  # uint8
    nbytes: int  # the chunk's bytes, decoded
    raw: bool  # kept as it was (it would not shrink)
    lengths: np.ndarray | None = None  # uint8[256]: each exponent's code length (0: absent)
    bits: int = 0  # the stream's coded bits
    segments: int = 0  # 64-bit segments in which codes start (the last code may run into one more)
    sm_at: int = 0
    stream_at: int = 0
    gaps_at: int = 0
    groups_at: int = 0
    tail_at: int = 0

    @property
    def words(self) -> int:
        return self.nbytes // 2

    @property
    def ratio(self) -> float:
        """Stored bytes over the chunk's bytes."""
        return self.data.size / self.nbytes if self.nbytes else 1.0


def sections(n: int, words: int, bits: int, last_start: int) -> tuple[int, int, int, int]:
    """(segments, padded stream bits, alignment zeros, encoded bytes) of a chunk of `n` bytes whose `words` codes
    take `bits` bits, the last starting at bit `last_start`: the one account of the layout every encoder uses."""
    segments = last_start // SEGMENT_BITS + 1  # a last segment no code starts in is left out
    padded = -(-bits // SEGMENT_BITS) * SEGMENT_BITS
    align = -(words + padded // 8 + (segments + 1) // 2) % 4  # the group starts at a multiple of 4 bytes
    size = words + padded // 8 + (segments + 1) // 2 + align + 4 * (-(-segments // GROUP_SEGMENTS)) + n % 2
    return segments, padded, align, size


def split_words(chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exponents, sign-mantissa bytes) of the chunk's whole 16-bit words (module docstring)."""
    w = chunk[: chunk.size - chunk.size % 2].view("<u2")
    return ((w >> 7) & 0xFF).astype(np.uint8), (((w >> 8) & 0x80) | (w & 0x7F)).astype(np.uint8)


def join_words(exponents: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """The little-endian bytes of the words made of `exponents` and sign-mantissa bytes `sm`."""
    e, s = exponents.astype(np.uint16), sm.astype(np.uint16)
    return (((s & 0x80) << 8) | (e << 7) | (s & 0x7F)).astype("<u2").view(np.uint8)


def code_lengths(counts: np.ndarray, max_bits: int = MAX_CODE_BITS) -> np.ndarray:
    """Huffman code lengths (uint8[256], 0 for an absent symbol) for `counts`, none longer than `max_bits`: the
    longest are cut to `max_bits`, then the deepest codes shorter than that lengthened one bit at a time until the
    lengths form a prefix code (Kraft's sum at most 1). One symbol present: length 1."""
    present = np.flatnonzero(counts)
    lengths = np.zeros(256, dtype=np.int64)
    if present.size == 0:
        return lengths.astype(np.uint8)
    if present.size == 1:
        lengths[present[0]] = 1
        return lengths.astype(np.uint8)
    heap = [(int(counts[s]), int(s), (int(s),)) for s in present]
    heapq.heapify(heap)
    while len(heap) > 1:
        c1, k1, a = heapq.heappop(heap)
        c2, k2, b = heapq.heappop(heap)
        for s in a + b:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, min(k1, k2), a + b))
    if lengths.max() > max_bits:
        lengths[lengths > max_bits] = max_bits
        unit = 1 << max_bits
        kraft = int(sum(unit >> int(lengths[s]) for s in present))
        while kraft > unit:  # lengthen the deepest code under the limit (the least frequent among equals)
            s = max((s for s in present if lengths[s] < max_bits), key=lambda s: (int(lengths[s]), -int(counts[s])))
            kraft -= (unit >> int(lengths[s])) - (unit >> int(lengths[s] + 1))
            lengths[s] += 1
    return lengths.astype(np.uint8)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Each symbol's canonical code (uint32[256]) for `lengths`: by length, then by symbol."""
    codes = np.zeros(256, dtype=np.uint32)
    code = 0
    prev = 0
    for s in sorted((s for s in range(256) if lengths[s]), key=lambda s: (int(lengths[s]), s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def decode_table(lengths: np.ndarray, bits: int = MAX_CODE_BITS) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, length) for every `bits`-bit window whose leading bits are a code (what a GPU keeps in shared
    memory); windows that begin no code have length 0."""
    codes = canonical_codes(lengths)
    sym = np.zeros(1 << bits, dtype=np.uint8)
    ln = np.zeros(1 << bits, dtype=np.uint8)
    for s in range(256):
        n = int(lengths[s])
        if n:
            lo = int(codes[s]) << (bits - n)
            sym[lo: lo + (1 << (bits - n))] = s
            ln[lo: lo + (1 << (bits - n))] = n
    return sym, ln


def encode(chunk: np.ndarray | bytes) -> Encoded:
    """The chunk's bytes encoded (module docstring); raw where that would not make them smaller."""
    chunk = np.frombuffer(chunk, dtype=np.uint8) if isinstance(chunk, (bytes, bytearray, memoryview)) \
        else np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
    n = chunk.size
    raw = Encoded(chunk.copy(), n, True)
    if n < 2:
        return raw
    exps, sm = split_words(chunk)
    lengths = code_lengths(np.bincount(exps, minlength=256))
    codes = canonical_codes(lengths)
    ln = lengths.astype(np.int64)[exps]
    ends = np.cumsum(ln)
    starts = ends - ln
    bits = int(ends[-1])
    words = exps.size
    segments, padded, align, size = sections(n, words, bits, int(starts[-1]))
    if size >= n:
        return raw
    stream = _pack(codes.astype(np.int64)[exps], ln, starts, padded)
    first = np.searchsorted(starts, np.arange(segments, dtype=np.int64) * SEGMENT_BITS)  # each segment's first word
    gaps = (starts[np.minimum(first, words - 1)] - np.arange(segments, dtype=np.int64) * SEGMENT_BITS)
    assert ((gaps >= 0) & (gaps < MAX_CODE_BITS)).all()
    packed_gaps = np.zeros((segments + 1) // 2, dtype=np.uint8)
    packed_gaps[:] = gaps[0::2].astype(np.uint8)
    packed_gaps[: segments // 2] |= (gaps[1::2].astype(np.uint8) << 4)
    groups = first[::GROUP_SEGMENTS].astype("<u4")
    parts = [sm, stream, packed_gaps, np.zeros(align, dtype=np.uint8), groups.view(np.uint8), chunk[n - n % 2:]]
    at = [int(a) for a in np.cumsum([0] + [p.size for p in parts])]
    data = np.concatenate(parts)
    return Encoded(data, n, False, lengths, bits, segments, at[0], at[1], at[2], at[4], at[5])


def _pack(codes: np.ndarray, ln: np.ndarray, starts: np.ndarray, padded: int) -> np.ndarray:
    """The codes written MSB first at their bit offsets, in `padded` bits (bytes)."""
    stream = np.zeros(padded, dtype=np.uint8)
    for k in range(MAX_CODE_BITS):  # bit k of each code, for the codes that long
        has = ln > k
        stream[starts[has] + k] = (codes[has] >> (ln[has] - 1 - k)) & 1
    return np.packbits(stream)


def decode(enc: Encoded) -> np.ndarray:
    """The chunk's bytes (uint8), decoded as a GPU decodes them: every segment from its gap, its codes placed after
    the words of the segments before it (counted here; a GPU block counts them from its group's start)."""
    if enc.raw:
        return enc.data.copy()
    d = enc.data
    words, segments = enc.words, enc.segments
    sm = d[enc.sm_at: enc.stream_at]
    stream = d[enc.stream_at: enc.gaps_at]
    packed = d[enc.gaps_at: enc.groups_at]
    gaps = np.empty(segments, dtype=np.int64)
    gaps[0::2] = packed[: (segments + 1) // 2] & 0x0F
    gaps[1::2] = packed[: segments // 2] >> 4
    sym_of, len_of = decode_table(enc.lengths)
    padded = np.concatenate([stream, np.zeros(4, dtype=np.uint8)]).astype(np.int64)
    seg = np.arange(segments, dtype=np.int64)
    pos = seg * SEGMENT_BITS + gaps
    end = np.minimum((seg + 1) * SEGMENT_BITS, enc.bits)
    out_seg, out_k, out_sym = [], [], []
    k = 0
    live = pos < end
    while live.any():
        p = pos[live]
        byte = p >> 3
        window = (padded[byte] << 16) | (padded[byte + 1] << 8) | padded[byte + 2]  # 24 bits from p's byte
        window = (window >> (24 - MAX_CODE_BITS - (p & 7))) & ((1 << MAX_CODE_BITS) - 1)
        n = len_of[window].astype(np.int64)
        if (n == 0).any():
            raise ValueError("the encoded chunk is damaged: a window begins no code")
        out_seg.append(seg[live])
        out_k.append(np.full(p.size, k))
        out_sym.append(sym_of[window])
        pos[live] = p + n
        live = pos < end
        k += 1
    segs, ks, syms = (np.concatenate(a) for a in (out_seg, out_k, out_sym))
    counts = np.bincount(segs, minlength=segments)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    groups = d[enc.groups_at: enc.tail_at].view("<u4")
    if not np.array_equal(groups, first[::GROUP_SEGMENTS]) or counts.sum() != words:
        raise ValueError("the encoded chunk is damaged: its group starts do not match its codes")
    exps = np.empty(words, dtype=np.uint8)
    exps[first[segs] + ks] = syms
    return np.concatenate([join_words(exps, sm), d[enc.tail_at:]])
