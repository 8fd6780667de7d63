"""What one block prefetch copies its chunks from: a tier's answer to `Tier.source` (runtime/tiers/base.py), asked
once a block so that the streamer's chunk loop calls no tier. The plain one slices a flat host buffer; a codec's
(runtime/codecs/stream.py) copies encoded bytes and decodes them as the block's chunks are enqueued."""

from __future__ import annotations

import torch


class ChunkSource:
    """What one block prefetch copies from (`Tier.source`): `copy` enqueues chunk [lo, hi) of the block into its slot
    on the copy stream (the current stream when called) and returns the bytes it sent over the host link; `done`
    follows the block's last chunk, before its ready event is recorded on the copy stream."""

    __slots__ = ("src", "at", "slot_start", "non_blocking")

    def __init__(self, src: torch.Tensor, at: int, slot_start: int, non_blocking: bool):
        self.src, self.at = src, at  # byte lo of the block at src[lo - at]
        self.slot_start = slot_start  # the block byte at the slot's byte 0
        self.non_blocking = non_blocking

    def copy(self, slot: torch.Tensor, lo: int, hi: int) -> int:
        A = self.slot_start
        slot[lo - A : hi - A].copy_(self.src[lo - self.at : hi - self.at], non_blocking=self.non_blocking)
        return hi - lo

    def done(self, backend) -> None:
        """The block's chunks are all enqueued."""
