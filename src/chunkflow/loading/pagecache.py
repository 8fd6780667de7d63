"""What of a file the kernel's page cache held before this process read it, and giving back what reading added.

A buffered read leaves the file's pages in the page cache, charged to the reading process's cgroup (a container's
memory limit counts them) and taking the NUMA node's free memory that pinned allocations need next. chunkflow
reads each checkpoint once into its final place, so those pages are dead weight after the read: the loader drops
the ones its reads brought in (`posix_fadvise(POSIX_FADV_DONTNEED)`) and keeps those that were cached before it
started (another process's, or a user's `cat`), found with `mincore(2)` on a mapping of the file that is never
touched. Where the calls do not exist (not Linux), nothing is known and nothing is dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore's byte per page: bit 0 is "resident"
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name, use_errno=True) if name else None
        if lib is not None and hasattr(lib, "mincore"):
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _LIBC = lib or False
    return _LIBC or None


def resident_pages(fd: int, size: int) -> bytearray | None:
    """One byte per page of the file, 1 where the page is in the page cache now; None where it cannot be told."""
    lib = _libc()
    if lib is None or size == 0:
        return bytearray() if size == 0 else None
    addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        n = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * n)()
        if lib.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return None
        return bytearray(bytes(vec).translate(_LOW_BIT))
    finally:
        lib.munmap(ctypes.c_void_p(addr), size)


def can_drop() -> bool:
    """Whether this system can drop a file's pages from the page cache."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def drop(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop the file's clean pages in [offset, offset + length) (0: to the end) from the page cache."""
    if can_drop():
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


class PageCacheState:
    """One open file's pages as they were when the loader opened it: `cached_bytes` of a range, and `release` of
    the pages in a range that were not cached then (the loader's own reads, and the kernel's read-ahead)."""

    def __init__(self, fd: int, size: int, keep: bool = False):
        self.fd = fd
        self.size = size
        self.keep = keep  # keep everything cached (calibrate's warm read)
        self.before = resident_pages(fd, size)

    @property
    def known(self) -> bool:
        return self.before is not None

    def cached_bytes(self, begin: int, end: int) -> int:
        """Bytes of [begin, end) that were in the page cache at open (0 where it cannot be told)."""
        if not self.before or end <= begin:
            return 0
        first, last = begin // PAGE, (end - 1) // PAGE
        pages = self.before[first:last + 1]
        hit = sum(pages) * PAGE
        if pages[0]:
            hit -= begin - first * PAGE
        if pages[-1]:
            hit -= (last + 1) * PAGE - end
        return max(0, hit)

    def release(self, begin: int = 0, end: int | None = None) -> None:
        """Drop the pages of [begin, end) that were not cached at open (all of them where that is unknown)."""
        if self.keep or not can_drop():
            return
        end = self.size if end is None else min(end, self.size)
        first, last = begin // PAGE, -(-end // PAGE)
        if self.before is None:
            drop(self.fd, first * PAGE, (last - first) * PAGE)
            return
        page = first
        while page < last:
            start = self.before.find(0, page, last)  # the next page that was not cached
            if start < 0:
                return
            stop = self.before.find(1, start, last)
            page = last if stop < 0 else stop
            drop(self.fd, start * PAGE, (page - start) * PAGE)
