"""Checkpoint bytes read straight into their final place, in parallel, once.

`FileReader.read_tensor(record, out)` fills `out` (a view of a host store, a CPU tensor or a device tensor) with
one tensor of a safetensors file. A host destination of the file's dtype is read into directly with `preadv`
(no mapping, no intermediate copy); any other (a cast, or the device) goes through a small staging buffer per reader
thread, piece by piece. A tensor larger than a piece is read by several threads at once (the reads release the
GIL), so a fast disk sees several requests in flight. The pages each read brings into the page cache are dropped
as soon as it is done (loading/pagecache.py), so that after the load the process and its cgroup hold the weights
once, in their final place.

The reader counts what it read (bytes, those that were cached before, seconds) for the load's report.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from chunkflow.loading.pagecache import PageCacheState
from chunkflow_planner.checkpoint import CheckpointError, TensorRecord

PIECE_BYTES = 16 * 2**20  # one read request, and one staging buffer per thread
READ_THREADS = 8


@dataclass
class ReadStats:
    """What a reader has read so far."""

    bytes_read: int = 0
    bytes_cached: int = 0  # of those, bytes that were in the page cache before the load
    seconds: float = 0.0  # wall time inside read_tensor
    tensors: int = 0
    files: int = 0
    cache_known: bool = True  # whether the page cache's state could be told for every file

    @property
    def cached_fraction(self) -> float | None:
        if not self.cache_known:
            return None
        return self.bytes_cached / self.bytes_read if self.bytes_read else 0.0


class _Open:
    def __init__(self, path: Path, keep_cache: bool):
        from chunkflow_planner.files import irregular_kind

        try:  # O_NONBLOCK: a file replaced by a FIFO since its header was read fails here instead of blocking
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise CheckpointError(f"{str(path)!r} cannot be opened: {exc.strerror or exc}") from None
        self.path = path
        stat = os.fstat(self.fd)
        kind = irregular_kind(stat.st_mode)
        if kind is not None:
            os.close(self.fd)
            raise CheckpointError(f"{str(path)!r} is {kind}, not a safetensors file; download or save the model again")
        self.size = stat.st_size
        self.mtime_ns = stat.st_mtime_ns
        self.cache = PageCacheState(self.fd, self.size, keep=keep_cache)


def _buffer(address: int, nbytes: int):
    """A writable buffer over `nbytes` of memory at `address` (a tensor's storage)."""
    return (ctypes.c_char * nbytes).from_address(address)


class FileReader:
    """Reads tensors of safetensors files into tensors (module docstring). Use as a context manager, or `close()`:
    the files' remaining added pages are dropped and the staging buffers freed."""

    def __init__(self, threads: int = READ_THREADS, piece_bytes: int = PIECE_BYTES, keep_cache: bool = False,
                 on_bytes: Callable[[int], None] | None = None, drop_all: bool = False):
        self.threads = max(1, int(threads))
        self.piece = max(4096, int(piece_bytes)) // 4096 * 4096
        self.keep_cache = keep_cache
        self.drop_all = drop_all  # drop every page a read touches, cached before or not (the disk tier's reads)
        self.on_bytes = on_bytes
        self.stats = ReadStats()
        self._files: dict[Path, _Open] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._staging: list = []  # every staging store, freed at close
        self._lock = threading.Lock()

    # ---- files

    def file(self, path: Path) -> _Open:
        path = Path(path).resolve()  # a cache's symlinked snapshot and its blob are one file
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _Open(path, self.keep_cache)
            if self.drop_all:
                f.cache.before = None  # as if nothing were cached: release() drops every page of a range
            self.stats.files += 1
            self.stats.cache_known &= f.cache.known
        return f

    def watch(self, folder: Path) -> None:
        """Note the page cache's state of every safetensors file in `folder` now, before their headers are read, so
        that what reading them brings in (headers included) is dropped at close."""
        for path in sorted(Path(folder).glob("*.safetensors")):
            if path.is_file():
                self.file(path)

    def close(self) -> None:
        if self._pool is not None:  # first: no read may be in flight when its file is closed
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for f in self._files.values():
            f.cache.release()
            os.close(f.fd)
        self._files = {}
        for store in self._staging:
            store.release()
        self._staging = []
        self._local = threading.local()  # the calling thread's references to the staging buffers go too

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading

    def _pread(self, f: _Open, address: int, nbytes: int, offset: int) -> None:
        """Read exactly `nbytes` at `offset` into memory at `address`, then drop the pages it added."""
        done = 0
        while done < nbytes:
            try:
                n = os.preadv(f.fd, [_buffer(address + done, nbytes - done)], offset + done)
            except OSError as exc:
                raise CheckpointError(f"{str(f.path)!r} cannot be read at byte {offset + done}: "
                                      f"{exc.strerror or exc}") from None
            if n <= 0:
                raise CheckpointError(f"{str(f.path)!r} ended at byte {offset + done}, inside a tensor its header "
                                      "places there; it is truncated: download or save it again")
            done += n
        f.cache.release(offset, offset + nbytes)

    def _staging_buffer(self, pinned: bool) -> torch.Tensor:
        """This thread's staging buffer (PIECE_BYTES; page-locked when the destination is a CUDA device)."""
        key = "pinned" if pinned else "plain"
        buf = getattr(self._local, key, None)
        if buf is None:
            from chunkflow.runtime.store import HostStore

            store = HostStore(self.piece, pin=pinned)
            with self._lock:
                self._staging.append(store)
            buf = store.data
            setattr(self._local, key, buf)
        return buf

    def _pieces(self, n: int, align: int) -> list[tuple[int, int]]:
        step = max(align, self.piece // align * align)
        return [(a, min(a + step, n)) for a in range(0, n, step)]

    def _run(self, jobs: list[Callable[[], None]]) -> None:
        if len(jobs) == 1 or self.threads == 1:
            for job in jobs:
                job()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="chunkflow-read")
        futures = [self._pool.submit(job) for job in jobs]
        errors = [fut.exception() for fut in futures]  # every piece done (or failed) before anything is raised
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def read_tensor(self, rec: TensorRecord, out: torch.Tensor) -> None:
        """Fill `out` (its shape; any dtype of the same kind, any device) with the tensor `rec` describes."""
        self.read_into(rec.file, rec.begin, rec.nbytes, out, getattr(torch, rec.dtype_name), rec.itemsize, rec.key)

    def read_into(self, path: Path, begin: int, nbytes: int, out: torch.Tensor, src_dtype: torch.dtype = torch.uint8,
                  itemsize: int = 1, what: str = "") -> None:
        """Fill `out` with the `nbytes` at `begin` of the file at `path`, which hold `src_dtype` elements (cast on the
        way in where `out` has another dtype; staged where `out` is on a device)."""
        t0 = time.perf_counter()
        f = self.file(path)
        what = f"tensor {what!r}" if what else f"bytes [{begin}, {begin + nbytes})"
        if f.size < begin + nbytes:
            raise CheckpointError(f"{str(path)!r} is {f.size} bytes, but its header places {what} up to byte "
                                  f"{begin + nbytes}; it is truncated: download or save it again")
        if not out.is_contiguous():
            raise CheckpointError(f"{what} has a non-contiguous destination; cannot load into it")
        direct = (out.device.type == "cpu" and out.dtype == src_dtype
                  and out.numel() * out.element_size() == nbytes)
        if nbytes == 0:
            pass
        elif direct:
            base = out.data_ptr()
            self._run([lambda a=a, b=b: self._pread(f, base + a, b - a, begin + a)
                       for a, b in self._pieces(nbytes, 1)])
        else:
            flat = out.view(-1)
            pinned = out.device.type == "cuda"

            def piece(a: int, b: int) -> None:
                with torch.cuda.device(out.device) if pinned else contextlib.nullcontext():  # this thread's GPU
                    buf = self._staging_buffer(pinned)
                    self._pread(f, buf.data_ptr(), b - a, begin + a)
                    # from page-locked memory with non_blocking=False: returns once the copy is done, so the
                    # buffer can take this thread's next piece
                    flat[a // itemsize: b // itemsize].copy_(buf[: b - a].view(src_dtype))

            self._run([lambda a=a, b=b: piece(a, b) for a, b in self._pieces(nbytes, itemsize)])
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.bytes_cached += f.cache.cached_bytes(begin, begin + nbytes)
            self.stats.tensors += 1
            self.stats.seconds += time.perf_counter() - t0
        if self.on_bytes is not None:
            self.on_bytes(nbytes)

    def same_bytes(self, a: TensorRecord, b: TensorRecord) -> bool:
        """Whether two records hold the same bytes (a tied tensor saved under two names)."""
        if a.nbytes != b.nbytes or a.dtype != b.dtype:
            return False
        if a.file == b.file and a.begin == b.begin:
            return True
        fa, fb = self.file(a.file), self.file(b.file)
        for lo, hi in self._pieces(a.nbytes, 1):
            x, y = bytearray(hi - lo), bytearray(hi - lo)
            self._pread(fa, ctypes.addressof(ctypes.c_char.from_buffer(x)), hi - lo, a.begin + lo)
            self._pread(fb, ctypes.addressof(ctypes.c_char.from_buffer(y)), hi - lo, b.begin + lo)
            if x != y:
                return False
        return True
