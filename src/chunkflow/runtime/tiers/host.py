"""The host tier: a block's tail in the pinned host store with its head, chunks copied straight from the store; bytes
a layer above gives it for some blocks (a codec's encoded tails), one pinned buffer a block (`HostBytes`); and a parked
module's non-block tensors in one host allocation (`HostParking`).

Everything the interface's defaults do (runtime/tiers/base.py) is this tier's way; it takes every block no other tier
took, so it is last in the registry."""

from __future__ import annotations

from chunkflow.runtime.tiers.base import BlockBytes, ByteKind, ParkHome, Tier
from chunkflow.runtime.tiers.keyed import KeyedHostBytes
from chunkflow.runtime.tiers.hostcopies import HostCopies


class HostTier(Tier):
    name = "host"

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> HostTier:
        return cls()

    def claim(self, b) -> bool:
        return True

    def hold_bytes(self, kind: ByteKind) -> HostBytes:
        """This tier holding bytes given to it (BlockBytes)."""
        return HostBytes()


class HostBytes(KeyedHostBytes, BlockBytes):
    """Bytes given for some blocks, each block's in a host buffer of its own (page-locked on CUDA), kept by key
    across layouts."""


class HostParking(HostCopies, ParkHome):
    """A parked module's non-block tensors in host memory: one allocation (pinned on CUDA), kept for the next park,
    where a tensor not written since the last unpark is not copied again (runtime/tiers/hostcopies.py)."""

    name = "host"

    @classmethod
    def for_setting(cls, park_to: str, source, cfg=None) -> HostParking | None:
        return cls() if park_to in ("host", "shared") else None
