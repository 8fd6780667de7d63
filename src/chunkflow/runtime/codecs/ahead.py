"""Decode ahead: a streamed block's quantized weights (stored formats, runtime/codecs/base.py FormatCodec: GGUF
types, fp8-scaled) decoded into their layers' compute dtype right after the block's copies, on the copy stream,
while the previous block computes; the layer's forward then finds them decoded and skips its own dequantization.

- Which: every tensor of a streamed block that a format codec decodes (`plan_block`); resident blocks (never
  streamed) keep their quantized bytes on the device and dequantize in each layer's forward, as diffusers does: their
  memory is the point of the format.
- Where: one decode buffer per slot, sized to the largest streamed block's decoded weights (each 256-byte aligned):
  `DecodeAhead.buffer_bytes` each, two in all, on top of the slots (which still take the stored bytes). A block's
  decodes are enqueued on the copy stream after its copies (`copies_done`), before its ready event: the compute
  stream waits for them with it. A slot's buffer is written again only by the next block copied into that slot,
  whose copies wait for the slot's release (`free[s]`, recorded when the block's forward is done): the buffer is
  never overwritten before the forward that reads it is done. On the CPU the same calls run, synchronously.
- Exactness: the decode is the layer's own function on the same bytes (the codec's `decode`), and the forward runs
  the same op on its result: outputs are bit for bit those of decoding in the forward.
- Binding: `entered` binds each decoded tensor's parameter to its decoded values and gives it the codec's
  `decoded_class` (the layer then finds nothing to dequantize); `exited` gives its offloaded class back before the
  streamer binds it to its host view again.
- A tensor kept beyond the forward (a weight taken without a copy) keeps its buffer, and a new one is made, as the
  streamer does for a slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from chunkflow.runtime.codecs.base import Decoding, FormatCodec
from chunkflow.runtime.codecs.fp8_scaled import Fp8ScaledWeights
from chunkflow.runtime.codecs.gguf import GGUFWeights
from chunkflow.runtime.errors import OffloadError
from chunkflow.runtime.feature import BlockFeature
from chunkflow.runtime.layout import BlockLayout, TensorEntry, align_up
from chunkflow.runtime.streamer import bind, current, storage_refs

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.streamer import Streamer

FORMAT_CODECS: tuple[FormatCodec, ...] = (GGUFWeights(), Fp8ScaledWeights())
DECODES = ("ahead", "forward")  # offload(decode=...): before the forward on the copy stream, or in it


class Planned(NamedTuple):
    """One tensor of a block decoded ahead: its codec, how, and where in a decode buffer."""

    entry: TensorEntry
    codec: FormatCodec
    decoding: Decoding
    offset: int


class Job(NamedTuple):
    """One decode of a (block, slot): the stored bytes' device view, what the decode reads (made once per slot) and
    where it writes."""

    planned: Planned
    stored: torch.Tensor
    source: object
    reads: list
    out: torch.Tensor


def check_decode(decode: str) -> str:
    if decode not in DECODES:
        raise OffloadError(f"decode={decode!r}: not a way to decode quantized weights; use 'ahead' (streamed blocks "
                           "decoded on the copy stream before their forward, the default) or 'forward' (each layer "
                           "dequantizes in its forward)")
    return decode


def plan_block(b: BlockLayout, codecs: tuple[FormatCodec, ...] = FORMAT_CODECS) -> list[Planned]:
    """Block b's tensors a format codec decodes, each placed in a decode buffer (256-byte aligned)."""
    out, off = [], 0
    for t in b.tensors:
        for codec in codecs:
            d = codec.decoding(t, b.tensors)
            if d is not None:
                off = align_up(off)
                out.append(Planned(t, codec, d, off))
                off += d.nbytes
                break
    return out


def _extent(planned: list[Planned]) -> int:
    return max((p.offset + p.decoding.nbytes for p in planned), default=0)


class DecodeAhead(BlockFeature):
    """The decode buffers and the decodes around each streamed block (module docstring)."""

    def __init__(self, layouts: list[BlockLayout], device: torch.device):
        self.device = device
        self.plans = {b.index: p for b in layouts if b.is_streamed and (p := plan_block(b))}
        self.buffer_bytes = max((_extent(p) for p in self.plans.values()), default=0)
        self.buffers: list[torch.Tensor] = []  # one per slot
        self.refs: list[int] = []  # references to each buffer its jobs hold (more: someone kept a decoded weight)
        self.jobs: dict[tuple[int, int], list[Job]] = {}
        self.bound: dict[int, tuple[int, list[tuple[torch.Tensor, type]]]] = {}  # block -> (slot, (param, class))

    def __bool__(self) -> bool:
        return bool(self.plans)

    # ---- figures (the handle's stats)

    def device_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def tensor_count(self) -> int:
        return sum(len(p) for p in self.plans.values())

    def stored_and_decoded(self) -> tuple[int, int]:
        """Bytes of the decoded tensors as stored and decoded, over every streamed block."""
        ps = [x for p in self.plans.values() for x in p]
        return sum(x.entry.nbytes for x in ps), sum(x.decoding.nbytes for x in ps)

    # ---- buffers (not the hot path)

    def allocate(self, streamer: Streamer) -> None:
        self.buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.refs = [0, 0]
        self.jobs, self.bound = {}, {}
        for s in range(2):
            self.slot_renewed(streamer, s)

    def slot_renewed(self, streamer: Streamer, slot: int) -> None:
        """Every planned block's decodes in slot `slot`: its stored tensors' views in the slot (or the resident
        buffer), its outputs' in the slot's decode buffer."""
        buf = self.buffers[slot]
        for l, planned in self.plans.items():
            src = {id(t): v for t, v in streamer.slot_views[(l, slot)] + streamer.resident_views[l]}
            self.jobs[(l, slot)] = [
                Job(p, src[id(p.entry)], p.codec.source(src[id(p.entry)], p.decoding),
                    [src[id(r)] for r in p.decoding.reads],
                    buf[p.offset : p.offset + p.decoding.nbytes].view(p.decoding.dtype).view(p.decoding.shape))
                for p in planned]
        self.refs[slot] = storage_refs(buf)

    def release(self, streamer: Streamer) -> None:
        self.buffers, self.refs, self.jobs, self.bound = [], [], {}, {}

    # ---- around each block (hot path)

    def copies_done(self, streamer: Streamer, block: int, slot: int) -> None:
        jobs = self.jobs.get((block, slot))
        if jobs:  # on the copy stream, after the block's copies and before its ready event
            be = streamer.backend
            with be.on(be.copy_stream):
                for j in jobs:
                    j.planned.codec.decode(j.source, j.reads, j.out, j.planned.decoding)

    def entered(self, streamer: Streamer, block: int) -> None:
        slot = streamer.bound.get(block)
        jobs = self.jobs.get((block, slot)) if slot is not None else None
        if not jobs:
            return
        was = []
        for j in jobs:
            p = current(j.planned.entry)
            was.append((p, type(p)))
            p.__class__ = j.planned.codec.decoded_class
            bind(j.planned.entry, j.out)
        self.bound[block] = (slot, was)

    def exited(self, streamer: Streamer, block: int) -> None:
        slot, was = self.bound.pop(block, (None, ()))
        for p, cls in was:
            p.__class__ = cls
        if slot is not None and storage_refs(self.buffers[slot]) > self.refs[slot]:
            self.buffers[slot] = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
            self.slot_renewed(streamer, slot)

    # ---- writes to an entered block's tensors (runtime/streamer.py copy_in, write_back)

    def copy_in(self, streamer: Streamer, block: int, positions: list[int]) -> list[int]:
        """Those of `positions` bound to decoded values take their host bytes into their stored views (slot or
        resident buffer) and are decoded again, on the compute stream (the block runs next); returns them."""
        slot, _ = self.bound.get(block, (None, ()))
        jobs = {id(j.planned.entry): j for j in self.jobs.get((block, slot), ())}
        done = []
        for i in positions:
            t, view = streamer.host_views[block][i]
            j = jobs.get(id(t))
            if j is not None:
                j.stored.copy_(view)
                j.planned.codec.decode(j.source, j.reads, j.out, j.planned.decoding)
                done.append(i)
        return done

    def writes_back(self, streamer: Streamer, block: int, positions: list[int]) -> None:
        """A running block wrote a weight bound to its decoded values: that tensor does not exist without decode
        ahead (the layer holds the stored bytes), so the write has no place to go: refused."""
        slot, _ = self.bound.get(block, (None, ()))
        decoded = {id(j.planned.entry): j.planned.entry.name for j in self.jobs.get((block, slot), ())}
        hit = [decoded[id(streamer.host_views[block][i][0])] for i in positions
               if id(streamer.host_views[block][i][0]) in decoded]
        if hit:
            raise OffloadError(f"{hit[0]} was written inside its block's forward while bound to its values decoded "
                               "ahead (not its stored bytes); offload with decode='forward' to write quantized "
                               "weights inside a forward")
