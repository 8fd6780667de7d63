"""The disk tier: blocks whose streamed bytes stay in the checkpoint's own safetensors files, read each forward;
and a parked module's non-block tensors kept in those files (`DiskParking`).

With a codec (OffloadConfig.codec, runtime/codecs/stream.py) a disk block's tail is read from the files once, at
layout, encoded, and written to a spill file chunkflow owns (in CHUNKFLOW_CACHE_DIR or ~/.cache/chunkflow, unlinked
as it is made: gone with the process, even one killed; never in the checkpoint's folder); each forward then reads
its encoded bytes (about 0.7 of them for bf16) into the ring and the streamer copies and decodes them as it does the
encoded tier's. Outside the forward its tensors are the checkpoint's, mapped, as below.

A plan's `disk_blocks` (chunkflow_planner.offload.disk_block_indices: spread evenly over the blocks) keep their
resident head [0, R_l) as every block does (host store, resident buffer); their streamed tail [R_l, V_l) is not in
host memory. A reader thread reads a disk block's tail straight from the files (offsets from their headers) into one
of DISK_RING_BLOCKS page-locked ring buffers, running that many disk blocks ahead of the copy stream; the streamer
copies its chunks from the ring buffer as it copies a host block's from the host store (runtime/streamer.py), then
records an event on the copy stream after which the buffer may take the next read. The reads drop the pages they
bring into the page cache (FileReader), so host memory holds the ring, not the weights.

Outside its forward a tail tensor is a private, copy-on-write map of its bytes in the file: a normal tensor with the
file's values that costs no memory until read. The files are checked when the tier is made (readable, long enough,
each tensor where its header says, in the dtype the block stores) and before and after every read: its size,
modification time and inode, and the kernel's word that no process wrote it (runtime/filewatch.py: a rewrite in place
with its modification time restored is seen too). A checkpoint changed after offload is an error at the next forward,
`state_dict()` or `remove()`, never other weights. Not seen: writes through another process's shared map of the file,
or from another machine on a network file system that keep size and times (a documented limit). A write to a tail tensor (peft's merge,
load_state_dict) or a new tensor inside a disk block moves that block to the host tier at the next forward (its
current values copied into the host store, a warning saying so): the file is never written and never disagrees.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from chunkflow.runtime.codecs import codec_of
from chunkflow.runtime.codecs.stream import CodecStream, EncodedBlock, layout_key
from chunkflow.runtime.errors import OffloadError, warn_user
from chunkflow.runtime.filewatch import FileWatch
from chunkflow.runtime.layout import BlockLayout, TensorEntry
from chunkflow.runtime.store import HostStore, own_storage
from chunkflow.runtime.tensors import all_tensors
from chunkflow.runtime.tiers.base import ParkHome, Tier
from chunkflow.runtime.tiers.host import HostParking
from chunkflow_planner.checkpoint import TensorRecord
from chunkflow_planner.offload import DISK_RING_BLOCKS

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle


READ_PIECE = 16 << 20  # a tail is read in pieces this large, so that a read no longer wanted stops within one (11 ms
# at 1.44 GB/s, the H200 host's NVMe, docs/tiers-h200.md)


def spill_dir() -> Path:
    """Where a codec's spill file for the disk blocks goes: CHUNKFLOW_CACHE_DIR, else ~/.cache/chunkflow (a disk,
    where /tmp may be memory)."""
    env = os.environ.get("CHUNKFLOW_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "chunkflow"


def _spill_failed(folder: Path, exc: OSError, written: int) -> str:
    """Why the codec's spill file could not be written in the cache folder `folder`, and what to do."""
    import errno

    from chunkflow_planner.units import format_bytes

    env = os.environ.get("CHUNKFLOW_CACHE_DIR")
    named = f"CHUNKFLOW_CACHE_DIR {str(folder)!r}" if env else f"the cache folder {str(folder)!r}"
    why = {errno.ENOSPC: "its file system is full", errno.EDQUOT: "your disk quota there is used up",
           errno.EFBIG: "a limit on file size (ulimit -f) stops the file"}.get(exc.errno, exc.strerror or str(exc))
    return (f"the codec's spill file for the disk blocks cannot be written in {named}: {why} (after "
            f"{format_bytes(written)}; it is removed). Free space there, or set CHUNKFLOW_CACHE_DIR to a folder on a "
            "disk with room for the encoded disk blocks, or run without the codec (--codec off); the output and "
            "the checkpoint were not touched")


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


class _Cancelled(Exception):
    """A read ended before its end: no longer wanted (stop(cancel=True))."""


class DiskTierError(OffloadError):
    """The disk tier cannot read what it was given, or its files changed; the message says which and what to do."""


class DiskFiles(Protocol):
    """What a loader's TensorSource gives the disk tier (`source.disk_files()`): where each tensor lies in the files,
    and a reader of raw byte ranges that leaves nothing in the page cache."""

    def record(self, name: str) -> TensorRecord | None: ...

    def read_range(self, path: Path, begin: int, nbytes: int, out: torch.Tensor) -> None: ...

    def read_tensor(self, rec: TensorRecord, out: torch.Tensor) -> None: ...

    def close(self) -> None: ...

    # optional: `header_end(path)`, where a file's tensor data may start (a GGUF file's data section); without it
    # the file is a safetensors file (8 bytes of length, then its JSON header)


@dataclass(frozen=True)
class _Part:
    """The bytes of one tail tensor a read fills: [skip, nbytes) of the tensor (in the block's dtype), at `at` of the
    ring buffer; `held`: the file stores it in another dtype, so a converted copy of it is kept in host memory and
    copied from (the small tensors a model keeps in float32, such as norms, in a bf16 file)."""

    rec: TensorRecord
    skip: int
    at: int
    key: tuple[int, str]
    held: bool = False


@dataclass(frozen=True)
class _FileState:
    size: int
    mtime_ns: int
    ino: int


def _state(path: Path) -> _FileState:
    st = os.stat(path)
    return _FileState(st.st_size, st.st_mtime_ns, st.st_ino)


def disk_files(source, what: str) -> DiskFiles:
    """The files a loader's `source` reads (`source.disk_files()`); an OffloadError saying what to do where it
    knows none (`what`: the setting that asks for them)."""
    opener = getattr(source, "disk_files", None)
    if opener is None:
        raise OffloadError(f"{what} keeps weights in the checkpoint's files, but this module's weights come from no "
                           "file chunkflow reads: load it from its folder through chunkflow (`chunkflow run --weights "
                           "DIR`, chunkflow.models.build), or leave it out")
    return opener()


class DiskTier(Tier):
    """The disk tier of one handle (module docstring). `blocks`: the block indices whose tails live on disk."""

    name = "disk"
    recycles = True
    demoted_note = "their weights now live in host memory, not on disk"

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> DiskTier | None:
        """The tier `cfg.disk_blocks` asks for, reading the files `source` knows; an error where it knows none."""
        if not cfg.disk_blocks:
            return None
        from chunkflow_planner.offload import disk_block_indices

        codec = codec_of(cfg)  # refused before the files are opened where it cannot be used
        files = disk_files(source, f"disk_blocks={cfg.disk_blocks}")
        if cfg.disk_blocks > n_blocks:
            files.close()
            raise OffloadError(f"disk_blocks={cfg.disk_blocks} but the module has {n_blocks} blocks")
        tier = cls(set(disk_block_indices(n_blocks, cfg.disk_blocks)), files, codec)
        tier.note_records(all_tensors(module))
        return tier

    def __init__(self, blocks: set[int], files: DiskFiles, codec=None):
        self.blocks = set(blocks)
        self.files = files
        self.stream = CodecStream(codec) if codec is not None else None  # with a codec: tails encoded
        self.spill = None  # with a codec: the unlinked file the disk blocks' encoded tails are read from
        self.spill_end = 0
        self.spilled: dict[int, EncodedBlock] = {}  # disk block -> its encoded tail (EncodedBlock.at: in the file)
        self._records: dict[tuple[int, str], TensorRecord] = {}  # (id(owner module), attr) -> record
        self._states: dict[Path, _FileState] = {}
        self._maps: dict[Path, torch.Tensor] = {}  # each file as one private copy-on-write map (uint8)
        self._held: dict[tuple[int, str], torch.Tensor] = {}  # tail tensors stored in another dtype: converted copies
        self.parts: dict[int, list[_Part]] = {}  # disk block -> what its read fills
        self.tail: dict[int, int] = {}  # disk block -> R_l (its ring buffer holds [R_l, V_l))
        self.order: list[int] = []  # disk blocks in execution order
        self.ring: HostStore | None = None
        self.entry_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._reads: dict[int, tuple[Future, int]] = {}  # disk block -> (its read, the ring entry it fills)
        self._free: list[int] = []  # ring entries no read holds
        self._consumed: dict[int, object] = {}  # ring entry -> copy-stream event after its last copy
        self._cancel = threading.Event()  # set: the read in progress ends at its next piece (stop(cancel=True))
        self.bytes_read = 0
        self.reads = 0
        self.stall_s = 0.0
        self.demoted: set[int] = set()
        self._watch = FileWatch()
        self._state_hooks: list = []  # state_dict() of a disk block checks its files first

    # ---- set-up: before the host store is filled

    def note_records(self, tensors) -> None:
        """Where each tensor of the module lies in the files, keyed by its owner (stable when peft wraps a layer)."""
        for t in tensors:
            rec = self.files.record(t.name)
            if rec is not None:
                self._records[(id(t.owners[0][0]), t.owners[0][1])] = rec

    def claim(self, b: BlockLayout) -> bool:
        """Block b's tail stays on disk where the setting put it there and every tail tensor is in the files; one
        with a tensor the files lack (a LoRA layer) goes to the host tier."""
        self.parts.pop(b.index, None)
        if b.index not in self.blocks or not b.is_streamed:
            return False
        parts = self._parts_of(b)
        if parts is None:
            self.blocks.discard(b.index)
            self.demoted.add(b.index)
            return False
        self.parts[b.index], self.tail[b.index] = parts, b.resident_bytes
        return True

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """Check every tail tensor of the disk blocks against its file and map the files; then the ring
        (page-locked where `pin`) and the reader. Raises DiskTierError before anything is written."""
        self._check_parts(layouts)
        if self.stream is not None:
            self._spill(layouts, pin)
        if self.order:
            self.entry_bytes = (max(self.spilled[l].nbytes for l in self.order) if self.stream is not None
                                else max(layouts[l].nbytes - self.tail[l] for l in self.order))
            entries = min(DISK_RING_BLOCKS, len(self.order))
            self.ring = HostStore(entries * self.entry_bytes, pin=pin)
            self._free = list(range(entries))
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkflow-disk")

    def _raw_tail(self, b: BlockLayout, device: torch.device) -> torch.Tensor:
        """Block b's tail [R_l, V_l) read from the files onto `device` (gaps zero), as the module holds it."""
        R = b.resident_bytes
        raw = torch.zeros(b.nbytes - R, dtype=torch.uint8, device=device)
        entries = [e for e in b.tensors if e.end > R]
        for e, p in zip(entries, self.parts[b.index]):
            n = p.rec.nbytes - p.skip
            if p.held:  # stored in another dtype: converted as the module holds it
                t = torch.empty(e.shape, dtype=e.dtype)
                self.files.read_tensor(p.rec, t)
                flat = t.reshape(-1).view(torch.uint8)[p.skip:]
                raw[p.at : p.at + flat.numel()].copy_(flat)
            else:
                self.files.read_range(p.rec.file, p.rec.begin + p.skip, n, raw[p.at : p.at + n])
        return raw

    def _spill(self, layouts: list[BlockLayout], pin: bool) -> None:
        """With a codec: every disk block whose layout is new read once from the files, encoded, and written to the
        spill file (an unlinked file in spill_dir(): gone with the process, never in the checkpoint's folder); its
        pages are dropped from the page cache once written."""
        self.stream.set_device(pin, f"codec={self.stream.codec.name!r} with disk_blocks")
        if self.spill is None:
            folder = spill_dir()
            try:
                folder.mkdir(parents=True, exist_ok=True)
                self.spill = tempfile.TemporaryFile(dir=folder)
            except OSError as exc:
                raise DiskTierError(f"the codec's spill file for the disk blocks cannot be made in {str(folder)!r}: "
                                    f"{exc.strerror or exc}; set CHUNKFLOW_CACHE_DIR to a folder on a disk with room, "
                                    "or leave the codec off") from None
        kept = {}
        fd = self.spill.fileno()
        by_key = {blk.key: blk for blk in self.spilled.values()}  # by block and layout: a re-layout in the order
        try:
            for l in self.order:  # the blocks ran moves them to other indices
                old = by_key.get(layout_key(layouts[l]))
                if old is not None:
                    kept[l] = old
                    continue
                blk, pieces = self.stream.encode(layouts[l], self._raw_tail(layouts[l], self.stream.device))
                blk.at = self.spill_end
                for off, data in pieces:
                    _pwrite_all(fd, data.cpu().numpy().tobytes(), blk.at + off)
                self.spill_end += -(-blk.nbytes // 4096) * 4096
                kept[l] = blk
            os.ftruncate(fd, self.spill_end)  # the last block's alignment padding is in the file too
            os.fsync(fd)
        except OSError as exc:  # a full cache disk (ENOSPC), a quota, an I/O error: the cache folder's, said so
            raise DiskTierError(_spill_failed(spill_dir(), exc, self.spill_end)) from None
        self.spilled = kept
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _read_spill(self, at: int, nbytes: int, base: int) -> None:
        """`nbytes` of the spill file from `at` into the ring from `base`, in pieces (a read no longer wanted ends at
        the next one), their pages dropped from the page cache."""
        fd = self.spill.fileno()
        ring = self.ring.data.numpy()
        for a in range(0, nbytes, READ_PIECE):
            if self._cancel.is_set():
                raise _Cancelled
            k = min(READ_PIECE, nbytes - a)
            view = memoryview(ring[base + a : base + a + k])
            got = 0
            while got < k:
                n = os.preadv(fd, [view[got:]], at + a + got)
                if n <= 0:
                    raise DiskTierError("the codec's spill file ended before its bytes; it was changed or truncated "
                                        "by another program: offload (load) the model again")
                got += n
            self.bytes_read += k
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, at, nbytes, os.POSIX_FADV_DONTNEED)

    def source(self, store: HostStore, b: BlockLayout, non_blocking: bool):
        """With a codec: the block's encoded tail in its ring buffer (the read waited for), copied and decoded."""
        if self.stream is None:
            return super().source(store, b, non_blocking)
        buf, _ = self.acquire(store, b)
        return self.stream.source(self.spilled[b.index], buf, [self.spilled[l] for l in self.order])

    def _check_parts(self, layouts: list[BlockLayout]) -> None:
        """The blocks this tier took, each tail tensor checked against its file and the files mapped."""
        self.order = [b.index for b in layouts if b.tier is self]
        self.parts = {l: self.parts[l] for l in self.order}
        self.tail = {l: self.tail[l] for l in self.order}
        self._check_held(layouts)
        for path in {p.rec.file for ps in self.parts.values() for p in ps}:
            self._check_file(path)

    def _parts_of(self, b: BlockLayout) -> list[_Part] | None:
        """The reads that fill block b's tail, or None where a tail tensor is not in the files."""
        R = b.resident_bytes
        parts = []
        for e in b.tensors:
            if e.end <= R:
                continue
            key = (id(e.owners[0][0]), e.owners[0][1])
            rec = self._records.get(key)
            if rec is None:
                return None
            held = self._check_record(b, e, rec)
            skip = max(0, R - e.offset)
            parts.append(_Part(rec, skip, e.offset + skip - R, key, held))
        return parts

    def _check_held(self, layouts: list[BlockLayout]) -> None:
        """Converted copies are for a few small tensors: a file whose big tensors are in another dtype is refused."""
        held = sum(p.rec.nbytes for l in self.order for p in self.parts[l] if p.held)
        total = sum(p.rec.nbytes for l in self.order for p in self.parts[l])
        if total and held > total / 8:
            p = next(p for l in self.order for p in self.parts[l] if p.held)
            raise DiskTierError(
                f"{p.rec.key} is {p.rec.dtype_name} in {p.rec.file.name} but the module runs it in another dtype, as "
                f"{held / total:.0%} of the bytes the disk tier would read; it reads the file's bytes as they are. "
                "Save the model once in its run dtype (`Model.from_pretrained(dir, torch_dtype=...)"
                ".save_pretrained(out)`), or plan with more host memory")

    def _check_record(self, b: BlockLayout, e: TensorEntry, rec: TensorRecord) -> bool:
        """Whether the tensor is stored in another dtype than the block holds it (a converted copy is held)."""
        stored = getattr(torch, rec.dtype_name, None)
        if e.compute_dtype is not None:
            raise DiskTierError(f"{b.name}.{e.name} is stored in fp8 by this offload; the disk tier reads the file's "
                                "bytes as they are: use weight_dtype bf16 with a disk tier")
        if stored != e.dtype or rec.nbytes != e.nbytes:
            return True
        if rec.begin % max(1, e.dtype.itemsize):
            raise DiskTierError(f"{b.name}.{e.name} starts at byte {rec.begin} of {rec.file.name}, not a multiple of "
                                f"its {e.dtype.itemsize}-byte elements; re-save the checkpoint with safetensors")

    def _check_file(self, path: Path) -> None:
        """The file is readable and holds every tail tensor's bytes; its state is noted (reads compare it)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise DiskTierError(f"{str(path)!r} cannot be read for the disk tier: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            end = max(p.rec.end for ps in self.parts.values() for p in ps if p.rec.file == path)
            if st.st_size < end:
                raise DiskTierError(f"{str(path)!r} is {st.st_size} bytes but its header places tensors up to byte "
                                    f"{end}; it is truncated: download or save it again")
            header_end = getattr(self.files, "header_end", None)  # a format's own (GGUF), else safetensors'
            end_of_header = (header_end(path) if header_end is not None
                             else 8 + int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little"))
            first = min(p.rec.begin for ps in self.parts.values() for p in ps if p.rec.file == path)
            if end_of_header > first:
                raise DiskTierError(f"{str(path)!r}'s header ({end_of_header} bytes) overlaps the tensors it "
                                    "describes; the file changed since it was opened or is damaged: download or save "
                                    "it again")
            if path not in self._maps:  # private: a write to a tail tensor never reaches the file
                mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self._maps[path] = torch.frombuffer(mm, dtype=torch.uint8)
        finally:
            os.close(fd)
        state = _state(path)
        if self._states.setdefault(path, state) != state:
            raise self._changed(path)
        self._watch.add(path)
        if path in self._watch.changed():
            raise self._changed(path)

    def _changed(self, path: Path) -> DiskTierError:
        return DiskTierError(f"{str(path)!r} changed after the model was offloaded with part of its weights read "
                             "from it (written, or its size, modification time or inode differ); its weights are no "
                             "longer the model's. Offload (load) the model again, or handle.discard() to drop it")

    def verify(self) -> None:
        """Every file still as it was offloaded (state and the kernel's word); DiskTierError naming one that is not."""
        self._unchanged(list(self._states))

    def files_read(self) -> set[Path]:
        return set(self._states)

    def check_dtypes(self, layouts: list[BlockLayout], mapping: dict[torch.dtype, torch.dtype]) -> None:
        """A dtype change of the module (`mapping`) is refused where it would change a tensor the disk tier reads from
        its file (the file holds the old dtype; the block would have to move to host memory whole), before anything
        changes."""
        hit = [(b, e) for b in layouts if b.index in self.parts for e in b.tensors
               if e.end > b.resident_bytes and e.dtype in mapping]
        if not hit:
            return
        from chunkflow_planner.units import format_bytes

        b, e = hit[0]
        held = sum(layouts[l].nbytes - self.tail[l] for l in self.order)
        raise DiskTierError(
            f"cannot change {b.name}.{e.name} from {str(e.dtype).removeprefix('torch.')} to "
            f"{str(mapping[e.dtype]).removeprefix('torch.')}: {len(self.order)} block(s) keep their weights in the "
            f"checkpoint's files in the dtype they have now, and a change would need all of them in host memory "
            f"({format_bytes(held)}); nothing was changed. Load the model in the dtype you want "
            "(`torch_dtype=` / `chunkflow run` plans it), or offload it without disk blocks")

    def _rec(self, e: TensorEntry) -> TensorRecord:
        return self._records[(id(e.owners[0][0]), e.owners[0][1])]

    def view(self, store: HostStore, b: BlockLayout, e: TensorEntry) -> torch.Tensor:
        """Tensor e of a disk block outside its forward; one of its tail: its bytes in the file, mapped copy-on-write
        (a converted copy in host memory where the file stores another dtype)."""
        if e.end <= b.resident_bytes:
            return super().view(store, b, e)
        rec = self._rec(e)
        if getattr(torch, rec.dtype_name, None) == e.dtype and rec.nbytes == e.nbytes:  # a storage of its own, as
            # the host store's views have (HostStore.alias)
            return own_storage(self._maps[rec.file][rec.begin:rec.end]).view(e.dtype).view(e.shape)
        key = (id(e.owners[0][0]), e.owners[0][1])
        if key not in self._held:
            held = torch.empty(e.shape, dtype=e.dtype)
            self.files.read_tensor(rec, held)
            self._held[key] = held
        return self._held[key]

    def supply(self, store: HostStore, b: BlockLayout, e: TensorEntry, write) -> bool:
        """A tail tensor's values are the file's (nothing is read: `write` is not used): the part of one straddling
        R_l that lies in the head is copied from there into the store."""
        if e.end <= b.resident_bytes:
            return False
        if e.offset < b.resident_bytes:
            head = self.view(store, b, e).reshape(-1).view(torch.uint8)[:b.resident_bytes - e.offset]
            store.view(b.host_offset + e.offset, b.resident_bytes - e.offset).copy_(head)
        return True

    def host_extent(self, b: BlockLayout) -> int:
        """Only the head is in the host store."""
        return b.resident_bytes

    # ---- the handle's part

    def attach(self, handle: OffloadHandle) -> None:
        """Say which blocks moved to the host tier since the last layout; a disk block's state_dict() checks the files
        first (outside a forward its tail tensors read them)."""
        self._state_hooks = [handle.layouts[l].module.register_state_dict_pre_hook(self._before_state_dict)
                             for l in self.order]
        if self.demoted:
            warn_user(f"chunkflow: block(s) {', '.join(map(str, sorted(self.demoted)))} hold tensors the checkpoint's "
                      f"files do not (a LoRA layer?) or were written; {self.demoted_note}", DiskTierWarning)
            self.demoted = set()

    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        self.verify()

    def detach(self, handle: OffloadHandle) -> None:
        self._held = {}  # converted copies are made again for the next layout's tensors
        for h in self._state_hooks:
            h.remove()
        self._state_hooks = []
        self.stop()
        if self.stream is not None:
            self.stream.drop_device()
        if self.ring is not None:
            self.ring.release()
        self.ring = None

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        """The reader thread ends and the files close; the maps go with the last tensor viewing them."""
        self.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.files.close()
        self._watch.close()
        self._maps = {}
        if self.spill is not None:  # unlinked already: closing it gives its room back
            self.spill.close()
            self.spill = None
        self.spilled = {}

    def demote(self, blocks: set[int]) -> bool:
        """Blocks written while on disk go to the host tier at the next layout; whether any did."""
        hit = blocks & self.blocks
        self.blocks -= hit
        self.demoted |= hit
        return bool(hit)

    # ---- reads (the reader thread) and what the streamer asks

    def _read(self, l: int, entry: int, after) -> int:
        if after is not None and hasattr(after, "synchronize"):
            after.synchronize()  # the copies out of this buffer are done
        base = entry * self.entry_bytes
        paths = {p.rec.file for p in self.parts[l]}
        self._unchanged(paths)
        if self.stream is not None:  # its encoded tail, from the spill file
            blk = self.spilled[l]
            self._read_spill(blk.at, blk.nbytes, base)
            self._unchanged(paths)
            self.reads += 1
            return entry
        try:
            for p in self.parts[l]:
                if p.held:  # converted once: copied from host memory
                    src = self._held[p.key].reshape(-1).view(torch.uint8)
                    self.ring.view(base + p.at, src.numel() - p.skip).copy_(src[p.skip:])
                    continue
                n = p.rec.nbytes - p.skip
                for a in range(0, n, READ_PIECE):  # in pieces: a read no longer wanted ends at the next one
                    if self._cancel.is_set():
                        raise _Cancelled
                    k = min(READ_PIECE, n - a)
                    self.files.read_range(p.rec.file, p.rec.begin + p.skip + a, k, self.ring.view(base + p.at + a, k))
                    self.bytes_read += k
        except _Cancelled:
            raise
        except Exception:
            self._unchanged(paths)  # a file changed under the read: say that, not what the read met
            raise
        self._unchanged(paths)  # changed while it was read: these bytes may be of two versions
        self.reads += 1
        return entry

    def _unchanged(self, paths) -> None:
        written = self._watch.changed()
        for path in paths:
            if path in written:
                raise self._changed(path)
            try:
                state = _state(path)
            except OSError:
                state = None
            if state != self._states[path]:
                raise self._changed(path)

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

    def prepare(self, b: BlockLayout) -> None:
        """Block b's read started if none is in flight for it."""
        if b.index not in self._reads:
            self._restart(b.index)

    def pause(self) -> None:
        """Parked: the reads ahead are not wanted until the next forward (which reads again from its first block):
        those not started are cancelled, the one in progress ends at its next piece; a codec's device buffers go."""
        self.stop(cancel=True)
        if self.stream is not None:
            self.stream.drop_device()

    def acquire(self, store: HostStore, b: BlockLayout) -> tuple[torch.Tensor, int]:
        """Block l's tail bytes, read (waiting for the read: a stall), and R_l: chunk [lo, hi) is at lo - R_l."""
        l = b.index
        if l not in self._reads:
            self._restart(l)
        fut, entry = self._reads[l]
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()
            self.stall_s += time.perf_counter() - t0
        fut.result()  # raises what the read met
        base = entry * self.entry_bytes
        return self.ring.data[base:base + self.entry_bytes], self.tail[l]

    def release(self, l: int, copied) -> None:
        """Block l's copies are enqueued: its buffer takes the read of the disk block DISK_RING_BLOCKS on, once they
        are done (`copied`: an event recorded on the copy stream after them)."""
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

    def tail_bytes(self, layouts: list[BlockLayout]) -> int:
        """Bytes a forward reads from disk: every disk block's tail (encoded, with a codec)."""
        if self.stream is not None:
            return sum(self.spilled[l].nbytes for l in self.order)
        return sum(layouts[l].nbytes - self.tail[l] for l in self.order)

    def stats(self, layouts: list[BlockLayout]) -> dict:
        out = dict(disk_blocks=len(self.order), disk_bytes_per_step=self.tail_bytes(layouts),
                   disk_bytes_read=self.bytes_read, disk_read_stall_s=self.stall_s,
                   disk_ring_bytes=self.ring.nbytes if self.ring is not None else 0)
        if self.stream is not None:
            blks = [self.spilled[l] for l in self.order]
            out.update(codec_disk_blocks=len(blks), codec_disk_raw_bytes=sum(b.raw_bytes for b in blks),
                       codec_disk_stored_bytes=sum(b.stored_bytes for b in blks), codec_spill_bytes=self.spill_end,
                       codec_disk_staging_bytes=sum(t.numel() for t in self.stream.staging))
        return out


class DiskTierWarning(UserWarning):
    """Blocks moved from the disk tier to host memory (written, or holding tensors the files lack)."""


class DiskParking(ParkHome):
    """A parked module's non-block tensors left in the checkpoint's files (`offload(park_to="disk")`).

    While parked, a tensor whose file holds it in its dtype is a private copy-on-write map of its bytes (no memory
    until read; the pages a read touched are given back at unpark); the rest (not in the files, stored in another
    dtype, or written since it was read) wait in host memory as `HostParking` keeps them. Unpark reads each from its
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
        self.host = HostParking()  # the tensors the files cannot give back
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
