"""A codec streaming blocks' tails, whatever tier holds their encoded bytes (runtime/codecs/layer.py: pinned host
memory, one copy per host, a spill file read into the disk tier's ring): the encoding of a block's tail chunk by
chunk, and the device side of a prefetch. It talks to the codec through its interface only (runtime/codecs/base.py):
what a codec keeps per chunk to decode it is the codec's.

- `encode(b, raw)` encodes block b's tail (its chunks, each 16-byte aligned in the block's encoded bytes) and gives
  the block's `EncodedBlock` (where each chunk's bytes are) and its bytes. A chunk that starts at an odd byte of the
  slot (any odd chunk size puts every other chunk there) keeps that first byte as it is, after its encoded bytes,
  and encodes the rest: the codec's 16-bit words start at an even byte, as the GPU decoder writes them and as the
  tensors' own 16-bit values lie, so the chunk decodes to its exact bytes and shrinks as much as its neighbours.
- `source(blk, buffer)`: a block prefetch (runtime/chunksource.py's interface) from `buffer`, a flat uint8 tensor
  holding the block's encoded bytes from its offset 0. Each chunk is copied on the copy stream into one of
  CODEC_STAGING_CHUNKS device staging buffers, a decode group's worth each (consecutive chunks of about
  CODEC_DECODE_BYTES, chunkflow_planner.offload.codec_group_chunks: one launch and one event a group); once a group is
  copied, a decode stream of the highest priority decodes it into the slot while the next group is copied; a staging
  buffer takes the next group once its decode is done (an event), and the block's ready event follows its decodes
  (`done`). Without CUDA each chunk is decoded by the reference decoder as it is "copied".
- The device buffers are made at the first prefetch (`make_device`, with the decoder's launch shape timed once) and
  dropped at a park or the end (`drop_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from chunkflow.runtime.codecs.base import Codec
from chunkflow_planner.offload import CODEC_STAGING_CHUNKS, codec_group_chunks

if TYPE_CHECKING:  # annotations only: the codec needs nothing of the layout's module
    from chunkflow.runtime.layout import BlockLayout

ALIGN = 16  # each chunk's encoded bytes start at a multiple of this in its block's encoded bytes


@dataclass
class EncodedBlock:
    """One block's tail encoded: each chunk's place in its encoded bytes (by the chunk's first block byte) and the
    layout it was encoded for; its tier holds the bytes."""

    key: tuple
    chunks: dict[int, tuple[int, int, object]]  # lo -> (encoded offset, encoded bytes, the codec's Chunk)
    raw_bytes: int
    stored_bytes: int
    nbytes: int  # its encoded bytes with the chunks' alignment

    def row(self) -> list:
        """What it is, as JSON (kept by its tier with the bytes, and given to ranks that share them)."""
        return [self.raw_bytes, self.stored_bytes, self.nbytes,
                [[lo, o, n, list(c)] for lo, (o, n, c) in self.chunks.items()]]

    @classmethod
    def from_row(cls, key: tuple, row: list, codec: Codec) -> EncodedBlock:
        raw, stored, nbytes, chunks = row
        return cls(key, {lo: (o, n, codec.Chunk(*c)) for lo, o, n, c in chunks}, raw, stored, nbytes)


Held = tuple  # (EncodedBlock, its encoded bytes where they lie in host memory, else None)


@dataclass(frozen=True)
class DecodeGroup:
    """Consecutive chunks of a block decoded by one launch: their encoded bytes are contiguous in the block's
    encoded bytes from `start`, and land at the same offsets from 0 of a staging buffer."""

    start: int  # encoded offset of its first chunk
    first: int  # block byte of its first chunk (lo)
    last: int  # block byte of its last chunk (lo)
    nbytes: int  # encoded bytes from its first chunk's start to its last chunk's end
    decode: object  # the codec's Decode of its chunks (tables on the device)
    heads: tuple | None = None  # (bytes in the group's encoded bytes, in the slot) of its chunks' odd first bytes


def layout_key(b: BlockLayout) -> tuple:
    """What a block's encoding depends on: which block it is (its name: blocks laid out again in the order they ran
    change places, and blocks of one shape have the same split) and its split and chunks (a new layout with the same
    keeps it)."""
    return (b.name, b.resident_bytes, b.nbytes, b.slot_start, tuple(b.chunks))


def head_byte(blk: EncodedBlock, lo: int) -> int:
    """1 where chunk `lo` of the block keeps its odd first byte as it is (after its encoded bytes; `encode`), else 0:
    its decoded bytes start one byte after its place in the slot."""
    _name, _resident, _nbytes, slot_start, _chunks = blk.key  # layout_key's fields
    return blk.chunks[lo][2].dst - (lo - slot_start)


def _heads(heads: list[tuple[int, int]], device) -> tuple | None:
    """A decode group's odd first bytes as index tensors on the device (source in the staging buffer, slot byte)."""
    if not heads:
        return None
    src, dst = zip(*heads)
    return (torch.tensor(src, dtype=torch.int64, device=device), torch.tensor(dst, dtype=torch.int64, device=device))


class EncodedSource:
    """A block prefetch of encoded chunks (module docstring)."""

    __slots__ = ("cs", "blk", "buffer", "groups", "r")

    def __init__(self, cs: CodecStream, blk: EncodedBlock, buffer: torch.Tensor):
        self.cs, self.blk, self.buffer, self.r = cs, blk, buffer, None
        self.groups = cs.groups.get(id(blk))

    def copy(self, slot: torch.Tensor, lo: int, hi: int) -> int:
        off, n, c = self.blk.chunks[lo]
        src = self.buffer[off : off + n]
        cs = self.cs
        if not cs.staging:  # no CUDA: decoded now, exactly
            head = head_byte(self.blk, lo)
            cs.codec.decode(src[: n - head], slot[c.dst : c.dst + c.nbytes], c)
            if head:
                slot[c.dst - 1 : c.dst].copy_(src[n - 1 :])
            return n
        g = self.groups[lo]
        stream = torch.cuda.current_stream(cs.device)  # the copy stream: the streamer copies inside it
        if lo == g.first:  # the group takes the next staging buffer, once the decode that last read it is done
            self.r = cs.turn
            cs.turn = (self.r + 1) % len(cs.staging)
            stream.wait_event(cs.free[self.r])
        buf = cs.staging[self.r]
        buf[off - g.start : off - g.start + n].copy_(src, non_blocking=True)
        if lo == g.last:  # the group's bytes are all copied: decode them on the decode stream
            copied = torch.cuda.Event()
            copied.record(stream)
            ds = cs.decode_stream
            ds.wait_event(copied)
            with torch.cuda.stream(ds):
                g.decode.run(buf, slot, cs.decode_config)
                if g.heads is not None:
                    slot.index_copy_(0, g.heads[1], buf.index_select(0, g.heads[0]))
            cs.free[self.r].record(ds)
        return n

    def done(self, backend) -> None:
        """The block's ready event (recorded next on the copy stream) follows its decodes."""
        if self.cs.staging:
            backend.copy_stream.wait_stream(self.cs.decode_stream)


class CodecStream:
    """A tier's codec: encoding at layout, the device side of its blocks' prefetches (module docstring)."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.device: torch.device | None = None
        self.staging: list[torch.Tensor] = []  # the device buffers encoded chunks are copied into, in turn
        self.free: list = []  # per staging buffer: an event after the decode that last read it
        self.turn = 0  # the staging buffer the next group takes
        self.groups: dict[int, dict[int, DecodeGroup]] = {}  # id(EncodedBlock) -> each chunk's (lo) decode group
        self.decode_stream = None
        self.decode_config = None  # the decoder's launch shape, the fastest on this device (timed once)

    def set_device(self, pin: bool, what: str) -> None:
        """The device encoding and decoding run on: the current CUDA device where `pin` (the module runs on a GPU),
        else the CPU; refused where the GPU decoder cannot be built (`what`: the setting, for the message)."""
        from chunkflow.runtime.errors import OffloadError

        if pin and not self.codec.gpu_ready():
            raise OffloadError(f"{what} decodes on the GPU with a Triton kernel, and Triton cannot be used here; "
                               "install it (`pip install triton`) or leave the codec off")
        self.drop_device()
        self.device = torch.device("cuda", torch.cuda.current_device()) if pin else torch.device("cpu")

    def encode(self, b: BlockLayout, raw: torch.Tensor) -> tuple[EncodedBlock, list[tuple[int, torch.Tensor]]]:
        """Block b's tail `raw` ([R_l, V_l), on this stream's device) encoded chunk by chunk: its EncodedBlock and
        (offset, bytes) of each chunk in its encoded bytes."""
        R, A = b.resident_bytes, b.slot_start
        pieces, chunks, off = [], {}, 0
        for lo, hi in b.chunks:
            seg = raw[lo - R : hi - R]
            head = (lo - A) & 1  # an odd first byte: kept as it is, after the encoded rest (module docstring)
            data, chunk = self.codec.encode(seg[head:], off, lo - A + head)
            n = data.numel() + head
            chunks[lo] = (off, n, chunk)
            pieces.append((off, torch.cat([data, seg[:head]]) if head else data))
            off += -(-n // ALIGN) * ALIGN
        stored = sum(n for _, n, _ in chunks.values())
        return EncodedBlock(layout_key(b), chunks, b.nbytes - R, stored, off), pieces

    def source(self, blk: EncodedBlock, buffer: torch.Tensor, blocks: Callable[[], list[Held]]) -> EncodedSource:
        """A prefetch of `blk` from `buffer`; `blocks()` (every block of the tier, with its bytes where they are in
        host memory) sizes the device buffers the first time."""
        if self.device is not None and self.device.type == "cuda" and not self.staging:
            self.make_device(blocks())
        return EncodedSource(self, blk, buffer)

    def make_device(self, blocks: list[Held]) -> None:
        """Every block's decode groups (their tables on the device), the staging buffers (the largest group's encoded
        bytes each), the decode stream, and the decoder's launch shape timed."""
        self.groups = {id(blk): self._groups_of(blk) for blk, _ in blocks}
        most = max((g.nbytes for gs in self.groups.values() for g in gs.values()), default=0)
        self.staging = [torch.empty(max(most, 16), dtype=torch.uint8, device=self.device)
                        for _ in range(CODEC_STAGING_CHUNKS)]
        self.free = [torch.cuda.Event() for _ in self.staging]
        self.turn = 0
        if self.decode_stream is None:
            high, _low = torch.cuda.Stream.priority_range()
            self.decode_stream = torch.cuda.Stream(device=self.device, priority=high)
        if self.decode_config is None and any(self.groups.values()):
            self.decode_config = self._tune(blocks)

    def _groups_of(self, blk: EncodedBlock) -> dict[int, DecodeGroup]:
        """The block's chunks in decode groups of codec_group_chunks (the planner's rule), keyed by each chunk's lo."""
        los = sorted(blk.chunks)
        if not los:
            return {}
        per = codec_group_chunks(max(c.nbytes for _, _, c in blk.chunks.values()))
        out: dict[int, DecodeGroup] = {}
        for i in range(0, len(los), per):
            part = los[i : i + per]
            start = blk.chunks[part[0]][0]
            end = blk.chunks[part[-1]][0] + blk.chunks[part[-1]][1]
            rows = [blk.chunks[lo][2]._replace(src=blk.chunks[lo][0] - start) for lo in part]
            heads = [(blk.chunks[lo][0] - start + blk.chunks[lo][1] - 1, blk.chunks[lo][2].dst - 1)
                     for lo in part if head_byte(blk, lo)]
            g = DecodeGroup(start, part[0], part[-1], end - start, self.codec.group(rows, self.device),
                            _heads(heads, self.device))
            out.update((lo, g) for lo in part)
        return out

    def _tune(self, blocks: list[Held]):
        """The decoder's fastest launch shape here, timed on the largest decode group (once an offload), on its bytes
        where they are in host memory, else on any bytes (a spill file's blocks)."""
        blk, held, g = max(((blk, held, g) for blk, held in blocks for g in self.groups[id(blk)].values()),
                           key=lambda x: x[2].nbytes)
        los = [lo for lo in sorted(blk.chunks) if g.first <= lo <= g.last]
        base = blk.chunks[los[0]][2].dst
        rows = [blk.chunks[lo][2]._replace(src=blk.chunks[lo][0] - g.start, dst=blk.chunks[lo][2].dst - base)
                for lo in los]
        src = self.staging[0][: g.nbytes]
        if held is not None:
            src.copy_(held[g.start : g.start + g.nbytes])
        else:  # the tier cannot give them now (a file being read): any bytes time the same shapes
            src.zero_()
            rows = [self.codec.any_bytes(r) for r in rows]
        out = torch.empty(max(r.dst + r.nbytes for r in rows) + 2, dtype=torch.uint8, device=self.device)
        config = self.codec.group(rows, self.device).tune(self.staging[0], out)
        torch.cuda.synchronize(self.device)
        return config

    def drop_device(self) -> None:
        """The device buffers go (a park, a new layout, the end), once every decode is done."""
        if self.staging:
            torch.cuda.synchronize(self.device)
        self.staging, self.free = [], []
        self.groups = {}

    def stats(self, blocks: list[EncodedBlock], prefix: str) -> dict:
        """Its OffloadStats fields for `blocks`, each named `prefix`_..."""
        return {f"{prefix}_blocks": len(blocks), f"{prefix}_raw_bytes": sum(b.raw_bytes for b in blocks),
                f"{prefix}_stored_bytes": sum(b.stored_bytes for b in blocks),
                f"{prefix}_staging_bytes": sum(t.numel() for t in self.staging)}

    def decode_config_name(self) -> str:
        return str(self.decode_config) if self.decode_config is not None else ""
