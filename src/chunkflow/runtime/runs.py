"""Which blocks computed and which were skipped, and what the skipped ones cost in copies.

A cache (diffusers' `enable_cache`: first-block, MagCache, TaylorSeer lite, SeaCache) skips a block by replacing
the forward its call runs, not the call: the block is still entered, its weights copied and bound, and its own
forward never runs. The block hooks see whether it ran (runtime/hooks.py, the noting forward) and tell the handle
at each block's exit; the streamer says how many bytes it copied host to device for that run of the block
(`Streamer.run_bytes`). Counted here: in total, per top-level forward of the offloaded module (the last
`KEEP` forwards), and per block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

KEEP = 65536  # forwards whose counts are kept (a serving process runs forever; a generation runs a few hundred)


@dataclass(frozen=True)
class ForwardRuns:
    """One top-level forward: its blocks that computed, and the names of those skipped."""

    computed: int
    skipped: tuple[str, ...]


class BlockRuns:
    """Counts of block runs, computed and skipped, and the H2D bytes copied for the skipped ones."""

    def __init__(self) -> None:
        self.computed = 0
        self.skipped = 0
        self.skipped_h2d_bytes = 0  # copied host to device for block runs whose forward did not run
        self.skipped_by_block: dict[str, int] = {}  # block name -> runs it was skipped in
        self.forwards: deque[ForwardRuns] = deque(maxlen=KEEP)
        self.forwards_done = 0  # top-level forwards recorded so far (more than `forwards` holds once it is full)
        self._computed_now = 0
        self._skipped_now: list[str] = []

    def begin(self) -> None:
        """A top-level forward of the offloaded module starts."""
        self._computed_now, self._skipped_now = 0, []

    def block(self, name: str, ran: bool, h2d_bytes: int) -> None:
        """Block `name` exited: its forward ran or not; `h2d_bytes` were copied for this run of it."""
        if ran:
            self.computed += 1
            self._computed_now += 1
            return
        self.skipped += 1
        self.skipped_h2d_bytes += h2d_bytes
        self.skipped_by_block[name] = self.skipped_by_block.get(name, 0) + 1
        self._skipped_now.append(name)

    def done(self) -> None:
        """The top-level forward completed: its counts are kept."""
        self.forwards.append(ForwardRuns(self._computed_now, tuple(self._skipped_now)))
        self.forwards_done += 1
        self.begin()

    def since(self, forwards_done: int) -> list[ForwardRuns]:
        """The forwards recorded after the first `forwards_done` (those still kept)."""
        new = self.forwards_done - forwards_done
        return list(self.forwards)[-new:] if new > 0 else []
