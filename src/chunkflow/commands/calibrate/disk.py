"""How fast this machine loads checkpoints: the read rate of the disk the weights are on, cold (their pages dropped
from the page cache first) and warm (from the page cache), read by the loader's own reader (loading/reader.py),
threads and pieces included; and on a GPU the rate of page-locking host memory, as the pinned stores are.

The sample is the largest safetensors files in the folder (a pipeline folder given with `--weights`, else the
Hugging Face cache), up to `sample_bytes`, found by a bounded walk that stays inside what was named (`sample_files`);
where the folder has too few, or it is the temporary directory (never walked), a temporary file (at most
TEMP_SAMPLE_BYTES) is written there and removed after. The sample is 8 GB, read cold as a load reads (dropping the pages it
read), and its cold rate the slower of the whole sample's and its second half's: a cloud disk reads its first gigabytes from a burst allowance (on one H200 machine a
2 GB sample timed 1.70 GB/s where a 27 GB load read at 1.21 GB/s, docs/disk-h200.md), and a plan needs the rate a
full load keeps up. A cold read needs the kernel to drop the sample's pages
(`POSIX_FADV_DONTNEED`); where it cannot (another process maps them, a filesystem that keeps them), the rate
measured is said to be warm.
"""

from __future__ import annotations

import os
import stat
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

SAMPLE_BYTES = 8 * 10**9
WARM_SAMPLE_BYTES = 2 * 10**9  # the page cache's rate is steady: timed on this much
TEMP_SAMPLE_BYTES = 2 * 10**9  # a file calibrate writes itself: no more of the user's disk than this
SMOKE_SAMPLE_BYTES = 64 * 2**20
BUFFER_BYTES = 256 * 2**20  # the reads land in one buffer of this size, over and over
REPEATS = 3  # the cheap rates (page cache, first touch, page-locking) are the median of this many, their spread kept
COLD_AT_MOST = 0.05  # a sample with more than this share still cached after the drop is not cold


# The walk for the sample is bounded: a pipeline folder holds tens of entries, a busy Hugging Face cache some
# thousands; one holding more is sampled from the part walked. Diffusers folders nest two deep (component/file),
# the cache four (models--org--name/snapshots/REV/component/file).
MAX_WALK_ENTRIES = 100_000
MAX_WALK_DEPTH = 8


def sample_roots(folder: Path) -> list[Path]:
    """Where a sampled file may lie: `folder` itself (links resolved), and for a Hugging Face cache snapshot
    (.../models--org--name/snapshots/REV) its repo's blobs, which the snapshot's links point to."""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def sample_files(folder: Path, want: int) -> list[tuple[Path, int]]:
    """(path, bytes) of the largest *.safetensors regular files under `folder`, until `want` bytes are covered.

    Only what the user named is sampled: links to directories are not followed, a link to a file is followed only
    where it stays inside `sample_roots(folder)`, a directory met twice (a bind mount's loop) is walked once, and
    the walk stops after MAX_WALK_ENTRIES entries or MAX_WALK_DEPTH levels."""
    roots = sample_roots(folder)
    found: dict[Path, int] = {}
    seen: set[tuple[int, int]] = set()
    stack, looked = [(roots[0], 0)], 0
    while stack and looked < MAX_WALK_ENTRIES:
        here, depth = stack.pop()
        try:
            st = os.stat(here)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(here) as entries:
                for entry in entries:
                    looked += 1
                    if looked > MAX_WALK_ENTRIES:
                        break
                    if entry.is_dir(follow_symlinks=False):
                        if depth < MAX_WALK_DEPTH:
                            stack.append((Path(entry.path), depth + 1))
                    elif entry.name.endswith(".safetensors"):
                        _add_file(Path(entry.path), entry.is_symlink(), roots, found)
        except OSError:  # a folder this user may not read, or one removed meanwhile
            continue
    out, total = [], 0
    for path, size in sorted(found.items(), key=lambda kv: -kv[1]):
        if total >= want:
            break
        out.append((path, size))
        total += size
    return out


def _add_file(path: Path, link: bool, roots: list[Path], found: dict[Path, int]) -> None:
    """`path` (resolved) into `found` with its size, if it is a regular file inside `roots`."""
    try:
        real = path.resolve(strict=True) if link else path
    except (OSError, RuntimeError):  # a dangling link, a loop of links
        return
    if link and not _inside(real, roots):
        return
    try:
        st = os.stat(real)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        found.setdefault(real, st.st_size)


def _cached_share(files: list[tuple[Path, int]]) -> float | None:
    from chunkflow.loading.pagecache import PAGE, resident_pages

    cached = pages = 0
    for path, size in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            vec = resident_pages(fd, size)
        finally:
            os.close(fd)
        if vec is None:
            return None
        cached += sum(vec)
        pages += -(-size // PAGE)
    return cached / pages if pages else 0.0


def _drop(files: list[tuple[Path, int]]) -> None:
    from chunkflow.loading.pagecache import drop

    for path, _ in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            drop(fd)
        finally:
            os.close(fd)


def _read_all(files: list[tuple[Path, int]], nbytes: int, keep_cache: bool) -> tuple[float, int, float]:
    """Seconds the loader's reader takes to read the first `nbytes` of the files (dropping the pages it read, as the
    loader and the disk tier do, unless `keep_cache`), and the bytes and seconds of its second half (the reads after
    the one that crosses the middle)."""
    import torch

    from chunkflow.loading.reader import FileReader

    buf = torch.empty(min(BUFFER_BYTES, max(nbytes, 1)), dtype=torch.uint8)
    left, half = nbytes, None
    with FileReader(keep_cache=keep_cache) as reader:
        t0 = time.perf_counter()
        for path, size in files:
            off = 0
            while off < size and left > 0:
                n = min(buf.numel(), size - off, left)
                reader.read_into(path, off, n, buf[:n])
                off += n
                left -= n
                if half is None and left <= nbytes // 2:
                    half = (left, time.perf_counter())
        end = time.perf_counter()
    if half is None or half[0] == 0:  # one read covered the middle and the end: no second half of its own
        return end - t0, nbytes, end - t0
    return end - t0, half[0], end - half[1]


def sustained_gbps(nbytes: int, seconds: float, tail_bytes: int, tail_s: float) -> float:
    """GB/s a long read keeps up: the slower of the whole sample's rate and its second half's (a disk with a burst
    allowance reads its first gigabytes faster than a full checkpoint load sees)."""
    whole = nbytes / seconds
    return min(whole, tail_bytes / tail_s) / 1e9 if tail_s > 0 else whole / 1e9


def _write_sample(folder: Path, nbytes: int) -> Path:
    """A temporary file of `nbytes` in `folder`, written and flushed to the disk."""
    fd, name = tempfile.mkstemp(prefix=".chunkflow-calibrate-", suffix=".tmp", dir=folder)
    block = os.urandom(min(nbytes, 16 * 2**20))
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:left])
        os.fsync(fd)
    except BaseException:  # a full disk, an interrupt: no sample left behind
        os.close(fd)
        Path(name).unlink(missing_ok=True)
        raise
    os.close(fd)
    return Path(name)


def measure_disk(folder: Path, sample_bytes: int = SAMPLE_BYTES, log: Callable[[str], None] = lambda s: None,
                 sample: bool = True) -> dict[str, Any]:
    """The loader's cold and warm read rates (GB/s) on the disk holding `folder` (module docstring); `sample`
    False: time a temporary file written there, without looking at the folder's files."""
    files = sample_files(folder, sample_bytes) if sample else []
    temp = None
    if sum(s for _, s in files) < sample_bytes // 4:
        try:
            temp = _write_sample(folder, min(sample_bytes, TEMP_SAMPLE_BYTES))
        except OSError as exc:
            raise OSError(f"{str(folder)!r} holds too few safetensors files to time and a sample cannot be written "
                          f"there ({exc.strerror or exc})") from None
        files = [(temp, temp.stat().st_size)]
    try:
        nbytes = min(sample_bytes, sum(s for _, s in files))
        _drop(files)
        left = _cached_share(files)
        cold, tail_bytes, tail_s = _read_all(files, nbytes, keep_cache=False)  # as a load or the disk tier reads
        warm_bytes = min(nbytes, WARM_SAMPLE_BYTES)
        _read_all(files, warm_bytes, keep_cache=True)  # brought into the page cache, then timed from there
        warm_runs = [_read_all(files, warm_bytes, keep_cache=True)[0] for _ in range(REPEATS)]
        warm = statistics.median(warm_runs)
        _drop(files)  # the sample's pages were brought in by calibrate: give them back
    finally:
        if temp is not None:
            temp.unlink(missing_ok=True)
    cold_ok = left is not None and left <= COLD_AT_MOST
    out = dict(folder=str(folder), files=[str(p) for p, _ in files], sample_bytes=nbytes, temporary=temp is not None,
               cached_after_drop=left, cold_s=cold, cold_tail=[tail_bytes, tail_s], warm_s=warm, warm_runs_s=warm_runs,
               page_cache_gbps=warm_bytes / warm / 1e9, cold_whole_gbps=nbytes / cold / 1e9,
               disk_read_gbps=sustained_gbps(nbytes, cold, tail_bytes, tail_s) if cold_ok else None)
    if cold_ok:
        log(f"disk ({folder}): {nbytes / 1e9:.2f} GB read cold at {out['disk_read_gbps']:.2f} GB/s sustained "
            f"({out['cold_whole_gbps']:.2f} GB/s over the whole sample), from the page cache at "
            f"{out['page_cache_gbps']:.2f} GB/s")
    else:
        log(f"disk ({folder}): the page cache kept the sample ({'unknown share' if left is None else f'{left:.0%}'} "
            f"after dropping it), so no cold rate was measured; from the page cache {out['page_cache_gbps']:.2f} GB/s")
    return out


def measure_fault(nbytes: int = 2**30, repeats: int = REPEATS, rates: list[float] | None = None) -> float:
    """GB/s of new host memory mapped at its first touch, one write a page, by the loader's threads in its pieces
    (what a read into a new CPU tensor pays beyond the copy): the median of `repeats`, each on new memory; each
    repeat's GB/s appended to `rates` where given."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from chunkflow.loading.pagecache import PAGE
    from chunkflow.loading.reader import PIECE_BYTES, READ_THREADS

    out = []
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for _ in range(repeats):
            buf = torch.empty(nbytes, dtype=torch.uint8)
            t0 = time.perf_counter()
            list(pool.map(lambda a: buf[a:a + PIECE_BYTES][::PAGE].fill_(1), range(0, nbytes, PIECE_BYTES)))
            out.append(nbytes / (time.perf_counter() - t0) / 1e9)
            del buf
    if rates is not None:
        rates += out
    return statistics.median(out)


def measure_pin(nbytes: int = 2**30, repeats: int = REPEATS, rates: list[float] | None = None) -> float:
    """GB/s of page-locking host memory as a pinned store is (allocate, then cudaHostRegister): the median of
    `repeats`; each repeat's GB/s appended to `rates` where given."""
    from chunkflow.runtime.store import HostStore

    HostStore(64 * 2**20, pin=True).release()  # the first registration pays CUDA's own start-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store = HostStore(nbytes, pin=True)
        seconds = time.perf_counter() - t0
        store.release()
        out.append(nbytes / seconds / 1e9)
    if rates is not None:
        rates += out
    return statistics.median(out)


STARTUP_CODE = """
import time, torch
from chunkflow.commands.run import import_libraries
import_libraries()  # as `run` does before its load: diffusers' import is the command's, not the load's
from chunkflow.models.pipeline_build import build_pipeline
from chunkflow_planner.catalog import get_model
from chunkflow_planner.offload import OffloadConfig
t0 = time.perf_counter()
build_pipeline(get_model("tiny"), {}, OffloadConfig("none"), torch.device("cpu")).discard()
print(time.perf_counter() - t0)
"""


def measure_load_startup() -> float:
    """Seconds of a process's first pipeline build outside its reads and copies (importing the pipeline's own
    classes, building modules on the meta device, tokenizers): the tiny catalog pipeline built in a new process,
    where `run` builds it (torch and diffusers imported by run.import_libraries, timed apart as the report's
    imports_s; an H100 probe that timed diffusers' import too put 5.6 s in a load whose own start-up took 0.4 s)."""
    import subprocess
    import sys

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, "-c", STARTUP_CODE], capture_output=True, text=True, timeout=300,
                           env=env)
    except subprocess.TimeoutExpired:
        raise OSError("the start-up probe took over 300 s") from None
    if p.returncode != 0:
        raise OSError(f"the start-up probe failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return float(p.stdout.strip().splitlines()[-1])


def disk_folder(weights: str | None, cpu_smoke: bool = False) -> tuple[Path, str, bool]:
    """The folder whose disk calibrate times, how it was chosen, and whether its safetensors files are the sample:
    `--weights` (a folder, or a Hub id in the local cache: its snapshot, whose files are the cache's blobs), else
    (not --cpu-smoke) the Hugging Face cache, else the temporary directory, timed with a temporary file of its own
    (nothing in it is walked or read: it is everyone's)."""
    from chunkflow.weights import hub_cache_dir, resolve_weights

    if weights is not None:
        local = Path(weights).expanduser()
        if local.is_dir():
            return local, "--weights", True
        return resolve_weights(weights), "--weights (the Hugging Face cache)", True
    if cpu_smoke:  # a smoke run's numbers mean nothing: leave the user's cache alone
        return Path(tempfile.gettempdir()), "the temporary directory (--cpu-smoke)", False
    cache = hub_cache_dir()
    if cache.is_dir():
        return cache, "the Hugging Face cache", True
    return (Path(tempfile.gettempdir()), "the temporary directory (no Hugging Face cache here: pass --weights DIR)",
            False)
