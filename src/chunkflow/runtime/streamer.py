"""Device buffers, the copy stream, events, chunked prefetch and its yield point.

Device memory for streaming is two slots (double buffer) sized to the largest streamed extent, plus one
resident buffer holding every block's resident head; all allocated once, here, at offload time. Binding a
block is assigning precomputed views (`p.data = view`), so a step allocates nothing.

On CUDA, copies run on a dedicated copy stream; `ready[l]` (copy stream) tells compute that block l's slot is
filled, `free[s]` (compute stream) tells the copy stream that slot s may be overwritten. Nothing in the hot path
synchronizes the host. Without CUDA the same code runs with no-op streams and events and synchronous copies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from chunkflow.runtime.layout import ALIGN, BlockLayout, TensorEntry, align_up
from chunkflow.runtime.store import HostStore


# --------------------------------------------------------------------------------------------- streams


class _NullEvent:
    def record(self, stream=None) -> None:
        pass


class _NullStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class Backend(Protocol):
    copy_stream: object

    def event(self): ...
    def compute_stream(self): ...
    def on(self, stream) -> contextlib.AbstractContextManager: ...
    def synchronize(self) -> None: ...


class CpuBackend:
    """No streams: every copy is synchronous, events are no-ops. Same call sequence as CudaBackend."""

    non_blocking = False

    def __init__(self):
        self.copy_stream = _NullStream()

    def event(self):
        return _NullEvent()

    def compute_stream(self):
        return _NullStream()

    def on(self, stream):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass


class CudaBackend:
    non_blocking = True

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)

    def event(self):
        return torch.cuda.Event()

    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


# --------------------------------------------------------------------------------------------- issuing


@dataclass(frozen=True)
class ChunkCopy:
    """One copy the issuer enqueued: block-relative byte range [start, end), 'h2d' or 'd2d', issue order."""

    order: int
    block: int
    start: int
    end: int
    kind: str


# gate(block, start, end) -> an event the copy stream must wait on before this chunk, or None
Gate = Callable[[int, int, int], object]


def never_wait(block: int, start: int, end: int):
    return None


class ChunkIssuer:
    """Enqueues one block's copies into a slot, chunk by chunk, asking `gate` before each H2D chunk.

    The gate is the yield point: returning an event makes the copy stream wait on it (on the GPU, not the
    host) before the next chunk, so a collective can pass in-flight prefetch. `bytes_h2d` counts bytes
    always (cheap); `log` (a list, or None) records every copy for tests.
    """

    def __init__(self, backend, host: HostStore, resident: torch.Tensor, gate: Gate = never_wait,
                 log: list[ChunkCopy] | None = None):
        self.backend = backend
        self.host = host
        self.resident = resident
        self.gate = gate
        self.log = log
        self.bytes_h2d = 0
        self.bytes_d2d = 0
        self._order = 0

    def _record(self, block: int, a: int, b: int, kind: str) -> None:
        if self.log is not None:
            self.log.append(ChunkCopy(self._order, block, a, b, kind))
        self._order += 1

    def issue_head(self, b: BlockLayout, res_offset: int, slot: torch.Tensor) -> None:
        """The resident part of the tensor straddling R_l, device to device into the slot head (if any)."""
        if b.d2d_bytes:
            A = b.slot_start
            lo, hi = b.straddle_start, b.resident_bytes
            slot[lo - A : hi - A].copy_(self.resident[res_offset + lo : res_offset + hi],
                                        non_blocking=self.backend.non_blocking)
            self.bytes_d2d += hi - lo
            self._record(b.index, lo, hi, "d2d")

    def issue_chunk(self, b: BlockLayout, lo: int, hi: int, slot: torch.Tensor) -> None:
        ev = self.gate(b.index, lo, hi)
        if ev is not None:
            self.backend.copy_stream.wait_event(ev)
        A = b.slot_start
        slot[lo - A : hi - A].copy_(self.host.view(b.host_offset + lo, hi - lo), non_blocking=self.backend.non_blocking)
        self.bytes_h2d += hi - lo
        self._record(b.index, lo, hi, "h2d")

    def issue(self, b: BlockLayout, res_offset: int, slot: torch.Tensor) -> None:
        self.issue_head(b, res_offset, slot)
        for lo, hi in b.chunks:
            self.issue_chunk(b, lo, hi, slot)


# --------------------------------------------------------------------------------------------- streamer


def _typed_view(buf: torch.Tensor, offset: int, t: TensorEntry) -> torch.Tensor:
    return buf[offset : offset + t.nbytes].view(t.dtype).view(t.shape)


def current(t: TensorEntry) -> torch.Tensor:
    """The tensor object (Parameter or buffer) its first owner holds now."""
    m, attr = t.owners[0]
    return m._parameters[attr] if t.is_param else m._buffers[attr]


def bind(t: TensorEntry, data: torch.Tensor) -> None:
    """Point every owner of tensor t at `data`, keeping Parameter objects (and their identity)."""
    for m, attr in t.owners:
        if t.is_param:
            m._parameters[attr].data = data
        else:
            m._buffers[attr] = data


class _Pending:
    """A block whose prefetch has begun but whose chunks are not all enqueued yet."""

    __slots__ = ("block", "slot", "chunks", "next")

    def __init__(self, block: int, slot: int, chunks):
        self.block, self.slot, self.chunks, self.next = block, slot, chunks, 0

    @property
    def left(self) -> int:
        return len(self.chunks) - self.next


class Streamer:
    """Owns the device buffers and the ring of streamed blocks; the hooks call `before` and `after`.

    A block's prefetch is begun (`begin`: wait for the slot, the D2D head), its chunks enqueued (`pump`), and
    finished (`finish`: the rest, then `ready[l]`). Without a pacer, `schedule` does all three at once, when the
    previous block starts. With a pacer (runtime/comm.py), the chunks are spread over the compute windows
    between collectives; the pacer is told when a prefetch period begins and ends and when a block ends.
    `log` (an EventLog, or None) records copies and stream waits with their stream-ordering information.
    """

    def __init__(self, layouts: list[BlockLayout], host: HostStore, device: torch.device, backend,
                 gate: Gate = never_wait, log: list[ChunkCopy] | None = None):
        self.layouts = layouts
        self.host = host
        self.device = device
        self.backend = backend
        # Resident heads of all blocks in one buffer, each block's head ALIGN-aligned.
        self.res_offset: list[int] = []
        off = 0
        for b in layouts:
            off = align_up(off)
            self.res_offset.append(off)
            off += b.resident_bytes
        self.resident = torch.empty(off, dtype=torch.uint8, device=device)
        slot_bytes = max((b.slot_extent for b in layouts), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.issuer = ChunkIssuer(backend, host, self.resident, gate, log)
        self.ring = [b.index for b in layouts if b.is_streamed]
        self.next_of = {l: self.ring[(i + 1) % len(self.ring)] for i, l in enumerate(self.ring)}
        self.placeholders: dict[torch.dtype, torch.Tensor] = {}
        # Precomputed views per (block, slot): binding a block is a list of `p.data = view`.
        self.slot_views: dict[tuple[int, int], list[tuple[TensorEntry, torch.Tensor]]] = {}
        for b in layouts:
            if not b.is_streamed:
                continue
            for s, buf in enumerate(self.slots):
                self.slot_views[(b.index, s)] = [
                    (t, _typed_view(buf, t.offset - b.slot_start, t)) for t in b.streamed_tensors()
                ]
        self.ready = {l: backend.event() for l in self.ring}
        self.free = [backend.event(), backend.event()]
        self.slot_of: dict[int, int] = {}  # prefetched blocks not yet running, and their slot
        self.bound: dict[int, int] = {}  # running blocks and their slot
        self.running: list[int] = []  # slots of running blocks
        self.forwards = 0
        self.pending: _Pending | None = None
        self.pacer = None  # set by the handle: period_start(m), period_end(m), block_end(l)
        self.events = None  # EventLog or None
        self.free_mark = [-1, -1]  # compute-stream mark at which free[s] was last recorded (for the log)
        self.wait_probe = None  # optional callable(kind, fn): wraps each compute-stream wait (stall timing)

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.placeholders:
            self.placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return self.placeholders[dtype]

    # ---- set-up (not the hot path)

    def fill_resident_and_start(self) -> None:
        """Copy every block's resident head to the device, bind resident tensors, prefetch the first block."""
        for b, roff in zip(self.layouts, self.res_offset):
            if b.resident_bytes:
                self.resident[roff : roff + b.resident_bytes].copy_(self.host.view(b.host_offset, b.resident_bytes))
            for t in b.resident_tensors():
                bind(t, _typed_view(self.resident, roff + t.offset, t))
            for t in b.streamed_tensors():
                bind(t, self.placeholder(t.dtype))
        self.backend.synchronize()  # slots and resident buffer were produced on the compute stream
        if self.ring:
            self.schedule(self.ring[0], 0)

    # ---- hot path

    def begin(self, l: int, s: int) -> None:
        """Start prefetching block l into slot s: the copy stream waits until compute released slot s."""
        be = self.backend
        b = self.layouts[l]
        with be.on(be.copy_stream):
            be.copy_stream.wait_event(self.free[s])
            if self.events is not None:
                self.events.copy_waits(self.free_mark[s])
            self.issuer.issue_head(b, self.res_offset[l], self.slots[s])
        self.pending = _Pending(l, s, b.chunks)
        self.slot_of[l] = s

    def pump(self, n: int) -> int:
        """Enqueue up to n more chunks of the pending block; returns how many were enqueued."""
        p = self.pending
        if p is None or n <= 0:
            return 0
        be = self.backend
        b = self.layouts[p.block]
        slot = self.slots[p.slot]
        k = min(n, p.left)
        if k and self.pacer is not None:
            self.pacer.before_chunks()
        with be.on(be.copy_stream):
            for lo, hi in p.chunks[p.next : p.next + k]:
                if self.events is not None:
                    self.events.copy(p.block, lo, hi, be.copy_stream)
                self.issuer.issue_chunk(b, lo, hi, slot)
        p.next += k
        return k

    def finish(self) -> None:
        """Enqueue the pending block's remaining chunks and mark it ready."""
        p = self.pending
        if p is None:
            return
        self.pump(p.left)
        be = self.backend
        self.ready[p.block].record(be.copy_stream)
        if self.events is not None:
            self.events.ready(p.block)
        self.pending = None

    def schedule(self, l: int, s: int) -> None:
        """Enqueue block l's copies into slot s on the copy stream, after compute has released slot s."""
        self.begin(l, s)
        self.finish()

    def compute_wait(self, event, kind: str, cover=None) -> None:
        """The compute stream waits on a copy-stream event (ready[l] or a fence)."""
        cs = self.backend.compute_stream()
        if self.wait_probe is not None:
            self.wait_probe(kind, lambda: cs.wait_event(event))
        else:
            cs.wait_event(event)
        if self.events is not None:
            self.events.compute_waits(kind, cover)

    def before(self, l: int) -> None:
        if l == self.ring[0]:
            self.forwards += 1
        if self.pending is not None:  # normally block l itself; out of order, finish it so its ready[] is right
            if self.pacer is not None and self.pending.block == l:
                self.pacer.period_end(l)
            self.finish()
        s = self.slot_of.pop(l, None)
        if s is None:  # not prefetched (blocks ran out of the declared order): load it now
            s = 1 - self.running[-1] if self.running else 0
            self._evict(s)
            self.schedule(l, s)
            self.slot_of.pop(l)
        self.compute_wait(self.ready[l], "ready", ("ready", l))
        for t, view in self.slot_views[(l, s)]:
            bind(t, view)
        self.running.append(s)
        self.bound[l] = s
        other = 1 - s
        self._evict(other)
        nxt = self.next_of[l]  # the last block prefetches the first, for the next forward
        if self.pacer is None:
            self.schedule(nxt, other)
        else:
            self.begin(nxt, other)
            self.pacer.period_start(nxt)

    def after(self, l: int) -> None:
        s = self.bound.pop(l)
        self.running.remove(s)
        self.free[s].record(self.backend.compute_stream())
        if self.events is not None:
            self.free_mark[s] = self.events.compute_mark("free")
        for t, _ in self.slot_views[(l, s)]:
            bind(t, self.placeholder(t.dtype))
        if self.pacer is not None:
            self.pacer.block_end(l)

    def _evict(self, s: int) -> None:
        self.slot_of = {k: v for k, v in self.slot_of.items() if v != s}
        if self.pending is not None and self.pending.slot == s:  # a half-enqueued prefetch nobody will use
            self.pending = None

    # ---- tear-down

    def release(self) -> None:
        self.pending = None
        self.pacer = None
        self.backend.synchronize()
        self.slot_views.clear()
        self.slots = []
        self.resident = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.issuer.resident = self.resident
