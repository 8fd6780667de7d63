"""What the runtime tells observers: one base class of notifications, one fan-out.

The runtime holds no instrumentation of its own. Probes, event logs and timers (`chunkflow.probes`) subclass
`Observer` and are attached with `handle.add_observer(obs)` or `with handle.observing(obs): ...`; with none
attached the hot path pays one `is None` test per notification site. Every notification is made on the host, in
program order, at the moment the runtime enqueues the work it describes (stream order, not GPU time).
"""

from __future__ import annotations


class Observer:
    """Base class: every notification is a no-op unless a subclass overrides it."""

    def chunk_copy(self, block: int, start: int, end: int, kind: str, stream) -> None:
        """A copy of block bytes [start, end) is about to be enqueued on `stream` ('h2d' chunk or 'd2d' head)."""

    def copy_stream_waits(self, on: str, slot: int | None = None) -> None:
        """The copy stream waits on the compute stream: on 'slot' (slot released) or 'collective' (the latest
        collective's end)."""

    def block_ready(self, block: int) -> None:
        """The block's last copy is enqueued and its ready event recorded on the copy stream."""

    def compute_wait_begin(self, kind: str) -> None:
        """The compute stream is about to wait on the copy stream ('ready': a block's copies; 'fence': pacing)."""

    def compute_wait_end(self, kind: str, block: int | None) -> None:
        """That wait is enqueued; `block` is the block whose copies it covers (None: every copy so far)."""

    def slot_freed(self, slot: int) -> None:
        """The compute stream released a slot (its block finished)."""

    def collective_start(self, name: str) -> None:
        """A collective is about to be issued (after any pacing fence)."""

    def collective_end(self, name: str) -> None:
        """The collective's result is complete for the compute stream (before any chunk paced after it)."""


_NOTIFICATIONS = [n for n, v in vars(Observer).items() if callable(v) and not n.startswith("_")]


class Observers(Observer):
    """Several observers as one: each notification goes to every member, in the order they were added."""

    def __init__(self, members: list[Observer]):
        self.members = list(members)


def _fan_out(name: str):
    def notify(self, *args):
        for m in self.members:
            getattr(m, name)(*args)

    notify.__name__ = name
    notify.__doc__ = getattr(Observer, name).__doc__
    return notify


for _name in _NOTIFICATIONS:
    setattr(Observers, _name, _fan_out(_name))
