"""A helper of the byte holders (not a tier): bytes a layer above gives for some blocks, held in host buffers one a
key and kept across layouts by key (`KeyedHostBytes`), the host tier's way (runtime/tiers/host.py) and the shared
tier's once its first layout is in one copy per host (runtime/tiers/shared.py)."""

from __future__ import annotations

from typing import Callable

import torch

from chunkflow.runtime.store import HostStore
from chunkflow.runtime.tiers.base import Bytes, host_copy


class KeyedHostBytes:
    """The BlockBytes methods of bytes held in host buffers, one a key, kept across layouts by key: a byte holder is
    this and BlockBytes (host.py's own buffers; shared.py's views into one copy per host, made at the first layout)."""

    def __init__(self):
        self.held: dict[str, tuple[HostStore, list]] = {}  # key -> (its bytes, its row)
        self.keys: dict[int, str] = {}  # block -> key in this layout

    def keep(self, wanted: dict[int, str], make: Callable[[int], Bytes], pin: bool) -> dict[int, list]:
        self._first_layout(wanted, make, pin)
        kept = {}
        for l, key in wanted.items():
            if key not in kept:
                old = self.held.pop(key, None)
                kept[key] = old if old is not None else (host_copy(made := make(l), pin), made.row)
        self._let_go()
        self.held, self.keys = kept, dict(wanted)
        return {l: kept[key][1] for l, key in wanted.items()}

    def _first_layout(self, wanted: dict[int, str], make: Callable[[int], Bytes], pin: bool) -> None:
        """Before the first layout keeps anything: fill `held` another way (nothing here)."""

    def _let_go(self) -> None:
        for store, _row in self.held.values():
            store.release()
        self.held = {}

    def acquire(self, l: int) -> torch.Tensor:
        return self.held[self.keys[l]][0].data

    def in_memory(self, l: int) -> torch.Tensor:
        return self.acquire(l)

    def close(self) -> None:
        self._let_go()
        self.keys = {}

    def stats(self) -> dict:
        stores = [self.held[k][0] for k in self.keys.values()]
        return dict(host_bytes=sum(s.nbytes for s in stores), pinned_bytes=sum(s.pinned_bytes for s in stores))
