"""Writes to files the disk tier reads, told by the kernel (Linux inotify): a rewrite in place that keeps a file's
size, inode and modification time (restored with `utime`) changes its bytes without changing its `stat`.

`FileWatch.changed()` says which watched files any process of this machine opened for writing, wrote, truncated,
moved or deleted since they were watched. It does not see writes made through another process's shared memory map
of the file, or by another machine on a network file system: there the size/mtime/inode check is all there is.
Where inotify is unavailable (not Linux, no free watches) it watches nothing and says so (`active`).
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVE_SELF = 0x800
IN_DELETE_SELF = 0x400
IN_IGNORED = 0x8000
_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVE_SELF | IN_DELETE_SELF
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "inotify_init1") else None
    except OSError:
        return None


class FileWatch:
    """The kernel's word on writes to a set of files (module docstring)."""

    def __init__(self) -> None:
        self._libc = _libc()
        self._fd = -1
        if self._libc is not None:
            self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        self._paths: dict[int, Path] = {}  # watch descriptor -> file
        self._changed: set[Path] = set()

    @property
    def active(self) -> bool:
        return self._fd >= 0

    def add(self, path: Path) -> bool:
        """Watch `path` (the file a link leads to); whether the kernel watches it."""
        if self._fd < 0 or path in self._paths.values():
            return self._fd >= 0
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(str(Path(path).resolve())), _MASK)
        if wd < 0:
            return False
        self._paths[wd] = Path(path)
        return True

    def changed(self) -> set[Path]:
        """The watched files written (or moved, deleted, opened for writing) since they were added."""
        while self._fd >= 0:
            try:
                data = os.read(self._fd, 64 * 1024)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, n = _EVENT.unpack_from(data, at)
                at += _EVENT.size + n
                if wd in self._paths and mask & (_MASK | IN_IGNORED):
                    self._changed.add(self._paths[wd])
        return set(self._changed)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._paths = {}
