"""What the tiers that read a module's weights from the checkpoint's own safetensors files share (a helper, not a
tier): the files a loader gives (`DiskFiles`, `disk_files`), their state, and `FileValues`, the files as the home of
some blocks' tail tensors outside the forward.

`FileValues` takes a block whose every tail tensor [R_l, V_l) is in the files (one the files lack, such as a LoRA
layer, goes to the next tier), checks each against its file when the layout is made (readable, long enough, each
tensor where its header says, in the dtype the block stores) and maps the files: outside its forward a tail tensor is
a private, copy-on-write map of its bytes in the file, a normal tensor with the file's values that costs no memory
until read. The files are watched (their size, modification time and inode, and the kernel's word that no process
wrote them: runtime/filewatch.py); a checkpoint changed after offload is an error at the next forward, `state_dict()`
or `remove()`, never other weights. A write to a tail tensor (peft's merge, load_state_dict) or a new tensor inside a
block moves that block to the next tier at the next layout (a warning says so): the file is never written. It also
reads a block's tail as the module holds it (`raw_tail`), for a tier that keeps those bytes in another form.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from chunkflow.runtime.errors import OffloadError, warn_user
from chunkflow.runtime.filewatch import FileWatch
from chunkflow.runtime.layout import BlockLayout, TensorEntry
from chunkflow.runtime.store import HostStore, own_storage
from chunkflow.runtime.tiers.base import store_view
from chunkflow_planner.checkpoint import TensorRecord

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle


class DiskTierError(OffloadError):
    """The disk tier cannot read what it was given, or its files changed; the message says which and what to do."""


class DiskTierWarning(UserWarning):
    """Blocks moved from the disk tier to host memory (written, or holding tensors the files lack)."""


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


def pwrite_all(fd: int, data: bytes, at: int) -> None:
    """`data` written at byte `at` of the file `fd`, however many writes it takes."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


class FileValues:
    """Some blocks' tail tensors at home in the checkpoint's files (module docstring). `blocks`: the block indices it
    may take; `demoted_note`: what the warning says of blocks that leave it."""

    def __init__(self, blocks: set[int], files: DiskFiles, demoted_note: str):
        self.blocks = set(blocks)
        self.files = files
        self.demoted_note = demoted_note
        self._records: dict[tuple[int, str], TensorRecord] = {}  # (id(owner module), attr) -> record
        self._states: dict[Path, _FileState] = {}
        self._maps: dict[Path, torch.Tensor] = {}  # each file as one private copy-on-write map (uint8)
        self._held: dict[tuple[int, str], torch.Tensor] = {}  # tail tensors stored in another dtype: converted copies
        self.parts: dict[int, list[_Part]] = {}  # block -> where its tail tensors lie in the files
        self.tail: dict[int, int] = {}  # block -> R_l
        self.order: list[int] = []  # its blocks in execution order
        self.demoted: set[int] = set()
        self._watch = FileWatch()
        self._state_hooks: list = []  # state_dict() of one of its blocks checks its files first

    def note_records(self, tensors) -> None:
        """Where each tensor of the module lies in the files, keyed by its owner (stable when peft wraps a layer)."""
        for t in tensors:
            rec = self.files.record(t.name)
            if rec is not None:
                self._records[(id(t.owners[0][0]), t.owners[0][1])] = rec

    def claim(self, b: BlockLayout) -> bool:
        """Whether block b's tail is at home here: one of its blocks, streamed, every tail tensor in the files; one
        with a tensor the files lack (a LoRA layer) goes to the next tier."""
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

    def laid_out(self, layouts: list[BlockLayout], owner) -> None:
        """The blocks tier `owner` took, each tail tensor checked against its file and the files mapped; raises
        DiskTierError before anything is written."""
        self.order = [b.index for b in layouts if b.tier is owner]
        self.parts = {l: self.parts[l] for l in self.order}
        self.tail = {l: self.tail[l] for l in self.order}
        self._check_held(layouts)
        for path in {p.rec.file for ps in self.parts.values() for p in ps}:
            self._check_file(path)

    def paths(self, l: int) -> set[Path]:
        """The files block l's tail is read from."""
        return {p.rec.file for p in self.parts[l]}

    def converted(self, p: _Part) -> torch.Tensor:
        """The converted copy of a tail tensor the file stores in another dtype (made by `view` at the fill)."""
        return self._held[p.key]

    def raw_tail(self, b: BlockLayout, device: torch.device) -> torch.Tensor:
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
        self.unchanged(list(self._states))

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
        """Tensor e of one of its blocks outside its forward; one of its tail: its bytes in the file, mapped
        copy-on-write (a converted copy in host memory where the file stores another dtype)."""
        if e.end <= b.resident_bytes:
            return store_view(store, b, e)
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

    def attach(self, handle: OffloadHandle) -> None:
        """Say which blocks moved to the next tier since the last layout; one of its blocks' state_dict() checks the
        files first (outside a forward its tail tensors read them)."""
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

    def close(self) -> None:
        """The files close; the maps go with the last tensor viewing them."""
        self.files.close()
        self._watch.close()
        self._maps = {}

    def demote(self, blocks: set[int]) -> bool:
        """Blocks written while here go to the next tier at the next layout; whether any of its own did."""
        hit = blocks & self.blocks
        self.blocks -= hit
        self.demoted |= hit
        return bool(hit)

    def unchanged(self, paths) -> None:
        """DiskTierError where one of `paths` changed since offload."""
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


class ValuesInFiles:
    """The Tier methods of a tier whose blocks' values outside the forward are the checkpoint's files (`self.values`,
    a FileValues): the disk tier and the codec layer over its files, which differ only in where a block streams
    from."""

    values: FileValues

    def host_extent(self, b: BlockLayout) -> int:
        return self.values.host_extent(b)

    def supply(self, store: HostStore, b: BlockLayout, e, write) -> bool:
        return self.values.supply(store, b, e, write)

    def view(self, store: HostStore, b: BlockLayout, e) -> torch.Tensor:
        return self.values.view(store, b, e)

    def verify(self) -> None:
        self.values.verify()

    def files_read(self) -> set[Path]:
        return self.values.files_read()

    def check_dtypes(self, layouts: list[BlockLayout], mapping: dict[torch.dtype, torch.dtype]) -> None:
        self.values.check_dtypes(layouts, mapping)

    def demote(self, blocks: set[int]) -> bool:
        return self.values.demote(blocks)
