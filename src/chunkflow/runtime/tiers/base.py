"""The seam for where a block's streamed tail [R_l, V_l) lives and how its chunks reach the device.

Every block keeps its resident head [0, R_l) in the host store (copied to the device's resident buffer once); a
tier owns the tail. The handle asks each tier, in the registry's order (runtime/tiers/__init__.py), whether it takes
a block while the layout is made (`claim`), so a layout is built once with every block's tier known; the host tier
takes whatever no other tier did. The rest of the runtime talks to a block's tier through `BlockLayout.tier` only:

- layout:   `host_extent(b)` is the host-store bytes the block takes (its place in the store);
- filling:  `supply(store, b, e, write)` says whether the tier holds tensor e (else its value is written into the
            store), writing its bytes in the head, if any, into the store;
- outside the forward: `view(store, b, e)` is what tensor e is (a view of the store, a map of a file, ...);
- streaming: `source(store, b)` once per block prefetch gives the block's `ChunkSource`, which copies chunk [lo, hi)
            into the slot with no per-chunk dispatch to the tier (the default: `acquire(store, b)`'s flat uint8
            source and the block byte it starts at, chunk [lo, hi) being `src[lo - at : hi - at]`); `done()` after
            the block's last chunk (a codec decodes there); a tier whose source is reused (`recycles`) is told by
            `release(l, copied)` when an event on the copy stream follows the block's copies.

A tier is a HandleFeature too (attach, detach, close), with `verify` (its backing still as it was), `demote` (blocks
written or given new tensors leave it at the next layout), `check_dtypes` (a dtype change it cannot hold, refused
before anything changes) and `stats` (its OffloadStats fields).

A tier may also keep a module's non-block tensors while it is parked (runtime/parking.py): `ParkHome`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from chunkflow.runtime.chunksource import ChunkSource
from chunkflow.runtime.feature import HandleFeature

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle
    from chunkflow.runtime.layout import BlockLayout, TensorEntry
    from chunkflow.runtime.store import HostStore
    from chunkflow.runtime.tensors import ModuleTensor


class Tier(HandleFeature):
    """Where some blocks' streamed tails live (module docstring). Subclasses set `name` and override what differs
    from the host store's way."""

    name: ClassVar[str] = ""
    recycles: ClassVar[bool] = False  # the source `acquire` gives is reused: `release` follows the block's copies

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> Tier | None:
        """This tier for an offload of `n_blocks` blocks with setting `cfg` and the loader's `source`, or None where
        the setting does not use it. Raises OffloadError where it asks for the tier but cannot have it."""
        return None

    def claim(self, b: BlockLayout) -> bool:
        """Whether this tier takes block b's tail (b is packed and split, not yet placed in the store)."""
        return False

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """The layout is made (each block's tier set): buffers and checks, before anything is written. `pin`: the
        device is a GPU (host buffers the copy stream reads are page-locked)."""

    def host_extent(self, b: BlockLayout) -> int:
        """Bytes of the host store block b takes."""
        return b.nbytes

    def supply(self, store: HostStore, b: BlockLayout, e: TensorEntry, write: Callable[[torch.Tensor], None]
               ) -> bool:
        """At fill: whether this tier holds tensor e (it is then bound to `view`), its bytes in the head, if any,
        written into the store here. `write(out)` writes e's value (the loader's or the module's) into `out`, a
        tensor of e's stored shape and dtype, for a tier that keeps a copy of it."""
        return False

    def view(self, store: HostStore, b: BlockLayout, e: TensorEntry) -> torch.Tensor:
        """Tensor e of block b outside its forward: its true shape, dtype and values, with a storage of its own."""
        return store_view(store, b, e)

    def prepare(self, b: BlockLayout) -> None:
        """Start bringing block b's tail within reach (`acquire` takes it, waiting for what is left)."""

    def pause(self) -> None:
        """The module is parked: stop whatever is brought ahead for the next forward."""

    def acquire(self, store: HostStore, b: BlockLayout) -> tuple[torch.Tensor, int]:
        """Block b's tail as a flat uint8 source and the block byte at its index 0 (may wait for a read)."""
        return store.data, -b.host_offset

    def source(self, store: HostStore, b: BlockLayout, non_blocking: bool) -> ChunkSource:
        """What block b's chunks are copied from, once a prefetch (by default `acquire`'s source)."""
        return ChunkSource(*self.acquire(store, b), b.slot_start, non_blocking)

    def release(self, l: int, copied) -> None:
        """Block l's copies from its source are enqueued, `copied` recorded after them (only where `recycles`)."""

    def demote(self, blocks: set[int]) -> bool:
        """Blocks written or given new tensors leave this tier at the next layout; whether any of its own did."""
        return False

    def verify(self) -> None:
        """Raise where what the tier reads changed since offload."""

    def check_dtypes(self, layouts: list[BlockLayout], mapping: dict[torch.dtype, torch.dtype]) -> None:
        """Raise, before anything changes, where the dtype change `mapping` would change a tensor it cannot hold."""

    def stats(self, layouts: list[BlockLayout]) -> dict:
        """Its fields of OffloadStats."""
        return {}

    def files_read(self) -> set[Path]:
        """The files it reads the module's weights from while the handle lives (runtime/saveguard.py keeps a save
        from replacing them)."""
        return set()


@dataclass(frozen=True)
class ByteKind:
    """What bytes a layer above gives a tier are, in the words the tier needs: `tag` (JSON-able: checked between the
    ranks that share them) and how an error names a file holding them (`file`, what it `holds`, and what to do
    instead: `leave_off`, `run_without` as a command-line remedy)."""

    tag: dict
    file: str
    holds: str
    leave_off: str
    run_without: str


def store_view(store: HostStore, b: BlockLayout, e: TensorEntry) -> torch.Tensor:
    """Tensor e of block b as the host store holds it (a storage of its own: HostStore.alias)."""
    return store.alias(b.host_offset + e.offset, e.nbytes).view(e.dtype).view(e.shape)


@dataclass
class Bytes:
    """One block's bytes a layer above gives a tier to hold (`BlockBytes.keep`): how many, a JSON-able row that
    says what they are (the layer's, opaque to the tier: kept with them and given to ranks that share them), and,
    where they were made here, the pieces (offset, flat uint8 tensor) to write."""

    nbytes: int
    row: list
    pieces: list[tuple[int, torch.Tensor]] | None = None


def host_copy(made: Bytes, pin: bool) -> HostStore:
    """Bytes made for a block in a host buffer of their own (page-locked where `pin`)."""
    from chunkflow.runtime.store import HostStore

    store = HostStore(made.nbytes, pin=pin)
    for at, data in made.pieces:
        store.data[at : at + data.numel()].copy_(data)
    return store


class BlockBytes:
    """A tier holding bytes a layer above gives it for some blocks (raw or encoded, it does not care), in place of
    the blocks' tensors: it stores them when the layout is made (`keep`) and hands out one block's at a time
    (`acquire`), as the tier's own source would. A tier module gives its way of holding them (host.py: pinned host
    memory; shared.py: one copy per host; disk.py: a spill file read into a ring)."""

    recycles: ClassVar[bool] = False  # the buffer `acquire` gives is reused: `release` follows the block's copies

    def keep(self, wanted: dict[int, str], make: Callable[[int], Bytes], pin: bool) -> dict[int, list]:
        """Hold block l's bytes for each l of `wanted` (block -> key: what its bytes depend on; bytes held under
        the same key are kept, not made again), those of new keys from `make(l)`; let go of the rest. Returns each
        block's row (where the bytes came from another rank, that rank's). `pin`: the device is a GPU."""
        raise NotImplementedError

    def acquire(self, l: int) -> torch.Tensor:
        """Block l's bytes from its byte 0, as a flat uint8 tensor (may wait for a read)."""
        raise NotImplementedError

    def in_memory(self, l: int) -> torch.Tensor | None:
        """Block l's bytes where they lie in host memory now, else None (a file's, read only when asked)."""
        return None

    def prepare(self, l: int) -> None:
        """Start bringing block l's bytes within reach."""

    def pause(self) -> None:
        """Stop what is brought ahead for the next forward."""

    def release(self, l: int, copied) -> None:
        """Block l's copies from `acquire`'s buffer are enqueued, `copied` recorded after them."""

    def detach(self) -> None:
        """Buffers made for the blocks' reads go (the next layout makes them again)."""

    def close(self) -> None:
        """Everything held goes."""

    def stats(self) -> dict:
        """What it holds: host_bytes, pinned_bytes, shared_bytes (host memory), or its disk fields."""
        return {}


class ParkHome(HandleFeature):
    """Where a parked module's non-block tensors live until its next forward (runtime/parking.py). `park` binds
    each to its home (values as they are now), `unpark` puts each back on the device with those values."""

    name: ClassVar[str] = ""
    starts_held: bool = False  # it holds tensors that were never read (`starts_parked`): offload() parks at once

    @classmethod
    def for_setting(cls, park_to: str, source, cfg=None) -> ParkHome | None:
        """This home where `park_to` names it under the offload setting `cfg` (the loader's `source` for its values),
        else None."""
        return None

    def starts_parked(self, tensors: list[ModuleTensor]) -> set[str]:
        """At offload: names of the non-block tensors this home holds already (not read onto the device: offload()
        returns the module parked)."""
        return set()

    def park(self, tensors: list[ModuleTensor], device: torch.device) -> None:
        raise NotImplementedError

    def unpark(self, tensors: list[ModuleTensor], device: torch.device) -> None:
        raise NotImplementedError

    def release_store(self) -> None:
        """Free what the home keeps between parks."""

    def stats(self) -> dict:
        return {}

    def files_read(self) -> set[Path]:
        """The files it reads parked tensors from (as Tier.files_read)."""
        return set()

