"""Device buffers, the copy stream, events, chunked prefetch and its yield point.

Device memory for streaming is two slots (double buffer) sized to the largest streamed extent, plus one
resident buffer holding every block's resident head; all allocated once, here, at offload time. Outside its
forward a block's tensors are bound to their views of the host store (true shape and values, runtime/params.py);
`enter` binds them to the resident buffer and a slot, `exit` back to the host. Binding is assigning precomputed
views, so a step allocates nothing. The host store is the truth: `refresh` copies changed blocks' bytes to the
device again after a write.

On CUDA, copies run on a dedicated copy stream; `ready[l]` (copy stream) tells compute that block l's slot is
filled, `free[s]` (compute stream) tells the copy stream that slot s may be overwritten. Nothing in the hot path
synchronizes the host. Without CUDA the same code runs with no-op streams and events and synchronous copies.

Features that act on the device around each block (`BlockFeature`s, runtime/feature.py: fp8 casts, runtime/
casting.py) are called when a block's copies are enqueued, when it is entered and when it is exited; with none the
hot path loops over an empty list. With fp8 storage the host store, resident buffer and slots hold the fp8 bytes.

`obs` (an Observer, or None) is told of every copy, stream wait and slot release (runtime/observe.py).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from chunkflow.runtime.chunksource import ChunkSource
from chunkflow.runtime.feature import BlockFeature
from chunkflow.runtime.layout import BlockLayout, TensorEntry, align_up
from chunkflow.runtime.observe import Observer
from chunkflow.runtime.params import bind_data, raw_data
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


# --------------------------------------------------------------------------------------------- streamer


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # (torch >= 2.1): references to a tensor's storage


def storage_refs(buf: torch.Tensor) -> int:
    """How many tensors (views included) refer to `buf`'s memory now; 0 where torch cannot say."""
    return _USE_COUNT(buf.untyped_storage()._cdata) if _USE_COUNT is not None else 0


def _typed_view(buf: torch.Tensor, offset: int, t: TensorEntry) -> torch.Tensor:
    return buf[offset : offset + t.nbytes].view(t.dtype).view(t.shape)


def current(t: TensorEntry) -> torch.Tensor:
    """The tensor object (Parameter or buffer) its first owner holds now."""
    m, attr = t.owners[0]
    return m._parameters[attr] if t.is_param else m._buffers[attr]


def bind(t: TensorEntry, data: torch.Tensor) -> None:
    """Point every owner of tensor t at `data`, keeping Parameter objects (and their identity)."""
    if t.is_param:
        bind_data(t.owners[0][0]._parameters[t.owners[0][1]], data)  # tied owners share the Parameter object
    else:
        for m, attr in t.owners:
            m._buffers[attr] = data


class _Pending:
    """A block whose prefetch has begun but whose chunks are not all enqueued yet."""

    __slots__ = ("block", "slot", "chunks", "next", "source")

    def __init__(self, block: int, slot: int, chunks, source: ChunkSource):
        self.block, self.slot, self.chunks, self.next = block, slot, chunks, 0
        self.source = source  # what its tier gave for this prefetch: copies a chunk into the slot

    @property
    def left(self) -> int:
        return len(self.chunks) - self.next


class Streamer:
    """Owns the device buffers and the ring of streamed blocks; the hooks call `before` and `after`.

    A block's prefetch is begun (`begin`: wait for the slot, the D2D head), its chunks enqueued (`pump`), and
    finished (`finish`: the rest, then `ready[l]`). Without a pacer, `schedule` does all three at once, when the
    previous block starts. With a pacer (runtime/comm.py), the chunks are spread over the compute windows
    between collectives; the pacer is told when a prefetch period begins and ends and when a block ends.
    """

    def __init__(self, layouts: list[BlockLayout], host: HostStore, device: torch.device, backend,
                 features: list[BlockFeature] | None = None):
        self.layouts = layouts
        self.features = list(features or [])  # called around each block (fp8 casts); empty: nothing to call
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
        self.resident_total = off
        self.slot_bytes = max((b.slot_extent for b in layouts), default=0)
        self.ring = [b.index for b in layouts if b.is_streamed]
        self.next_of = {l: self.ring[(i + 1) % len(self.ring)] for i, l in enumerate(self.ring)}
        # Precomputed views: binding a block is a list of `p.data = view`. Host views outside the forward, the
        # resident buffer and a slot inside it.
        self.host_views = [[(t, b.tier.view(host, b, t)) for t in b.tensors] for b in layouts]
        self.resident = torch.empty(0, dtype=torch.uint8, device=device)
        self.slots: list[torch.Tensor] = []
        self.slot_refs: list[int] = []  # references to each slot's memory the streamer and its features hold
        self.slots_given = 0  # slots left to a tensor taken from a block's weights inside its forward
        self.resident_views: list[list[tuple[TensorEntry, torch.Tensor]]] = []
        self.slot_views: dict[tuple[int, int], list[tuple[TensorEntry, torch.Tensor]]] = {}
        self._alloc_device()
        self.ready = {l: backend.event() for l in self.ring}
        self.free = [backend.event(), backend.event()]
        self.slot_of: dict[int, int] = {}  # prefetched blocks not yet running, and their slot
        self.bound: dict[int, int] = {}  # running blocks and their slot
        self.running: list[int] = []  # slots of running blocks
        self.forwards = 0
        self.bytes_h2d = 0  # H2D bytes enqueued so far
        self.bytes_d2d = 0
        self.copied = [0] * len(layouts)  # H2D bytes enqueued for each block since its last run began
        self.run_bytes = [0] * len(layouts)  # ... of which its current (or last) run took (runtime/runs.py)
        self.pending: _Pending | None = None
        self.pacer = None  # set by the handle: period_start(m), period_end(m), block_end(l), before_chunks()
        self.obs: Observer | None = None  # set by the handle while observers are attached

    # ---- set-up and writes (not the hot path)

    def _alloc_device(self) -> None:
        """The resident buffer, both slots and their precomputed views, then the features' buffers (at start-up,
        and again after a park)."""
        self.resident = torch.empty(self.resident_total, dtype=torch.uint8, device=self.device)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.resident_views = [[(t, _typed_view(self.resident, roff + t.offset, t)) for t in b.resident_tensors()]
                               for b, roff in zip(self.layouts, self.res_offset)]
        self.slot_views = {}
        for s in range(2):
            self._slot_views(s)
        for f in self.features:
            f.allocate(self)
        self.slot_refs = [storage_refs(buf) for buf in self.slots]

    def _slot_views(self, s: int) -> None:
        """Every streamed block's views in slot s."""
        buf = self.slots[s]
        for b in self.layouts:
            if b.is_streamed:
                self.slot_views[(b.index, s)] = [
                    (t, _typed_view(buf, t.offset - b.slot_start, t)) for t in b.streamed_tensors()
                ]

    def _keep_if_held(self, s: int) -> None:
        """Slot s was just left by a block: if something beyond the streamer still refers to its memory (a tensor
        taken from the block's weights inside its forward, `w = layer.weight.detach()` in a hook), that tensor keeps
        the slot with the block's values, as it would keep the weight's memory without offload, and the streamer
        takes a new slot instead of overwriting them with the next block's."""
        if self.slot_refs and storage_refs(self.slots[s]) > self.slot_refs[s]:
            self.slots[s] = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            self._slot_views(s)
            for f in self.features:
                f.slot_renewed(self, s)
            self.slot_refs[s] = storage_refs(self.slots[s])
            self.slots_given += 1

    def _drop_device(self) -> None:
        """Drop the device buffers, their views and the features' buffers (copies finished)."""
        self.slot_views = {}
        self.resident_views = []
        self.slots = []
        self.resident = torch.empty(0, dtype=torch.uint8, device=self.device)
        for f in self.features:
            f.release(self)

    def release_device(self) -> None:
        """Give the device buffers back (a park): copies finish first; tensors stay bound to their host views."""
        self.backend.synchronize()
        for tier in {id(b.tier): b.tier for b in self.layouts if b.is_streamed}.values():
            tier.pause()  # no reads ahead for a forward that may be a phase away
        self.pending = None
        self.slot_of = {}
        self.bound = {}
        self.running = []
        self._drop_device()

    def acquire_device(self) -> None:
        """Device buffers again after a park: resident heads copied from the host store, the first block
        prefetched."""
        self._alloc_device()
        self.fill_resident_and_start()

    def fill_resident_and_start(self) -> None:
        """Copy every block's resident head to the device, bind every tensor to its host view, prefetch the
        first block."""
        for b, roff in zip(self.layouts, self.res_offset):
            if b.resident_bytes:
                self.resident[roff : roff + b.resident_bytes].copy_(self.host.view(b.host_offset, b.resident_bytes))
            for t, view in self.host_views[b.index]:
                bind(t, view)
        self.backend.synchronize()  # slots and resident buffer were produced on the compute stream
        if self.ring and not self._deferred(self.ring[0]):
            self.schedule(self.ring[0], 0)

    def refresh(self, blocks: set[int]) -> None:
        """The host bytes of `blocks` changed (a write while offloaded): copy their resident heads to the device
        again and redo any prefetch already made of them. Orders the copies after the compute stream's work so
        far, and the compute stream's next work after them."""
        be = self.backend
        cs = be.compute_stream()
        with be.on(be.copy_stream):
            be.copy_stream.wait_stream(cs)  # the last forward may still read the resident buffer
            for l in sorted(blocks):
                b, roff = self.layouts[l], self.res_offset[l]
                if b.resident_bytes:
                    self.resident[roff : roff + b.resident_bytes].copy_(
                        self.host.view(b.host_offset, b.resident_bytes), non_blocking=be.non_blocking)
        for l in sorted(blocks):
            s = self.slot_of.get(l)
            if s is not None:  # prefetched before the write: copy it again, into the same slot
                if self.pending is not None and self.pending.block == l:
                    self.finish()
                self.schedule(l, s)
        cs.wait_stream(be.copy_stream)

    def _bound_and_host(self, l: int, positions: list[int]):
        """(the data a tensor of block l is bound to now, its host view) for these positions, where they differ."""
        for j in positions:
            t, view = self.host_views[l][j]
            cur = current(t)
            dev = raw_data(cur) if t.is_param else cur
            if dev.data_ptr() != view.data_ptr():
                yield dev, view

    def write_back(self, l: int, positions: list[int]) -> None:
        """Block l (running) wrote these of its tensors (positions in its tensor list) through their device copies:
        the host store takes their values (cast to the stored dtype where it is fp8), after the compute stream's work
        that wrote them. A feature may refuse (a weight bound to values it decoded: runtime/codecs/ahead.py)."""
        for f in self.features:
            f.writes_back(self, l, positions)
        for dev, view in self._bound_and_host(l, positions):
            view.copy_(dev)

    def copy_in(self, l: int, positions: list[int]) -> None:
        """Block l (entered) holds old device copies of these of its tensors: their host views' values, on the compute
        stream, before the block runs (those a feature brings there itself: decoded again, runtime/codecs/ahead.py)."""
        for f in self.features:
            taken = set(f.copy_in(self, l, positions))
            positions = [j for j in positions if j not in taken]
        for dev, view in self._bound_and_host(l, positions):
            dev.copy_(view)

    # ---- copies (on the copy stream)

    def _copy_head(self, b: BlockLayout, slot: torch.Tensor) -> None:
        """The resident part of the tensor straddling R_l, device to device into the slot head (if any)."""
        if b.d2d_bytes:
            A, roff = b.slot_start, self.res_offset[b.index]
            lo, hi = b.straddle_start, b.resident_bytes
            if self.obs is not None:
                self.obs.chunk_copy(b.index, lo, hi, "d2d", self.backend.copy_stream)
            slot[lo - A : hi - A].copy_(self.resident[roff + lo : roff + hi], non_blocking=self.backend.non_blocking)
            self.bytes_d2d += hi - lo

    def _copy_chunk(self, b: BlockLayout, lo: int, hi: int, slot: torch.Tensor, p: _Pending) -> None:
        if self.obs is not None:
            self.obs.chunk_copy(b.index, lo, hi, "h2d", self.backend.copy_stream)
        n = p.source.copy(slot, lo, hi)
        self.bytes_h2d += n
        self.copied[b.index] += n

    # ---- hot path

    def begin(self, l: int, s: int) -> None:
        """Start prefetching block l into slot s: the copy stream waits until compute released slot s."""
        be = self.backend
        b = self.layouts[l]
        with be.on(be.copy_stream):
            be.copy_stream.wait_event(self.free[s])
            if self.obs is not None:
                self.obs.copy_stream_waits("slot", s)
            self._copy_head(b, self.slots[s])
        self.pending = _Pending(l, s, b.chunks, b.tier.source(self.host, b, self.backend.non_blocking))  # once a block
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
                self._copy_chunk(b, lo, hi, slot, p)
        p.next += k
        return k

    def finish(self) -> None:
        """Enqueue the pending block's remaining chunks and mark it ready."""
        p = self.pending
        if p is None:
            return
        self.pump(p.left)
        with self.backend.on(self.backend.copy_stream):
            p.source.done(self.backend)
        tier = self.layouts[p.block].tier
        if tier.recycles:  # its source buffer may take the next block's bytes once these copies are done
            copied = self.backend.event()
            copied.record(self.backend.copy_stream)
            tier.release(p.block, copied)
        for f in self.features:
            f.copies_done(self, p.block, p.slot)
        self.ready[p.block].record(self.backend.copy_stream)
        if self.obs is not None:
            self.obs.block_ready(p.block)
        self.pending = None

    def schedule(self, l: int, s: int) -> None:
        """Enqueue block l's copies into slot s on the copy stream, after compute has released slot s."""
        self.begin(l, s)
        self.finish()

    def compute_wait(self, event, kind: str, block: int | None = None) -> None:
        """The compute stream waits on a copy-stream event (ready[l] or a pacing fence)."""
        if self.obs is not None:
            self.obs.compute_wait_begin(kind)
        self.backend.compute_stream().wait_event(event)
        if self.obs is not None:
            self.obs.compute_wait_end(kind, block)

    def enter(self, l: int) -> None:
        """Block l is about to run: its streamed tensors in a slot (prefetching the next), the rest resident; then
        the features (its fp8 tensors cast)."""
        if self.layouts[l].is_streamed:
            self.before(l)
        for t, view in self.resident_views[l]:
            bind(t, view)
        for f in self.features:
            f.entered(self, l)

    def own_copies(self, l: int) -> None:
        """Block l (entered) gets device tensors of its own for what it holds in a slot or the cast buffer, so that
        autograd's saved views of them outlive the slot (a block recomputed for backward); its resident head stays
        where it is (nothing overwrites it)."""
        resident = {id(t) for t, _ in self.resident_views[l]}
        for t in self.layouts[l].tensors:
            if id(t) in resident and t.compute_dtype is None:
                continue
            cur = current(t)
            bind(t, (raw_data(cur) if t.is_param else cur).clone())

    def exit(self, l: int) -> None:
        """Block l ran (or raised): release its slot, and its tensors are host views again (the slot kept for whatever
        still refers to it: `_keep_if_held`)."""
        s = self.bound.get(l)
        if s is not None:
            self.after(l)
        for f in self.features:
            f.exited(self, l)
        for t, view in self.host_views[l]:
            bind(t, view)
        if s is not None:
            self._keep_if_held(s)

    def called(self, l: int) -> None:
        """Block l was called (whether or not its own forward will run): a forward is counted at its first block."""
        if self.ring and l == self.ring[0]:  # (the first streamed block: none where nothing streams)
            self.forwards += 1

    def prefetch_first(self) -> None:
        """Between forwards: the next forward's first streamed block copied now where the last one did not prefetch
        it (a step cache skipped the blocks from some point on, so the last never began its forward): the next
        forward then waits only for what is left of that copy, as after a forward that ran whole."""
        if not self.ring or self.running:
            return
        first = self.ring[0]
        if first in self.slot_of or (self.pending is not None and self.pending.block == first):
            return
        if self._deferred(first):  # a disk block: its read started, copied when its forward comes
            return
        s = 1 if 0 in self.slot_of.values() and 1 not in self.slot_of.values() else 0
        self._evict(s)
        self.schedule(first, s)

    def skipped(self, l: int) -> None:
        """Block l's call ended without its own forward running (a step cache skipped it) and it was never entered:
        what its prefetch copied is that run's (runs.py), and nothing of it was bound or waited for."""
        self.run_bytes[l], self.copied[l] = self.copied[l], 0

    def before(self, l: int) -> None:
        if self.pending is not None:  # normally block l itself; out of order, finish it so its ready[] is right
            if self.pacer is not None and self.pending.block == l:
                self.pacer.period_end(l)
            self.finish()
        s = self.slot_of.pop(l, None)
        if s is None:  # not prefetched (blocks ran out of the declared order): load it now
            if len(set(self.running)) == 2:
                raise RuntimeError(
                    f"chunkflow: block {l} was called while two other blocks were still running (blocks nested three "
                    "deep); the two device slots are both in use. Offload the outer module's blocks only "
                    "(blocks=[...]) or use residency 1 for them.")
            s = 1 - self.running[-1] if self.running else 0
            self._evict(s)
            self.schedule(l, s)
            self.slot_of.pop(l)
        self.run_bytes[l], self.copied[l] = self.copied[l], 0  # before the next block's prefetch (itself, alone)
        self.compute_wait(self.ready[l], "ready", l)
        for t, view in self.slot_views[(l, s)]:
            bind(t, view)
        self.running.append(s)
        self.bound[l] = s
        other = 1 - s
        if other in self.running:  # called inside the block in the other slot: that slot is not free to refill
            return
        self._evict(other)
        nxt = self.next_of[l]  # the last block prefetches the first, for the next forward
        if nxt == self.ring[0] and self._deferred(nxt):
            return
        if self.pacer is None:
            self.schedule(nxt, other)
        else:
            self.begin(nxt, other)
            self.pacer.period_start(nxt)

    def after(self, l: int) -> None:
        s = self.bound.pop(l)
        self.running.remove(s)
        self.free[s].record(self.backend.compute_stream())
        if self.obs is not None:
            self.obs.slot_freed(s)
        if self.pacer is not None:
            self.pacer.block_end(l)

    def _deferred(self, l: int) -> bool:
        """Whether the next forward's first block l is left for that forward to copy: a block whose tier reads its
        bytes into a buffer (the disk ring) only has its read started here, so that no block waits on a read to
        prefetch one a forward away (block l runs when its forward comes, the read going on meanwhile), and every
        forward copies its own blocks (the same bytes each forward)."""
        b = self.layouts[l]
        if not b.tier.recycles:
            return False
        b.tier.prepare(b)
        return True

    def _evict(self, s: int) -> None:
        self.slot_of = {k: v for k, v in self.slot_of.items() if v != s}
        if self.pending is not None and self.pending.slot == s:  # a half-enqueued prefetch nobody will use
            self.pending = None

    # ---- tear-down

    def release(self) -> None:
        """The end of this layout: copies finish, every device buffer is dropped."""
        self.pending = None
        self.pacer = None
        self.backend.synchronize()
        self._drop_device()
