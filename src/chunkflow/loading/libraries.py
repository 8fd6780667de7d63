"""The shared objects a generation's process maps (torch's, the NVIDIA libraries', triton's) and the page cache: a
freshly started machine reads them from the disk at their first use, which a process's first generation pays on
top of its start-up (bands.with_startup's `cold:<phase>`). `calibrate` drops them before its first cold process;
`run` notes how much of them was cached when it started, before it imported torch, so its first generation is held
to the fresh machine's band only where they were not."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Sequence

PACKAGES = ("torch", "nvidia", "triton")
CACHED_ENOUGH = 0.5  # a process started with at least this share of the libraries cached is not a fresh machine's
_AT_START: list[float | None] = []


def library_files() -> list[Path]:
    """The packages' shared objects, found without importing them."""
    files: set[Path] = set()
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            files |= {p.resolve() for p in Path(root).rglob("*.so*") if p.is_file()}
    return sorted(files)


def cached_share(files: Sequence[Path], drop_first: bool = False) -> float | None:
    """The share of the files' bytes in the page cache (after dropping them first, with `drop_first`: pages a
    running process maps stay); None where the system cannot tell (or, with `drop_first`, cannot drop)."""
    from chunkflow.loading.pagecache import can_drop, drop, resident_pages

    if not files or (drop_first and not can_drop()):
        return None
    cached = total = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if drop_first:
                drop(fd)
            vec = resident_pages(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if vec is None:
            return None
        cached, total = cached + sum(vec), total + len(vec)
    return cached / total if total else None


def cached_at_start() -> float | None:
    """The libraries' cached share when this process first asked, before it imported torch (None once torch is
    imported: its mapped pages would count); the same answer after."""
    if not _AT_START:
        try:
            _AT_START.append(None if "torch" in sys.modules else cached_share(library_files()))
        except OSError:  # a package folder it may not walk: unknown, and the run goes on
            _AT_START.append(None)
    return _AT_START[0]
