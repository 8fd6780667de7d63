"""The shared objects a generation's process maps (torch's, the NVIDIA libraries', triton's) and the page cache: a
freshly started machine reads them from the disk at their first use, which a process's first generation pays on
top of its start-up (bands.with_startup's `cold:<phase>`). `calibrate` drops them before its first cold process;
`run` notes how much of them was cached when it started, before it imported torch, so its first generation is held
to the fresh machine's band only where they were not: where its share is under CACHED_ENOUGH of this machine's warm
share (calibrate's, after its start-up probes ran: `libraries_warm_share`; many of these files no generation reads,
so a warm run on an H100 had only 0.32 of their bytes cached), else of all of them (were_cached)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Sequence

PACKAGES = ("torch", "nvidia", "triton")
CACHED_ENOUGH = 0.5  # a process started with at least this share of the warm share cached is not a fresh machine's
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
        _AT_START.append(None if "torch" in sys.modules else _share_now())
    return _AT_START[0]


def were_cached(share: float | None, warm: float | None) -> bool | None:
    """Whether a process that started with a share `share` of the libraries cached started warm: at least
    CACHED_ENOUGH of `warm`, the machine's warm share (`libraries_warm_share`), else of all their bytes (a profile
    without it); None where the process did not say."""
    if share is None:
        return None
    return share >= CACHED_ENOUGH * (warm if warm else 1.0)


def warm_share() -> float | None:
    """The libraries' cached share now, in a process whose kernels ran (calibrate, after its start-up probes): this
    machine's warm share; None where the system cannot tell or a package folder cannot be walked."""
    return _share_now()


def _share_now() -> float | None:
    """The libraries' cached share now; None where the system cannot tell or a package folder cannot be walked
    (unknown, and the run or calibration goes on)."""
    try:
        return cached_share(library_files())
    except OSError:
        return None
