"""The host tier: a block's tail in the pinned host store with its head, chunks copied straight from the store; bytes
a layer above gives it for some blocks (a codec's encoded tails), one pinned buffer a block (`HostBytes`); and a parked
module's non-block tensors in one host allocation (`HostParking`).

Everything the interface's defaults do (runtime/tiers/base.py) is this tier's way; it takes every block no other tier
took, so it is last in the registry."""

from __future__ import annotations

import torch

from chunkflow.runtime.store import HostStore
from chunkflow.runtime.tiers.base import BlockBytes, ByteKind, Bytes, ParkHome, Tier, host_copy
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


class HostBytes(BlockBytes):
    """Bytes given for some blocks, each block's in a host buffer of its own (page-locked on CUDA), kept by key
    across layouts."""

    def __init__(self):
        self.held: dict[str, tuple[HostStore, list]] = {}  # key -> (its bytes, its row)
        self.keys: dict[int, str] = {}  # block -> key in this layout

    def keep(self, wanted: dict[int, str], make, pin: bool) -> dict[int, list]:
        kept = {}
        for l, key in wanted.items():
            if key not in kept:
                kept[key] = self.held.pop(key, None) or self._put(make(l), pin)
        for store, _row in self.held.values():
            store.release()
        self.held, self.keys = kept, dict(wanted)
        return {l: kept[key][1] for l, key in wanted.items()}

    @staticmethod
    def _put(made: Bytes, pin: bool) -> tuple[HostStore, list]:
        return host_copy(made, pin), made.row

    def acquire(self, l: int) -> torch.Tensor:
        return self.held[self.keys[l]][0].data

    def in_memory(self, l: int) -> torch.Tensor:
        return self.acquire(l)

    def close(self) -> None:
        for store, _row in self.held.values():
            store.release()
        self.held, self.keys = {}, {}

    def stats(self) -> dict:
        stores = [self.held[k][0] for k in self.keys.values()]
        return dict(host_bytes=sum(s.nbytes for s in stores), pinned_bytes=sum(s.pinned_bytes for s in stores))


class HostParking(HostCopies, ParkHome):
    """A parked module's non-block tensors in host memory: one allocation (pinned on CUDA), kept for the next park,
    where a tensor not written since the last unpark is not copied again (runtime/tiers/hostcopies.py)."""

    name = "host"

    @classmethod
    def for_setting(cls, park_to: str, source, cfg=None) -> HostParking | None:
        return cls() if park_to in ("host", "shared") else None
