"""The disk tier: blocks whose streamed bytes stay in the checkpoint's own safetensors files, read each forward;
bytes a layer above gives it for some blocks (a codec's encoded tails) in a spill file read the same way
(`SpillBytes`); and a parked module's non-block tensors kept in the checkpoint's files (`DiskParking`).

A plan's `disk_blocks` (chunkflow_planner.offload.disk_block_indices: spread evenly over the blocks) keep their
resident head [0, R_l) as every block does (host store, resident buffer); their streamed tail [R_l, V_l) is not in
host memory. A reader thread reads a disk block's tail straight from the files (offsets from their headers) into one
of DISK_RING_BLOCKS page-locked ring buffers (`Ring`), running that many disk blocks ahead of the copy stream; the
streamer copies its chunks from the ring buffer as it copies a host block's from the host store (runtime/streamer.py),
then records an event on the copy stream after which the buffer may take the next read. The reads drop the pages they
bring into the page cache (FileReader), so host memory holds the ring, not the weights.

Outside its forward a tail tensor is a private, copy-on-write map of its bytes in the file (runtime/tiers/files.py:
`FileValues`, which checks the files when the tier is made and watches them; before and after every read they are
checked again). A checkpoint changed after offload is an error at the next forward, `state_dict()` or `remove()`,
never other weights. Not seen: writes through another process's shared map of the file, or from another machine on a
network file system that keep size and times (a documented limit). A write to a tail tensor (peft's merge,
load_state_dict) or a new tensor inside a disk block moves that block to the host tier at the next forward (its
current values copied into the host store, a warning saying so): the file is never written and never disagrees.

Bytes given to it (`hold_bytes`) are written once, at layout, to a spill file chunkflow owns (in CHUNKFLOW_CACHE_DIR
or ~/.cache/chunkflow, unlinked as it is made: gone with the process, even one killed; never in the checkpoint's
folder), its pages dropped from the page cache; each forward reads them into the ring as above.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from chunkflow.runtime.errors import OffloadError, warn_user
from chunkflow.runtime.filewatch import FileWatch
from chunkflow.runtime.layout import BlockLayout
from chunkflow.runtime.store import HostStore, own_storage
from chunkflow.runtime.tensors import all_tensors
from chunkflow.runtime.tiers.base import BlockBytes, ByteKind, Bytes, ParkHome, Tier
from chunkflow.runtime.tiers.files import (DiskFiles, DiskTierError, DiskTierWarning, FileValues, _FileState, _state,
                                           ValuesInFiles, disk_files, pwrite_all)
from chunkflow.runtime.tiers.hostcopies import HostCopies
from chunkflow_planner.checkpoint import TensorRecord
from chunkflow_planner.offload import DISK_RING_BLOCKS

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle

__all__ = ["DiskTier", "DiskTierError", "DiskTierWarning", "DiskParking", "SpillBytes", "READ_PIECE"]

READ_PIECE = 16 << 20  # a tail is read in pieces this large, so that a read no longer wanted stops within one (11 ms
# at 1.44 GB/s, the H200 host's NVMe, docs/tiers-h200.md)


def spill_dir() -> Path:
    """Where a spill file goes: CHUNKFLOW_CACHE_DIR, else ~/.cache/chunkflow (a disk, where /tmp may be memory)."""
    env = os.environ.get("CHUNKFLOW_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "chunkflow"


class _Cancelled(Exception):
    """A read ended before its end: no longer wanted (stop(cancel=True))."""


class Ring:
    """DISK_RING_BLOCKS host buffers (page-locked on CUDA) a reader thread fills, a block each, in execution order,
    ahead of the copy stream. `fill(l, base)` writes block l's bytes into `ring.data` from `base`, calling `piece()`
    before each piece it reads (a read no longer wanted ends there), and returns how many it read from disk.
    `bytes_read` counts a block's read when a forward takes it (acquire): reads ahead still in flight, or cancelled,
    are not counted, so the count after each forward is the same whatever the reader thread is doing."""

    def __init__(self, fill: Callable[[int, int], int]):
        self.fill = fill
        self.order: list[int] = []  # its blocks in execution order
        self.ring: HostStore | None = None
        self.entry_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._reads: dict[int, tuple[Future, int]] = {}  # block -> (its read, the ring entry it fills)
        self._free: list[int] = []  # ring entries no read holds
        self._consumed: dict[int, object] = {}  # ring entry -> copy-stream event after its last copy
        self._cancel = threading.Event()  # set: the read in progress ends at its next piece (stop(cancel=True))
        self.bytes_read = 0
        self.reads = 0
        self.stall_s = 0.0

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes if self.ring is not None else 0

    def lay_out(self, order: list[int], entry_bytes: int, pin: bool) -> None:
        """The blocks it reads, in execution order, and the most bytes one takes: the ring (page-locked where `pin`)
        and the reader."""
        self.order = list(order)
        if self.order:
            self.entry_bytes = entry_bytes
            entries = min(DISK_RING_BLOCKS, len(self.order))
            self.ring = HostStore(entries * self.entry_bytes, pin=pin)
            self._free = list(range(entries))
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkflow-disk")

    def piece(self) -> None:
        """A piece is about to be read: _Cancelled where the read is no longer wanted."""
        if self._cancel.is_set():
            raise _Cancelled

    def _read(self, l: int, entry: int, after) -> int:
        """Block l read into ring entry `entry`: the bytes it read from disk."""
        if after is not None and hasattr(after, "synchronize"):
            after.synchronize()  # the copies out of this buffer are done
        nbytes = self.fill(l, entry * self.entry_bytes)
        self.reads += 1
        return nbytes

    def _submit(self, l: int) -> None:
        entry = self._free.pop(0)
        self._reads[l] = (self._pool.submit(self._read, l, entry, self._consumed.pop(entry, None)), entry)

    def _restart(self, l: int) -> None:
        """Reads from block l on (none in flight was for it: the first forward, or blocks out of order; those in
        flight are for other blocks: cancelled)."""
        self.stop(cancel=True)
        self._free = list(range(min(DISK_RING_BLOCKS, len(self.order))))
        i = self.order.index(l)
        for k in range(len(self._free)):
            self._submit(self.order[(i + k) % len(self.order)])

    def prepare(self, l: int) -> None:
        """Block l's read started if none is in flight for it."""
        if l not in self._reads:
            self._restart(l)

    def acquire(self, l: int) -> torch.Tensor:
        """Block l's ring buffer, read (waiting for the read: a stall)."""
        if l not in self._reads:
            self._restart(l)
        fut, entry = self._reads[l]
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()
            self.stall_s += time.perf_counter() - t0
        self.bytes_read += fut.result()  # raises what the read met
        base = entry * self.entry_bytes
        return self.ring.data[base:base + self.entry_bytes]

    def release(self, l: int, copied) -> None:
        """Block l's copies are enqueued: its buffer takes the read of the block DISK_RING_BLOCKS on, once they are
        done (`copied`: an event recorded on the copy stream after them)."""
        hit = self._reads.pop(l, None)
        if hit is None:
            return
        entry = hit[1]
        self._consumed[entry] = copied
        self._free.append(entry)
        i = self.order.index(l)
        nxt = self.order[(i + len(self._reads) + 1) % len(self.order)]
        if nxt not in self._reads:
            self._submit(nxt)

    def stop(self, cancel: bool = False) -> None:
        """No read in flight (each waited for, its error dropped: the next acquire reads again); `cancel`: those not
        started are dropped and the one in progress ends at its next piece."""
        if cancel:
            self._cancel.set()
            for fut, _ in self._reads.values():
                fut.cancel()
        for fut, _ in self._reads.values():
            try:
                fut.result()
            except BaseException:  # an error, _Cancelled or CancelledError
                pass
        self._cancel.clear()
        self._reads = {}
        self._consumed = {}

    def drop(self) -> None:
        """Reads stopped, the buffers freed (the next layout makes them again)."""
        self.stop()
        if self.ring is not None:
            self.ring.release()
        self.ring = None

    def close(self) -> None:
        """The reader thread ends."""
        self.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def stats(self, blocks: int, per_step: int) -> dict:
        return dict(disk_blocks=blocks, disk_bytes_per_step=per_step, disk_bytes_read=self.bytes_read,
                    disk_read_stall_s=self.stall_s, disk_ring_bytes=self.nbytes)


class DiskTier(ValuesInFiles, Tier):
    """The disk tier of one handle (module docstring): `values`, the blocks whose tails live in the files."""

    name = "disk"
    recycles = True

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> DiskTier | None:
        """The tier `cfg.disk_blocks` asks for, reading the files `source` knows; an error where it knows none."""
        if not cfg.disk_blocks:
            return None
        from chunkflow_planner.offload import disk_block_indices

        files = disk_files(source, f"disk_blocks={cfg.disk_blocks}")
        if cfg.disk_blocks > n_blocks:
            files.close()
            raise OffloadError(f"disk_blocks={cfg.disk_blocks} but the module has {n_blocks} blocks")
        values = FileValues(set(disk_block_indices(n_blocks, cfg.disk_blocks)), files,
                            "their weights now live in host memory, not on disk")
        values.note_records(all_tensors(module))
        return cls(values)

    def __init__(self, values: FileValues):
        self.values = values
        self.ring = Ring(self._fill)

    def hold_bytes(self, kind: ByteKind) -> SpillBytes:
        """This tier holding bytes given to it for its blocks (BlockBytes), in a spill file (`kind` names it in
        errors). Each read checks the checkpoint's files as this tier's own reads do."""
        return SpillBytes(kind, lambda l: self.values.unchanged(self.values.paths(l)))

    @property
    def bytes_read(self) -> int:
        return self.ring.bytes_read

    @property
    def _reads(self) -> dict:
        return self.ring._reads

    # ---- set-up: before the host store is filled

    def claim(self, b: BlockLayout) -> bool:
        return self.values.claim(b)

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """Check every tail tensor of the disk blocks against its file and map the files; then the ring (page-locked
        where `pin`) and the reader. Raises DiskTierError before anything is written."""
        v = self.values
        v.laid_out(layouts, self)
        self.ring.lay_out(v.order, max((layouts[l].nbytes - v.tail[l] for l in v.order), default=0), pin)

    # ---- the handle's part

    def attach(self, handle: OffloadHandle) -> None:
        self.values.attach(handle)

    def detach(self, handle: OffloadHandle) -> None:
        self.values.detach(handle)
        self.ring.drop()

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        """The reader thread ends and the files close; the maps go with the last tensor viewing them."""
        self.ring.close()
        self.values.close()

    # ---- reads (the reader thread) and what the streamer asks

    def _fill(self, l: int, base: int) -> int:
        """Block l's tail from the files into the ring from `base`, the files checked before and after: the bytes
        read from the files (a part held converted is copied from host memory, not read)."""
        v = self.values
        paths = v.paths(l)
        v.unchanged(paths)
        ring = self.ring.ring
        nbytes = 0
        try:
            for p in v.parts[l]:
                if p.held:  # converted once: copied from host memory
                    src = v.converted(p).reshape(-1).view(torch.uint8)
                    ring.view(base + p.at, src.numel() - p.skip).copy_(src[p.skip:])
                    continue
                n = p.rec.nbytes - p.skip
                for a in range(0, n, READ_PIECE):  # in pieces: a read no longer wanted ends at the next one
                    self.ring.piece()
                    k = min(READ_PIECE, n - a)
                    v.files.read_range(p.rec.file, p.rec.begin + p.skip + a, k, ring.view(base + p.at + a, k))
                    nbytes += k
        except _Cancelled:
            raise
        except Exception:
            v.unchanged(paths)  # a file changed under the read: say that, not what the read met
            raise
        v.unchanged(paths)  # changed while it was read: these bytes may be of two versions
        return nbytes

    def prepare(self, b: BlockLayout) -> None:
        self.ring.prepare(b.index)

    def pause(self) -> None:
        """Parked: the reads ahead are not wanted until the next forward (which reads again from its first block):
        those not started are cancelled, the one in progress ends at its next piece."""
        self.ring.stop(cancel=True)

    def acquire(self, store: HostStore, b: BlockLayout) -> tuple[torch.Tensor, int]:
        """Block l's tail bytes, read (waiting for the read: a stall), and R_l: chunk [lo, hi) is at lo - R_l."""
        return self.ring.acquire(b.index), self.values.tail[b.index]

    def release(self, l: int, copied) -> None:
        self.ring.release(l, copied)

    def stop(self, cancel: bool = False) -> None:
        self.ring.stop(cancel)

    def stats(self, layouts: list[BlockLayout]) -> dict:
        """The ring's counts; a forward's bytes are those its reads take from the files (not the parts held
        converted in host memory)."""
        v = self.values
        return self.ring.stats(len(v.order), sum(p.rec.nbytes - p.skip for l in v.order for p in v.parts[l]
                                                 if not p.held))


class SpillBytes(BlockBytes):
    """Bytes given for the disk tier's blocks, written once to a spill file (module docstring) and read from it into a
    ring each forward. `check(l)` runs before and after each read of block l (the tier's own files checked)."""

    recycles = True

    def __init__(self, words: ByteKind, check: Callable[[int], None]):
        self.words, self.check = words, check
        self.spill = None  # the unlinked file the blocks' bytes are read from
        self.end = 0  # its size: every block's bytes, each from a 4096-byte boundary
        self.held: dict[str, tuple[int, int, list]] = {}  # key -> (offset in the file, bytes, row)
        self.keys: dict[int, str] = {}  # block -> key in this layout
        self.ring = Ring(self._fill)

    def _open(self) -> None:
        if self.spill is not None:
            return
        folder = spill_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.spill = tempfile.TemporaryFile(dir=folder)
        except OSError as exc:
            raise DiskTierError(f"{self.words.file} for the disk blocks cannot be made in {str(folder)!r}: "
                                f"{exc.strerror or exc}; set CHUNKFLOW_CACHE_DIR to a folder on a disk with room, "
                                f"or {self.words.leave_off}") from None

    def keep(self, wanted: dict[int, str], make: Callable[[int], Bytes], pin: bool) -> dict[int, list]:
        """Every block whose key is new made and written to the spill file (its pages dropped from the page cache
        once written); then the ring."""
        self._open()
        kept = {}
        fd = self.spill.fileno()
        try:
            for l, key in wanted.items():
                old = self.held.get(key)
                if old is not None:
                    kept[key] = old
                    continue
                made = make(l)
                for off, data in made.pieces:
                    pwrite_all(fd, data.cpu().numpy().tobytes(), self.end + off)
                kept[key] = (self.end, made.nbytes, made.row)
                self.end += -(-made.nbytes // 4096) * 4096
            os.ftruncate(fd, self.end)  # the last block's alignment padding is in the file too
            os.fsync(fd)
        except OSError as exc:  # a full cache disk (ENOSPC), a quota, an I/O error: the cache folder's, said so
            raise DiskTierError(self._write_failed(spill_dir(), exc)) from None
        self.held, self.keys = kept, dict(wanted)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.ring.lay_out(list(wanted), max((kept[k][1] for k in wanted.values()), default=0), pin)
        return {l: kept[key][2] for l, key in wanted.items()}

    def _write_failed(self, folder: Path, exc: OSError) -> str:
        """Why the spill file could not be written in the cache folder `folder`, and what to do."""
        import errno

        from chunkflow_planner.units import format_bytes

        env = os.environ.get("CHUNKFLOW_CACHE_DIR")
        named = f"CHUNKFLOW_CACHE_DIR {str(folder)!r}" if env else f"the cache folder {str(folder)!r}"
        why = {errno.ENOSPC: "its file system is full", errno.EDQUOT: "your disk quota there is used up",
               errno.EFBIG: "a limit on file size (ulimit -f) stops the file"}.get(exc.errno, exc.strerror or str(exc))
        return (f"{self.words.file} for the disk blocks cannot be written in {named}: {why} (after "
                f"{format_bytes(self.end)}; it is removed). Free space there, or set CHUNKFLOW_CACHE_DIR to a folder "
                f"on a disk with room for {self.words.holds}, or {self.words.run_without}; the output and the "
                "checkpoint were not touched")

    def _fill(self, l: int, base: int) -> int:
        """Block l's bytes from the spill file into the ring from `base`, in pieces, their pages dropped from the
        page cache; `check(l)` before and after. Returns the bytes read."""
        at, nbytes, _row = self.held[self.keys[l]]
        self.check(l)
        fd = self.spill.fileno()
        ring = self.ring.ring.data.numpy()
        for a in range(0, nbytes, READ_PIECE):
            self.ring.piece()
            k = min(READ_PIECE, nbytes - a)
            view = memoryview(ring[base + a : base + a + k])
            got = 0
            while got < k:
                n = os.preadv(fd, [view[got:]], at + a + got)
                if n <= 0:
                    raise DiskTierError(f"{self.words.file} ended before its bytes; it was changed or truncated by "
                                        "another program: offload (load) the model again")
                got += n
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, at, nbytes, os.POSIX_FADV_DONTNEED)
        self.check(l)
        return nbytes

    def acquire(self, l: int) -> torch.Tensor:
        return self.ring.acquire(l)

    def prepare(self, l: int) -> None:
        self.ring.prepare(l)

    def pause(self) -> None:
        self.ring.stop(cancel=True)

    def release(self, l: int, copied) -> None:
        self.ring.release(l, copied)

    def detach(self) -> None:
        self.ring.drop()

    def close(self) -> None:
        self.ring.close()
        if self.spill is not None:  # unlinked already: closing it gives its room back
            self.spill.close()
            self.spill = None
        self.held, self.keys = {}, {}

    def stats(self) -> dict:
        per_step = sum(self.held[k][1] for k in self.keys.values())
        return dict(self.ring.stats(len(self.keys), per_step), spill_bytes=self.end)


class DiskParking(ParkHome):
    """A parked module's non-block tensors left in the checkpoint's files (`offload(park_to="disk")`).

    While parked, a tensor whose file holds it in its dtype is a private copy-on-write map of its bytes (no memory
    until read; the pages a read touched are given back at unpark); the rest (not in the files, stored in another
    dtype, or written since it was read) wait in host memory as `HostCopies` keeps them. Unpark reads each from its
    file straight into a new device tensor (through the reader's small page-locked staging buffers on a GPU,
    dropping the pages it read). A tensor written while parked (through its map) or while on the device is never
    lost: its values go to the device, and from then on it is parked in host memory (a DiskTierWarning says so).
    The files are checked as the disk tier checks them: one changed since offload is a DiskTierError at unpark."""

    name = "disk"

    @classmethod
    def for_setting(cls, park_to: str, source, cfg=None) -> DiskParking | None:
        return cls(disk_files(source, f"park_to={park_to!r}")) if park_to == "disk" else None

    def __init__(self, files: DiskFiles):
        self.files = files
        self.host = HostCopies()  # the tensors the files cannot give back
        self._records: dict[tuple[int, str], TensorRecord] = {}  # (id(owner), attr) -> record, same dtype only
        self._fresh: set[tuple[int, str]] = set()  # never read: held by the files from offload on
        self._clean: dict[tuple[int, str], tuple[int, int]] = {}  # (version, data_ptr) when read from its file
        self._mapped: dict[tuple[int, str], tuple[int, int]] = {}  # parked on its file: (version, data_ptr) then
        self._demoted: set[tuple[int, str]] = set()
        self._rest: list[tuple[int, str]] = []  # what `host` holds, in order
        self._maps: dict[Path, tuple[mmap.mmap, torch.Tensor]] = {}
        self._states: dict[Path, _FileState] = {}
        self._watch = FileWatch()
        self.bytes_read = 0
        self.unparks = 0

    @staticmethod
    def _key(t) -> tuple[int, str]:
        return id(t.owners[0][0]), t.owners[0][1]

    def starts_parked(self, tensors) -> set[str]:
        """Note where each non-block tensor lies in the files; those held there in their dtype are never read now."""
        held = set()
        converted = total = 0
        for t in tensors:
            rec = self.files.record(t.name)
            if rec is None:
                continue
            cur = t.get()
            total += rec.nbytes
            if getattr(torch, rec.dtype_name, None) != cur.dtype or rec.nbytes != cur.numel() * cur.element_size():
                converted += rec.nbytes
                continue
            self._open(rec)
            self._records[self._key(t)] = rec
            self._fresh.add(self._key(t))
            held.add(t.name)
        if total and converted > total / 8:
            raise DiskTierError(
                f"{converted / total:.0%} of the bytes parked on disk are stored in another dtype than the module "
                "runs them in; they would be held converted in host memory. Save the model once in its run dtype "
                "(`Model.from_pretrained(dir, torch_dtype=...).save_pretrained(out)`), or park it in host memory")
        self.starts_held = bool(held)
        return held

    def _open(self, rec: TensorRecord) -> None:
        path = rec.file
        if path in self._maps:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DiskTierError(f"{str(path)!r} cannot be read to park weights on disk: {exc.strerror or exc}") from None
        try:
            if os.fstat(fd).st_size < rec.end:
                raise DiskTierError(f"{str(path)!r} is {os.fstat(fd).st_size} bytes but its header places "
                                    f"{rec.key} up to byte {rec.end}; it is truncated: download or save it again")
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        self._states[path] = _state(path)
        self._watch.add(path)

    def _unchanged(self, paths) -> None:
        written = self._watch.changed()
        for path in paths:
            try:
                state = _state(path)
            except OSError:
                state = None
            if path in written or state != self._states[path]:
                raise DiskTierError(f"{str(path)!r} changed after the model was offloaded with weights parked in it "
                                    "(written, or its size, modification time or inode differ); its weights are no "
                                    "longer the model's. Offload (load) the model again, or handle.discard() to drop it")

    def verify(self) -> None:
        self._unchanged(list(self._states))

    def files_read(self) -> set[Path]:
        return set(self._states)

    def _map(self, rec: TensorRecord, cur: torch.Tensor) -> torch.Tensor:
        flat = own_storage(self._maps[rec.file][1][rec.begin:rec.end])
        return flat.view(cur.dtype).view(cur.shape)

    def park(self, tensors, device: torch.device) -> None:
        mapped, rest = [], []
        written = []
        for t in tensors:
            key, cur = self._key(t), t.get()
            rec = self._records.get(key)
            if rec is None or key in self._demoted:
                rest.append(t)
            elif key in self._fresh or self._clean.get(key) == (cur._version, cur.data_ptr()):
                mapped.append((t, rec))
            else:  # written since it was read: host memory keeps what it holds now
                self._demoted.add(key)
                written.append(t.name)
                rest.append(t)
        if written:
            warn_user(f"chunkflow: {', '.join(written[:5])}{' and more' if len(written) > 5 else ''} changed since "
                      "they were read from the checkpoint's files; they are parked in host memory from now on (the "
                      "files are never written)", DiskTierWarning)
        keys = [self._key(t) for t in rest]
        if keys != self._rest:
            self.host.versions = None
            self._rest = keys
        self.host.park(rest, device)
        self._mapped = {}
        with torch.no_grad(), torch.inference_mode(False):
            for t, rec in mapped:
                cur = t.get()
                view = self._map(rec, cur)
                if t.is_param:
                    cur.data = view
                else:
                    t.set_buffer(view)
                self._mapped[self._key(t)] = (t.get()._version, t.get().data_ptr())
        self._fresh = set()
        self._clean = {}

    def unpark(self, tensors, device: torch.device) -> None:
        on_file = [t for t in tensors if self._key(t) in self._mapped]
        self._unchanged({self._records[self._key(t)].file for t in on_file})
        written = []
        with torch.no_grad(), torch.inference_mode(False):
            for t in on_file:
                key, cur = self._key(t), t.get()
                if (cur._version, cur.data_ptr()) != self._mapped[key]:  # written through its map while parked
                    dev = cur.detach().to(device, copy=True)
                    self._demoted.add(key)
                    written.append(t.name)
                else:
                    rec = self._records[key]
                    dev = torch.empty(cur.shape, dtype=cur.dtype, device=device)
                    self.files.read_range(rec.file, rec.begin, rec.nbytes, dev.reshape(-1).view(torch.uint8))
                    self.bytes_read += rec.nbytes
                if t.is_param:
                    cur.data = dev
                else:
                    t.set_buffer(dev)
                if key not in self._demoted:
                    self._clean[key] = (t.get()._version, t.get().data_ptr())
        self._mapped = {}
        for mm, _ in self._maps.values():  # pages a read of a parked tensor touched: not kept in memory
            mm.madvise(mmap.MADV_DONTNEED)
        if written:
            warn_user(f"chunkflow: {', '.join(written[:5])}{' and more' if len(written) > 5 else ''} were written "
                      "while parked on disk; their new values are used and parked in host memory from now on (the "
                      "files are never written)", DiskTierWarning)
        rest = set(self._rest)
        self.host.unpark([t for t in tensors if self._key(t) in rest], device)
        self.unparks += 1

    def attach(self, handle) -> None:
        self.host.attach(handle)

    def release_store(self) -> None:
        self.host.release_store()

    def close(self, handle, restore: bool) -> None:
        self.files.close()
        self._watch.close()
        self._maps = {}

    def stats(self) -> dict:
        return dict(park_to=self.name, disk_park_bytes=sum(r.nbytes for k, r in self._records.items()
                                                           if k not in self._demoted),
                    disk_unpark_bytes_read=self.bytes_read)

