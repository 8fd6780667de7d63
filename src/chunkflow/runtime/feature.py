"""The two seams a runtime feature plugs into: the handle's lifetime and a streamed block's boundaries.

A feature (fp8 storage, write watching, communication awareness, parking, the tiers of runtime/tiers/) is one small object in a
module of its own. `HandleFeature` is what the handle calls on it: `attach` each time the blocks are laid out and
streaming starts (at offload and after every re-layout), `detach` before that layout goes, `close` once when the
handle ends. `BlockFeature` is what the streamer calls where a feature acts on the device around each block: the
streamer holds a list of them, empty unless a feature needs it, so a feature costs the hot path nothing when unused.
Every hook is a no-op here; a feature overrides the ones it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle
    from chunkflow.runtime.streamer import Streamer


class HandleFeature:
    """One feature of an offloaded module, registered on its handle (`handle.features`). Hooks are called in
    registration order, `detach` in reverse."""

    def attach(self, handle: OffloadHandle) -> None:
        """The blocks were laid out, the host store filled and streaming started (`handle.layouts`,
        `handle.streamer`: None in mode none)."""

    def detach(self, handle: OffloadHandle) -> None:
        """The layout is about to go (a re-layout, remove, discard): drop what refers to it."""

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        """The handle ends, before its last `detach`: undo what the feature installed for the handle's lifetime.
        restore: `remove()` (the module is given back as it was); else `discard()` (it is left without weights)."""


class BlockFeature:
    """Work a feature does on the device around each block the streamer binds (one call per block per hook)."""

    def allocate(self, streamer: Streamer) -> None:
        """The streamer's device buffers and views were made (at start-up and after a park)."""

    def release(self, streamer: Streamer) -> None:
        """The streamer gave its device buffers back (a park, the end of the layout)."""

    def copies_done(self, streamer: Streamer, block: int, slot: int) -> None:
        """Every copy of `block` into `slot` is enqueued on the copy stream; its ready event comes next."""

    def entered(self, streamer: Streamer, block: int) -> None:
        """`block`'s tensors are bound to the device (slot and resident buffer); it runs next."""

    def exited(self, streamer: Streamer, block: int) -> None:
        """`block` ran and released its slot; its tensors are bound to the host store next."""

    def copy_in(self, streamer: Streamer, block: int, positions: list[int]) -> list[int]:
        """The entered `block`'s tensors at `positions` (in its tensor list) take their host values anew: returns
        those the feature brought to the device itself (the streamer copies the rest into what they are bound to)."""
        return []

    def writes_back(self, streamer: Streamer, block: int, positions: list[int]) -> None:
        """The running `block` wrote its tensors at `positions` through what they are bound to; the host store takes
        their values next (a feature may refuse, OffloadError)."""

    def slot_renewed(self, streamer: Streamer, slot: int) -> None:
        """The streamer took a new buffer for `slot` (the old one is held by a tensor taken inside a forward):
        views of it must be made again."""
