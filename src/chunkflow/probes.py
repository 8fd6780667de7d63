"""Instrumentation for tests and benchmarks: observers of an offload handle (runtime/observe.py).

Attach any of them to a live handle, for its life or for a block of code:

    log = EventLog(cuda=True)
    with handle.observing(log, StallTimer(cuda=True)):
        model(**inputs)
    assert not log.stream_violations()

- `ChunkLog`: every copy the runtime enqueued (block, byte range, 'h2d' or 'd2d'), in issue order.
- `EventLog`: copies, collective starts and ends, compute-stream waits on the copy stream and slot releases, in
  program order with stream-ordering information: a copy's `after` (the latest compute-stream mark the copy stream
  waited on before it) and a wait's `cseq` (the copies it covers). `stream_violations()` finds every (copy,
  collective) pair the streams allow to overlap: the copy is not ordered after the collective's end and the
  collective's start is not ordered after the copy. That is the GPU's guarantee, whatever the timing; on CUDA the
  log also records timing events, and `time_violations()` (after `resolve()`) reports copies whose measured start
  fell inside a measured collective.
- `StallTimer`: time the compute stream spends waiting on the copy stream ('ready': a block's copies not done;
  'fence': communication awareness).
- `CollectiveTimer`: time inside the model's collectives (excluding the awareness fences before them).

Reading a timer synchronizes the device: do it between steps, never inside one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkflow.runtime.observe import Observer
from chunkflow.timing import EventPool, timing_event


def _compute_stream(cuda: bool):
    if not cuda:
        return None
    import torch

    return torch.cuda.current_stream()


# ------------------------------------------------------------------------------------------------ chunk log


@dataclass(frozen=True)
class ChunkCopy:
    """One copy the runtime enqueued: block-relative byte range [start, end), 'h2d' or 'd2d', issue order."""

    order: int
    block: int
    start: int
    end: int
    kind: str


class ChunkLog(Observer, list):
    """The copies enqueued while attached, as ChunkCopy records (a list)."""

    def __init__(self):
        list.__init__(self)
        self._order = 0

    def chunk_copy(self, block: int, start: int, end: int, kind: str, stream) -> None:
        self.append(ChunkCopy(self._order, block, start, end, kind))
        self._order += 1


# ------------------------------------------------------------------------------------------------ event log


@dataclass
class Event:
    seq: int  # program order
    kind: str  # copy | coll_start | coll_end | wait | free | ready
    block: int = -1
    start: int = 0
    end: int = 0
    name: str = ""
    mark: int = -1  # position on the compute stream (compute-side entries)
    after: int = -1  # copy: latest compute mark the copy stream waited on before it
    cseq: int = -1  # copy: position on the copy stream; wait/ready: last copy covered
    t_ms: float | None = None  # GPU time (CUDA, after resolve()), relative to the first timed entry
    gpu: object = field(default=None, repr=False)


class EventLog(Observer):
    """Program-order log of what the runtime enqueued on the two streams (see the module docstring)."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.events: list[Event] = []
        self._mark = 0
        self._cseq = 0
        self._after = -1
        self._ready_cover: dict[int, int] = {}
        self._free_mark: dict[int, int] = {}  # slot -> compute mark of its latest release
        self._last_end = -1  # compute mark of the latest collective end

    def _add(self, kind: str, stream=None, **kw) -> Event:
        e = Event(len(self.events), kind, **kw)
        if self.cuda and stream is not None:
            e.gpu = timing_event(True)
            e.gpu.record(stream)
        self.events.append(e)
        return e

    def _next_mark(self) -> int:
        self._mark += 1
        return self._mark

    # ---- notifications (Observer)

    def chunk_copy(self, block: int, start: int, end: int, kind: str, stream=None) -> None:
        if kind != "h2d":
            return
        self._cseq += 1
        self._add("copy", stream, block=block, start=start, end=end, after=self._after, cseq=self._cseq)

    def copy_stream_waits(self, on: str, slot: int | None = None) -> None:
        mark = self._free_mark.get(slot, -1) if on == "slot" else self._last_end
        self._after = max(self._after, mark)

    def block_ready(self, block: int) -> None:
        self._ready_cover[block] = self._cseq
        self._add("ready", block=block, cseq=self._cseq)

    def compute_wait_end(self, kind: str, block: int | None) -> None:
        cover = self._ready_cover.get(block, self._cseq) if block is not None else self._cseq
        self._add("wait", name=kind, mark=self._next_mark(), cseq=cover)

    def slot_freed(self, slot: int) -> None:
        self._free_mark[slot] = self._add("free", mark=self._next_mark()).mark

    def collective_start(self, name: str) -> None:
        self._add("coll_start", _compute_stream(self.cuda), name=name, mark=self._next_mark())

    def collective_end(self, name: str) -> None:
        self._last_end = self._add("coll_end", _compute_stream(self.cuda), name=name, mark=self._next_mark()).mark

    # ---- checks

    def copies(self) -> list[Event]:
        return [e for e in self.events if e.kind == "copy"]

    def collectives(self) -> list[tuple[Event, Event]]:
        out, open_ = [], None
        for e in self.events:
            if e.kind == "coll_start":
                open_ = e
            elif e.kind == "coll_end" and open_ is not None:
                out.append((open_, e))
                open_ = None
        return out

    def stream_violations(self) -> list[tuple[Event, Event]]:
        """(copy, collective start) pairs that the stream order lets overlap on the GPU."""
        waits = [e for e in self.events if e.kind == "wait"]
        bad = []
        for c in self.copies():
            covered = next((w.mark for w in waits if w.cseq >= c.cseq), float("inf"))
            for s, e in self.collectives():
                if c.after < e.mark and covered > s.mark:
                    bad.append((c, s))
        return bad

    def program_violations(self) -> list[Event]:
        """Copies enqueued (program order) between a collective's start and its end."""
        inside, bad = False, []
        for e in self.events:
            if e.kind == "coll_start":
                inside = True
            elif e.kind == "coll_end":
                inside = False
            elif e.kind == "copy" and inside:
                bad.append(e)
        return bad

    def resolve(self) -> None:
        """GPU times of the timed entries (CUDA; synchronizes the device)."""
        timed = [e for e in self.events if e.gpu is not None]
        if not timed:
            return
        import torch

        torch.cuda.synchronize()  # events on both streams
        t0 = timed[0].gpu
        for e in timed:
            e.t_ms = t0.elapsed_time(e.gpu)

    def time_violations(self) -> list[tuple[Event, Event]]:
        """(copy, collective start) pairs where the copy's measured GPU start fell inside the collective."""
        bad = []
        for c in self.copies():
            if c.t_ms is None:
                continue
            for s, e in self.collectives():
                if s.t_ms is not None and e.t_ms is not None and s.t_ms < c.t_ms < e.t_ms:
                    bad.append((c, s))
        return bad


# ------------------------------------------------------------------------------------------------ timers


class _Intervals(Observer):
    """Timing events in (begin, end) pairs on the compute stream, summed by kind."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pool = EventPool(cuda)
        self.kinds: list[str] = []

    def _begin(self) -> None:
        self.pool.next().record(_compute_stream(self.cuda))

    def _end(self, kind: str) -> None:
        self.pool.next().record(_compute_stream(self.cuda))
        self.kinds.append(kind)

    def reset(self) -> None:
        self.pool.reset()
        self.kinds = []

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per kind since the last reset (synchronizes on the last event)."""
        ev = self.pool.used()
        out: dict[str, float] = {}
        if ev:
            ev[-1].synchronize()
        for i, k in enumerate(self.kinds):
            out[k] = out.get(k, 0.0) + ev[2 * i].elapsed_time(ev[2 * i + 1])
        return out


class StallTimer(_Intervals):
    """Milliseconds the compute stream waited on the copy stream, by kind: 'ready' and 'fence'."""

    def compute_wait_begin(self, kind: str) -> None:
        self._begin()

    def compute_wait_end(self, kind: str, block: int | None) -> None:
        self._end(kind)

    def totals(self) -> dict[str, float]:
        return {"ready": 0.0, "fence": 0.0, **self.totals_ms()}


class CollectiveTimer(_Intervals):
    """Milliseconds inside the model's collectives, and how many there were, since the last reset."""

    def collective_start(self, name: str) -> None:
        self._begin()

    def collective_end(self, name: str) -> None:
        self._end("collective")

    @property
    def count(self) -> int:
        return len(self.kinds)

    def total_ms(self) -> float:
        return self.totals_ms().get("collective", 0.0)
