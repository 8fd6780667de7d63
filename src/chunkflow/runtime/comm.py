"""Communication awareness: see every collective the model issues, and keep chunk copies out of them.

Interception (`CollectiveTap`). While a handle lives, the collectives of `torch.distributed` (c10d: all_to_all,
all_gather, all_reduce, reduce_scatter, broadcast, ...) and of `torch.distributed._functional_collectives`
(all_to_all_single, all_gather_tensor, all_reduce, reduce_scatter_tensor, their autograd and coalesced forms,
...) are wrapped by module attribute; `remove()` puts the very same function objects back. Callers that look the
function up at call time (diffusers' `funcol.all_to_all_single`, `dist.all_gather`, DTensor) are seen; a caller
that did `from torch.distributed import all_reduce` before the handle existed keeps the original (not seen).
A TorchDispatchMode would see every op whatever its import path, but it costs a Python call per op of the
whole model; wrapping a dozen functions costs nothing outside collectives.

Each wrapped call is bracketed: `listener.collective_start(name)` before it, then the call, then its result is
made complete *for the compute stream* (an AsyncCollectiveTensor is waited, an async_op Work is waited; on NCCL
that is a stream wait, not a host sync), then `listener.collective_end(name)`. Waiting eagerly costs no overlap
for diffusers' Ulysses attention, which waits each all-to-all on the next line anyway.

Pacing (`CommPacer`, design (a): chunks placed into the compute windows between collectives). The CPU runs
ahead of the GPU, so "a collective is running now" is not a host-side fact. Instead everything is expressed as
stream order, decided on the host when the collective is launched:
  * at a collective's start, if chunks were enqueued since the last fence, the compute stream waits on a fence
    event recorded on the copy stream after them, then E_start is recorded on the compute stream;
  * at its end (result waited), E_end is recorded on the compute stream and the copy stream waits on E_end
    before the next window's chunks are enqueued.
So on the GPU no chunk copy can run between a collective's start and its end: copies before it are fenced,
copies after it wait for E_end. No copy in flight is aborted (a window's chunks are never cut; the fence
waits for them). To keep the fences from stalling compute, each window gets only the chunks that fit in it:
the budget of window w of block m's prefetch period is margin * duration_w * bandwidth, both measured in the
previous forward from timing events on the two streams (read only once `query()` says they are done: no host
sync); the last window (after the period's last collective, where only the block-boundary `ready` wait
follows) takes the rest. First forward (nothing measured): every window gets no chunk and the whole block is
enqueued at the end of the block that prefetches it; from the second forward on the budgets apply. With no
collective in a period the only window is the first one and the block is enqueued at once, as without
awareness. Overhead per collective: two or three event records and one or two stream waits on the host
(a few microseconds), nothing on the GPU beyond the stalls it is designed to take.

What the pacer and the tap see is also told to the handle's observers (runtime/observe.py): the event log in
`chunkflow.probes` checks from it that no copy can overlap a collective. `CommAwareness` is the handle's part
(runtime/feature.py) that holds the pacer and the tap and listens to the tap.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from chunkflow.runtime.feature import HandleFeature
from chunkflow.runtime.observe import Observer
from chunkflow.timing import EventPool
from chunkflow_planner.offload import PACING_MARGIN

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle

# --------------------------------------------------------------------------------------------- interception

FUNCOL_NAMES = ("all_to_all_single", "all_to_all_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd",
                "all_gather_single", "all_gather_single_autograd", "all_reduce", "reduce_scatter_tensor",
                "reduce_scatter_tensor_autograd", "reduce_scatter_single", "reduce_scatter_single_autograd",
                "permute_tensor", "broadcast", "all_reduce_coalesced", "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter_single_coalesced")
C10D_NAMES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
              "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter")


def _complete(out):
    """Make a collective's result complete for the current stream; returns what the caller should get."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(out, AsyncCollectiveTensor):
        return out.wait()
    if isinstance(out, list) and out and isinstance(out[0], AsyncCollectiveTensor):
        return [o.wait() for o in out]
    wait = getattr(out, "wait", None)  # c10d Work (async_op=True)
    if callable(wait) and not isinstance(out, torch.Tensor):
        wait()
    return out


class CollectiveTap:
    """Wraps the collectives by module attribute while installed; tells `listener` each one's start and end."""

    def __init__(self, listener):
        self.listener = listener
        self.saved: list[tuple[object, str, object]] = []  # (module, name, original)
        self._depth = 0  # a collective issued inside another (DTensor -> funcol) is reported once

    @property
    def installed(self) -> bool:
        return bool(self.saved)

    def _wrap(self, orig, name: str):
        tap = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if tap._depth:
                return orig(*args, **kwargs)
            tap._depth += 1
            try:
                tap.listener.collective_start(name)
                try:
                    return _complete(orig(*args, **kwargs))
                finally:
                    tap.listener.collective_end(name)
            finally:
                tap._depth -= 1

        wrapper._chunkflow_original = orig
        return wrapper

    def install(self) -> None:
        if self.saved or not torch.distributed.is_available():
            return
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        targets = [(funcol, n, f"funcol.{n}") for n in FUNCOL_NAMES]
        targets += [(mod, n, n) for n in C10D_NAMES for mod in (c10d, dist)]
        wrappers: dict[int, object] = {}  # one wrapper per original (dist.x is c10d.x)
        for mod, n, label in targets:
            orig = getattr(mod, n, None)
            if orig is None:
                continue
            if id(orig) not in wrappers:
                wrappers[id(orig)] = self._wrap(orig, label)
            self.saved.append((mod, n, orig))
            setattr(mod, n, wrappers[id(orig)])

    def remove(self) -> None:
        for mod, n, orig in reversed(self.saved):
            setattr(mod, n, orig)
        self.saved = []


def dist_active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


# --------------------------------------------------------------------------------------------- pacing


class _Period:
    """Timing of one prefetch period (block m's prefetch: from the start of the block before it to m's start)."""

    __slots__ = ("block", "compute", "copies", "n_coll", "closed", "nbytes")

    def __init__(self, block: int, cuda: bool):
        self.block = block
        self.compute = EventPool(cuda)  # T0, (E_start, E_end) per collective, T_end
        self.copies = EventPool(cuda)  # (C0, C1) around each non-empty pump
        self.n_coll = 0
        self.closed = False
        self.nbytes = 0  # H2D bytes pumped between the (C0, C1) pairs


class CommPacer:
    """Paces a Streamer's chunks around collectives (see the module docstring); the handle forwards the tap's
    collective starts and ends to it. `margin`, `window_chunks` and `strict` are the pacing policy's knobs."""

    margin = PACING_MARGIN  # fraction of a measured window a budget may fill (the planner assumes the same)
    default_bw = 20e6  # bytes per ms (20 GB/s) until a copy has been measured

    def __init__(self, streamer):
        from chunkflow.runtime.streamer import CudaBackend

        self.s = streamer
        self.be = streamer.backend
        self.cuda = isinstance(self.be, CudaBackend)
        self.window_chunks: int | None = None  # fixed chunks per window (tests, ablation); None: measured
        self.fence = self.be.event()
        self.unfenced = False
        self.period: _Period | None = None
        self.last: dict[int, _Period] = {}  # block -> its previous, closed period (events reused next time)
        self.plan: dict[int, list[int]] = {}  # block -> chunks per window before the last collective
        self.bw = None  # measured bytes per ms
        self.end_ev = self.be.event()  # E_end of a collective outside any prefetch period
        self.need_wait = None  # the latest collective's end event, not yet waited on by the copy stream
        self.strict = False  # True: always yield, even when the compute windows cannot hold a block's prefetch
        self.eager: set[int] = set()  # blocks whose prefetch does not fit in the compute windows: not paced

    # ---- streamer side

    def period_start(self, m: int) -> None:
        old = self.last.get(m)
        if old is not None and old.closed:
            self._learn(old)
        p = old if old is not None else _Period(m, self.cuda)
        p.compute.n = p.copies.n = p.n_coll = p.nbytes = 0
        p.closed = False
        p.compute.next().record(self.be.compute_stream())
        self.period = p
        self.last[m] = p
        if m in self.eager and self.window_chunks is None and self.s.pending is not None:
            # Prefetch-bound: pausing would expose more transfer than the collectives lose to contention. The
            # whole block goes now, unfenced and untimed (its copies share the link: not a bandwidth sample).
            self.before_chunks()
            self.s.pump(self.s.pending.left)
            return
        self._pump(self._budget(0))

    def period_end(self, m: int) -> None:
        p = self.period
        if p is not None and p.block == m:
            p.compute.next().record(self.be.compute_stream())
            p.closed = True
            self.period = None

    def block_end(self, l: int) -> None:
        pend = self.s.pending
        if pend is not None and (self.window_chunks is not None or pend.block not in self.plan):
            self._pump(pend.left)  # not measured yet: the rest now, after this block's last collective

    def _pump(self, n: int) -> None:
        if n <= 0 or self.s.pending is None:
            return
        p = self.period
        self.before_chunks()  # the copy stream's wait on the last collective goes before C0: not counted as copy time
        if p is not None:
            p.copies.next().record(self.be.copy_stream)
        k = self.s.pump(n)
        if p is not None:
            p.copies.next().record(self.be.copy_stream)
            p.nbytes += self._bytes_of(k)
        if k:
            self.unfenced = True

    def before_chunks(self) -> None:
        """Called by the streamer before it enqueues chunks (any block): none before the last collective's end."""
        if self.need_wait is not None:
            self.be.copy_stream.wait_event(self.need_wait)
            if self.s.obs is not None:
                self.s.obs.copy_stream_waits("collective")
            self.need_wait = None

    def _bytes_of(self, k: int) -> int:
        pend = self.s.pending
        return sum(hi - lo for lo, hi in pend.chunks[pend.next - k : pend.next])

    # ---- tap side

    def collective_start(self, name: str) -> None:
        if self.unfenced:
            self.fence.record(self.be.copy_stream)
            self.s.compute_wait(self.fence, "fence", None)
            self.unfenced = False
        p = self.period
        if p is not None:
            p.compute.next().record(self.be.compute_stream())

    def collective_end(self, name: str) -> None:
        cs = self.be.compute_stream()
        p = self.period
        if p is not None:
            ee = p.compute.next()
            p.n_coll += 1
        else:
            ee = self.end_ev
        ee.record(cs)
        self.need_wait = ee  # the copy stream waits on it before its next chunk, whichever block
        self._pump(self._budget(p.n_coll if p is not None else 0))

    # ---- budgets

    def _budget(self, w: int) -> int:
        pend = self.s.pending
        if pend is None:
            return 0
        if self.window_chunks is not None:
            return self.window_chunks
        plan = self.plan.get(pend.block)
        if plan is None:
            return 0
        return plan[w] if w < len(plan) else pend.left

    def _learn(self, p: _Period) -> None:
        """Window durations and copy bandwidth from p's events, if the GPU has passed them (no host sync)."""
        ev = p.compute.used()
        cp = p.copies.used()
        if len(ev) < 2 or not ev[-1].query() or (cp and not cp[-1].query()):
            return
        t = [ev[0].elapsed_time(e) for e in ev]  # T0=0, Es1, Ee1, ..., Tend
        K = p.n_coll
        bounds = [0.0] + [x for i in range(K) for x in (t[1 + 2 * i], t[2 + 2 * i])] + [t[-1]]
        windows = [max(0.0, bounds[2 * w + 1] - bounds[2 * w]) for w in range(K + 1)]
        b = self.s.layouts[p.block]
        if cp:
            ms = sum(cp[2 * i].elapsed_time(cp[2 * i + 1]) for i in range(len(cp) // 2))
            if ms > 0 and p.nbytes > 0:
                self.bw = p.nbytes / ms
        bw = self.bw or self.default_bw
        need = sum(hi - lo for lo, hi in b.chunks)
        if not self.strict and need > self.margin * sum(windows) * bw:
            # The compute windows of this period cannot hold the block's transfer even with every byte placed:
            # yielding would turn contention into a longer exposed prefetch. Issue this block's chunks at once.
            self.eager.add(p.block)
            self.plan.pop(p.block, None)
            return
        self.eager.discard(p.block)
        plan, i = [], 0
        for w in range(K):
            cap, acc, n = self.margin * windows[w] * bw, 0, 0
            while i < len(b.chunks) and acc + (b.chunks[i][1] - b.chunks[i][0]) <= cap:
                acc += b.chunks[i][1] - b.chunks[i][0]
                i += 1
                n += 1
            plan.append(n)
        self.plan[p.block] = plan


# --------------------------------------------------------------------------------------------- the handle's part


class CommAwareness(HandleFeature):
    """A handle's pacer (chunkflow mode, comm_aware, under torch.distributed with a ring to pace) and the tap,
    installed while the pacer or an observer wants it; the tap's listener, which tells both of each collective."""

    def __init__(self):
        self.pacer: CommPacer | None = None
        self.tap: CollectiveTap | None = None
        self.obs: Observer | None = None

    def configure(self, handle: OffloadHandle, obs: Observer | None) -> None:
        """Pacer and tap as the handle's setting and its observers (`obs`: all of them as one, or None) ask; the
        streamer gets the pacer at its next block boundary."""
        s, cfg = handle.streamer, handle.cfg
        self.obs = obs
        pace = s is not None and cfg.mode == "chunkflow" and cfg.comm_aware and bool(s.ring) and dist_active()
        if pace and (self.pacer is None or self.pacer.s is not s):
            self.pacer = CommPacer(s)
        elif not pace:
            self.pacer = None
        if s is not None:
            s.pacer = self.pacer
        want_tap = dist_active() and (self.pacer is not None or obs is not None)
        if want_tap and self.tap is None:
            self.tap = CollectiveTap(self)
            self.tap.install()
        elif not want_tap and self.tap is not None:
            self.tap.remove()
            self.tap = None

    def attach(self, handle: OffloadHandle) -> None:
        self.configure(handle, handle.obs)

    def detach(self, handle: OffloadHandle) -> None:
        self.pacer = None  # it paces the streamer of the layout that goes

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        if self.tap is not None:  # the original collective functions back, exactly
            self.tap.remove()
        self.tap = self.pacer = None
        self.obs = None

    def collective_start(self, name: str) -> None:
        """Told by the tap before a collective: the pacer fences its chunks, then observers hear of it."""
        if self.pacer is not None:
            self.pacer.collective_start(name)
        if self.obs is not None:
            self.obs.collective_start(name)

    def collective_end(self, name: str) -> None:
        if self.obs is not None:
            self.obs.collective_end(name)
        if self.pacer is not None:
            self.pacer.collective_end(name)
