"""The shared tier: under torchrun, the ranks of one host stream the blocks' tails from ONE pinned host copy; and a
parked module's tensors kept in one copy per host (`SharedParking`).

Ulysses SP replicates the weights: without this every rank pins its own copy of the streamed bytes, and two GPUs
need twice the host memory for one model. Here local rank 0 writes each block's tail [S_l, V_l) (S_l: the first
tensor not wholly resident, R'_l) into a segment of host memory its host's other local ranks map
(runtime/hostshare.py: a memfd, no file, gone with the last process); every rank page-locks the same pages for its
GPU and copies its chunks from them, as the host tier copies from its own store. Each rank keeps its blocks' resident
heads [0, R_l) in its own store, as every tier does. The other ranks keep none of the shared bytes (they read them
once, to prove their values are rank 0's: runtime/digest.py): they wait for rank 0's word that the segment is filled.

The segment never changes once filled: rank 0 seals it (runtime/hostshare.py: nobody can write it or map it writable
from then on, and the other ranks hold a read-only descriptor), and every rank page-locks it only after the seal,
read-only (a pinned page would make sealing fail; on CUDA the locking no longer overlaps rank 0's reads). Outside its
forward a tail tensor views a private copy-on-write map of it: a write (peft's merge, load_state_dict) lands in the
writing rank's own pages, never in the other ranks' weights, and moves that block to the rank's host tier at the next forward (its values copied into its own store, a warning saying
so), as the disk tier does with its files. A block whose layout changes (a dtype change) leaves the segment the same
way; a layout never grows the segment, so only the first layout meets the other ranks.

Bytes a layer above gives it for some blocks (a codec's encoded tails, `SharedBytes`) are one copy per host too: at
the first layout local rank 0 makes every block's bytes into a segment it then offers with each block's row (what the
layer says they are); the other local ranks map it (their blocks' keys checked against rank 0's) and make none of
them. A block laid out anew later is made by each rank into a buffer of its own.

On by default under torchrun with more than one local rank; `OffloadConfig(share_host=False)` or the environment's
CHUNKFLOW_SHARE_HOST=0 keep one copy per rank.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import torch

from chunkflow.runtime.chunksource import ChunkSource
from chunkflow.runtime.errors import warn_user
from chunkflow.runtime.digest import module_digest, tensors_digest
from chunkflow.runtime.hostshare import PAGE, HostGroup, SharedSegment, host_group
from chunkflow.runtime.layout import BlockLayout, TensorEntry
from chunkflow.runtime.store import HostStore, own_storage
from chunkflow.runtime.tiers.base import BlockBytes, ByteKind, Bytes, ParkHome, Tier
from chunkflow.runtime.tiers.keyed import KeyedHostBytes
from chunkflow.runtime.tiers.files import pwrite_all
from chunkflow.runtime.tiers.hostcopies import HostCopies

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle


class SharedTierWarning(UserWarning):
    """Blocks left the host copy the ranks share (written, or laid out anew), or a module's values could not be told
    apart from another rank's: this rank holds its own."""


def shareable_values(module, source) -> str | None:
    """The digest of `module`'s values that the ranks compare before sharing them (runtime/digest.py), or None, said
    once, where its loader cannot tell them: one copy per rank then."""
    values = module_digest(module, source)
    if values is None:
        warn_user(f"chunkflow: the weights of {type(module).__name__} come from a loader ({type(source).__name__}) "
                  "that cannot say what they are, so the ranks of this host cannot check they hold the same ones: "
                  "each rank keeps its own copy in host memory", SharedTierWarning)
    return values


def _key(b: BlockLayout) -> str:
    """What a block's bytes in the segment depend on: which block it is (its name: a re-layout in the order the blocks
    ran moves them to other indices, and blocks of one shape lay out alike), its split, chunks and tensors (names,
    places, dtypes)."""
    return repr((b.name, b.resident_bytes, b.straddle_start, b.nbytes, b.slot_start, tuple(b.chunks),
                 tuple((e.name, e.offset, e.nbytes, str(e.dtype), tuple(e.shape)) for e in b.tensors)))


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class SharedHostTier(Tier):
    """Streamed tails in one host copy shared by the ranks of a host (module docstring)."""

    name = "shared"

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> SharedHostTier | None:
        if not cfg.share_host:
            return None
        group = host_group()
        if group is None:
            return None
        values = shareable_values(module, source)
        return None if values is None else cls(group, type(module).__name__, values)

    def __init__(self, group: HostGroup, what: str, values: str = ""):
        self.group, self.what = group, what
        self.values = values  # the digest of the module's values (runtime/digest.py): ranks share only these
        self.segment: SharedSegment | None = None
        self.store: HostStore | None = None  # the segment's shared map, read-only (page-locked on CUDA once sealed):
        # what chunks copy from
        self.pin = False  # page-lock the segment once it is sealed (a pinned page would make sealing fail)
        self._spans: list[tuple[int, int]] = []  # the blocks' spans in the segment, each page-locked on its own
        self.places: dict[str, tuple[int, int]] = {}  # a block's key (_key) -> (S_l, its offset in the segment)
        self.keys: dict[str, str] = {}  # block name -> its key in the segment
        self.order: list[int] = []  # indices of the blocks in the segment in this layout
        self.at: dict[int, tuple[int, int]] = {}  # index -> (S_l, offset) in this layout
        self.spans: dict[str, tuple[int, int]] = {}  # block name -> (offset, bytes) of its tail in the segment (each
        # span page-locked on its own: a copy never crosses two)
        self.left: set[str] = set()  # names of blocks that left the segment (never back: it is not written again)
        self.leaving: set[str] = set()  # ... since the last attach (said once)
        self._names: dict[int, str] = {}  # index -> block name in this layout
        self.first = True

    def hold_bytes(self, kind: ByteKind) -> SharedBytes:
        """This tier holding bytes given to it (BlockBytes); `kind.tag` says what they are to the other ranks, which
        check it."""
        return SharedBytes(self.group, self.what, self.values, kind.tag)

    # ---- layout

    def claim(self, b: BlockLayout) -> bool:
        """Every streamed block at the first layout; later, a block still in the segment as it was laid out (by its
        name, wherever the new layout puts it)."""
        if not b.is_streamed or b.name in self.left:
            return False
        if self.first:
            return True
        if self.keys.get(b.name) == _key(b):
            return True
        if b.name in self.keys:
            self.left.add(b.name)
            self.leaving.add(b.name)
        return False

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """The first time: the segment made by local rank 0 (or joined, its layout checked against this rank's),
        page-locked on CUDA; later: the blocks still in it."""
        self.order = [b.index for b in layouts if b.tier is self]
        self._names = {b.index: b.name for b in layouts}
        if not self.first:
            self.at = {l: self.places[self.keys[layouts[l].name]] for l in self.order}
            return
        self.first = False
        off, spans, rows = 0, [], []
        for l in self.order:
            b = layouts[l]
            n = b.nbytes - b.straddle_start
            key = _key(b)
            self.keys[b.name], self.places[key] = key, (b.straddle_start, off)
            spans.append((off, n))
            self.spans[b.name] = (off, n)
            rows.append([l, b.straddle_start, n, off, key])
            off += _page_up(n)
        self.at = {l: self.places[self.keys[layouts[l].name]] for l in self.order}
        if not self.order:
            return
        self.segment = SharedSegment.open(self.group, {"module": self.what, "values": self.values, "blocks": rows},
                                          off, self.what)
        self.store = HostStore(off, pin=False, data=self.segment.shared[:off], read_only=True)
        self.pin, self._spans = pin, spans

    def host_extent(self, b: BlockLayout) -> int:
        """Only the head is in this rank's own store."""
        return b.resident_bytes

    def _at(self, b: BlockLayout, e: TensorEntry) -> int:
        S, off = self.at[b.index]
        return off + e.offset - S

    def supply(self, store: HostStore, b: BlockLayout, e: TensorEntry, write: Callable[[torch.Tensor], None]
               ) -> bool:
        """A tail tensor lives in the segment: local rank 0 writes its value there at the first fill, the others read
        nothing (they wait for rank 0 only where a straddling tensor's head is copied into their store)."""
        R = b.resident_bytes
        if e.end <= R:
            return False
        at = self._at(b, e)
        seg = self.segment
        if self.group.owner and not seg.filled:
            write(seg.writable[at : at + e.nbytes].view(e.dtype).view(e.shape))
        if e.offset < R:  # its head part goes with the block's head into this rank's store
            if not self.group.owner:
                seg.wait_filled()
            store.view(b.host_offset + e.offset, R - e.offset).copy_(self.store.data[at : at + R - e.offset])
        return True

    def view(self, store: HostStore, b: BlockLayout, e: TensorEntry) -> torch.Tensor:
        """Outside its forward a tail tensor is its bytes in the segment, mapped copy-on-write for this rank."""
        if e.end <= b.resident_bytes:
            return super().view(store, b, e)
        at = self._at(b, e)
        return own_storage(self.segment.private[at : at + e.nbytes]).view(e.dtype).view(e.shape)

    # ---- streaming

    def _ready(self) -> None:
        """The segment filled and sealed (the owner seals it, every write done; a peer waits for the owner's word),
        then page-locked (read-only, on CUDA): chunks may be copied from it."""
        if self.group.owner:
            self.segment.mark_filled()
        else:
            self.segment.wait_filled()
        if self.pin:
            self.pin = False
            self.store.pin_now(self._spans)
        self.store.wait()

    def source(self, store: HostStore, b: BlockLayout, non_blocking: bool) -> ChunkSource:
        self._ready()
        S, off = self.at[b.index]
        return ChunkSource(self.store.data, S - off, b.slot_start, non_blocking)

    def acquire(self, store: HostStore, b: BlockLayout):
        raise AssertionError("the shared tier gives a source (`source`), not a flat buffer")

    # ---- the handle's part

    def attach(self, handle: OffloadHandle) -> None:
        """Rank 0 says the segment is filled (once); every rank returns from offload with its weights readable; blocks
        that left the segment since the last layout are named."""
        if self.segment is not None:
            self._ready()
        if self.leaving:
            warn_user(f"chunkflow: block(s) {', '.join(sorted(self.leaving))} of {self.what} were written or "
                      "laid out anew; this rank now keeps its own copy of them in host memory (the copy the ranks of "
                      "this host share holds the weights as loaded)", SharedTierWarning)
            self.leaving = set()

    def demote(self, blocks: set[int]) -> bool:
        """Blocks written while in the segment leave it at the next layout (this rank's own copy); whether any did."""
        hit = blocks & set(self.order)
        names = {self._names[l] for l in hit}
        self.left |= names
        self.leaving |= names
        return bool(hit)

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        """Unpin and let go of this rank's share: the pages go with the last rank (and the last tensor viewing
        them)."""
        if self.store is not None:
            self.store.release()
            self.store = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def stats(self, layouts: list[BlockLayout]) -> dict:
        tail = sum(layouts[l].nbytes - self.at[l][0] for l in self.order)
        return dict(shared_blocks=len(self.order), shared_bytes=self.segment.nbytes if self.segment else 0,
                    shared_tail_bytes=tail, shared_pinned_bytes=self.store.pinned_bytes if self.store else 0,
                    shared_owner=self.group.owner)


class SharedBytes(KeyedHostBytes, BlockBytes):
    """Bytes given for some blocks in one copy per host (module docstring), each block's seen through a host buffer
    of its own (page-locked on CUDA); blocks laid out anew later in this rank's own buffers."""

    def __init__(self, group: HostGroup, what: str, values: str, tag: dict):
        super().__init__()
        self.group, self.what, self.values, self.tag = group, what, values, tag
        self.segment: SharedSegment | None = None

    def _first_layout(self, wanted: dict[int, str], make: Callable[[int], Bytes], pin: bool) -> None:
        if self.segment is None and not self.held and wanted:
            self.held = self._shared(wanted, make, pin)

    def _shared(self, wanted: dict[int, str], make: Callable[[int], Bytes], pin: bool
                ) -> dict[str, tuple[HostStore, list]]:
        """Every block's bytes once per host: local rank 0 makes them into a segment and offers it with their rows;
        the others take both (runtime/hostshare.py)."""
        manifest = {"module": self.what, **self.tag, "values": self.values,
                    "blocks": [[l, key] for l, key in wanted.items()]}
        if self.group.owner:
            fd = SharedSegment.new_fd(self.what)
            try:
                rows, off = {}, 0
                for l in wanted:
                    made = make(l)
                    for at, data in made.pieces:
                        pwrite_all(fd, data.cpu().numpy().tobytes(), off + at)
                    rows[str(l)] = [off, made.nbytes, made.row]
                    off += _page_up(made.nbytes)
            except BaseException:
                os.close(fd)
                raise
            self.segment = SharedSegment.offer_filled(self.group, fd, off, manifest, rows, self.what)
        else:
            self.segment = SharedSegment.join_filled(self.group, manifest, self.what)
            rows = self.segment.extra
        out = {}
        for l, key in wanted.items():
            off, nbytes, row = rows[str(l)]
            out[key] = (HostStore(nbytes, pin=pin, data=self.segment.shared[off:off + max(nbytes, 1)],
                                  read_only=True), row)
        return out

    def close(self) -> None:
        super().close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def stats(self) -> dict:
        return dict(super().stats(), shared_bytes=self.segment.nbytes if self.segment is not None else 0)


class SharedParking(ParkHome):
    """A parked module's non-block tensors in one host copy per host: at the first park local rank 0 copies them into a
    segment the other local ranks map (they copy nothing); a tensor unchanged since is parked there again and
    unparked from its page-locked pages; one written since (or while parked, through its copy-on-write view), or a
    module whose tensors changed, is parked in this rank's own store (`HostCopies`)."""

    name = "shared"

    @classmethod
    def for_setting(cls, park_to: str, source, cfg=None) -> SharedParking | None:
        if park_to not in ("host", "shared") or (cfg is not None and not cfg.share_host):
            return None
        group = host_group()
        return None if group is None else cls(group, "parked tensors")

    def __init__(self, group: HostGroup, what: str):
        self.group, self.what = group, what
        self.own = HostCopies()  # the tensors no longer as the segment holds them
        self.segment: SharedSegment | None = None
        self.pinned: HostStore | None = None  # the segment's shared map, read-only (page-locked on CUDA)
        self.names: list[tuple[str, str, tuple]] = []  # (name, dtype, shape) of each tensor in the segment
        self.places: list[tuple[int, int]] = []  # (offset, nbytes) of each
        self.clean: list[bool] = []  # tensor i still holds the segment's values
        self.unparked: list[tuple[int, int] | None] = []  # (version, data_ptr) at its last unpark from the segment
        self.parked: list[tuple[int, int] | None] = []  # (version, data_ptr) of each shared view bound at park

    @staticmethod
    def _ids(tensors) -> list[tuple[str, str, tuple]]:
        return [(t.name, str(t.get().dtype), tuple(t.get().shape)) for t in tensors]

    def _open(self, tensors, device: torch.device) -> None:
        off, rows = 0, []
        for t in tensors:
            cur = t.get()
            n = cur.numel() * cur.element_size()
            self.places.append((off, n))
            rows.append([t.name, str(cur.dtype), list(cur.shape), off])
            off = -(-(off + n) // 256) * 256
        self.names = self._ids(tensors)
        manifest = {"parked": self.what, "tensors": rows, "values": tensors_digest(tensors)}
        self.segment = SharedSegment.open(self.group, manifest, off, self.what)
        if self.group.owner:
            with torch.no_grad(), torch.inference_mode(False):
                for t, (at, n) in zip(tensors, self.places):
                    cur = t.get().detach()
                    self.segment.writable[at : at + n].view(cur.dtype).view(cur.shape).copy_(cur)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.segment.mark_filled()  # sealed: page-locked only now (a pinned page would make sealing fail)
        else:
            self.segment.wait_filled()
        self.pinned = HostStore(off, pin=device.type == "cuda", data=self.segment.shared, read_only=True)
        self.clean = [True] * len(tensors)
        self.unparked = [(t.get()._version, t.get().data_ptr()) for t in tensors]

    def park(self, tensors, device: torch.device) -> None:
        if self.segment is None:
            self._open(tensors, device)
        elif self._ids(tensors) != self.names:  # new or changed tensors since: every one in this rank's own store
            self.clean = [False] * len(tensors)
        for i, t in enumerate(tensors):
            cur = t.get()
            if self.clean[i] and (cur._version, cur.data_ptr()) != self.unparked[i]:
                self.clean[i] = False  # written since its last unpark
        own = [t for t, c in zip(tensors, self.clean) if not c]
        if own:
            self.own.park(own, device)
        self.parked = [None] * len(tensors)
        with torch.no_grad(), torch.inference_mode(False):
            for i, t in enumerate(tensors):
                if not self.clean[i]:
                    continue
                cur = t.get()
                at, n = self.places[i]
                view = own_storage(self.segment.private[at : at + n]).view(cur.dtype).view(cur.shape)
                if t.is_param:
                    cur.data = view
                else:
                    t.set_buffer(view)
                self.parked[i] = (t.get()._version, t.get().data_ptr())

    def unpark(self, tensors, device: torch.device) -> None:
        """Tensors still as the segment holds them come back from its page-locked pages; the rest as HostCopies
        brings them."""
        for i, t in enumerate(tensors):
            if i < len(self.parked) and self.parked[i] is not None and (t.get()._version, t.get().data_ptr()) != self.parked[i]:
                self.clean[i] = False  # written while parked: its own pages hold its values now
        own = [t for t, c in zip(tensors, self.clean) if not c]
        if own:
            self.own.unpark(own, device)
        with torch.no_grad(), torch.inference_mode(False):
            for i, t in enumerate(tensors):
                if not self.clean[i]:
                    continue
                cur = t.get()
                at, n = self.places[i]
                src = self.pinned.data[at : at + n].view(cur.dtype).view(cur.shape)
                dev = src.to(device, non_blocking=device.type == "cuda", copy=True)
                if t.is_param:
                    cur.data = dev
                else:
                    t.set_buffer(dev)
                self.unparked[i] = (t.get()._version, t.get().data_ptr())
        self.parked = []

    def attach(self, handle) -> None:
        self.own.attach(handle)

    def release_store(self) -> None:
        self.own.release_store()

    def close(self, handle, restore: bool) -> None:
        self.own.close(handle, restore)
        if self.pinned is not None:
            if handle.device.type == "cuda":
                torch.cuda.synchronize(handle.device)
            self.pinned.release()
            self.pinned = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def stats(self) -> dict:
        return dict(self.own.stats(), shared_park_bytes=self.segment.nbytes if self.segment is not None else 0)
