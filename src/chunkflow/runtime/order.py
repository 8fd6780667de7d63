"""The blocks' execution order, checked on the first forward.

The streamer prefetches block l+1 of the layout while block l runs, so a layout in another order than the
forward's copies blocks it then evicts unused (exact, since a block not prefetched is loaded when it is entered,
but up to twice the bytes). The first complete forward of the offloaded module notes the order its blocks are
first entered; where it is not the layout's, the handle lays the blocks out again in that order (blocks it did not
enter, a branch not taken, after them, in their order), so every later forward copies each block once. A forward
that skips blocks but enters the others in the layout's order keeps the layout; one that enters none (or raises) is
not the one checked. A block entered more than once in a forward is copied each time it runs: a warning says so.
"""

from __future__ import annotations


class ExecutionOrder:
    """What the first forward entered, and whether it has been checked. Survives re-layouts (the handle's)."""

    def __init__(self):
        self.checked = False
        self.entered: list[int] = []  # layout indices in the order they were entered, this forward
        self.repeated = False

    def begin(self) -> None:
        """A top-level forward starts (its last one may have raised before it was checked)."""
        self.entered = []
        self.repeated = False

    def enter(self, l: int) -> bool:
        """Block l is entered inside a top-level forward; True where it is the first block of a forward whose order
        is not checked yet (its first block may not be the layout's first)."""
        if self.checked:
            return False
        if l in self.entered:
            self.repeated = True
        else:
            self.entered.append(l)
        return len(self.entered) == 1 and not self.repeated

    def done(self, n_blocks: int) -> list[int] | None:
        """The forward completed: the observed order as a permutation of the layout's indices where it differs
        from the layout (then the handle re-lays out), else None. Checked once."""
        if self.checked or not self.entered:
            return None
        self.checked = True
        if self.repeated:
            from chunkflow.runtime.errors import warn_user

            warn_user("chunkflow: a block ran more than once in one forward of the offloaded module; its weights are "
                      "copied to the device each time it runs")
        if self.entered == sorted(self.entered):  # the layout's order (blocks skipped, if any, by a branch)
            return None
        seen = set(self.entered)
        return self.entered + [l for l in range(n_blocks) if l not in seen]
