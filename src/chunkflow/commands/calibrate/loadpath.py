"""The load path as the runtime runs it, timed on a sample of the weights' folder and compared with the load model
(issue 55): the sample's safetensors files read by the loader's reader into one host store that is page-locked span
by span on a thread of its own while the reads run (runtime/store.py; on a machine without CUDA a plain host store,
new memory first touched by the reads), as the loader fills a streamed module's store.

Each round is a cold load where the sample's pages can be dropped from the page cache (scripts/drop_cache.py's
POSIX_FADV_DONTNEED, and the loader's own reads drop what they bring in); where they cannot, every round is a warm load
(from the page cache) and the record says so. Each round's time against what pipeline/load.py predicts for the same
bytes (eq. L1 without the build's start-up, at the share the page cache held) is one error, measured / predicted - 1:
their median is the `load` fit's bias, their spread about it its spread (bands.load_error).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

LOAD_SAMPLE_BYTES = 2 * 10**9  # the sample a round loads (a few seconds from a cloud disk)
SMOKE_LOAD_BYTES = 64 * 2**20
ROUNDS = 3
SPAN_BYTES = 256 * 2**20  # the store is page-locked in spans of about a block's size, as the runtime locks its blocks


def _load_once(files: list[tuple[Path, int]], nbytes: int, pin: bool, keep_cache: bool) -> float:
    """Seconds reading the first `nbytes` of the files into a new host store (page-locked while it is read where
    `pin`), until the store is whole and locked; the store is released after."""
    from chunkflow.loading.reader import FileReader
    from chunkflow.runtime.store import HostStore

    spans = [(a, min(SPAN_BYTES, nbytes - a)) for a in range(0, nbytes, SPAN_BYTES)]
    t0 = time.perf_counter()
    store = HostStore(nbytes, pin=pin, ranges=spans if pin else None)
    try:
        at = 0
        with FileReader(keep_cache=keep_cache) as reader:
            for path, size in files:
                n = min(size, nbytes - at)
                if n <= 0:
                    break
                reader.read_into(path, 0, n, store.view(at, n))
                at += n
        store.wait()
        return time.perf_counter() - t0
    finally:
        store.release()


def _settle(files: list[tuple[Path, int]]) -> None:
    """Write back any of the files' pages not yet on the disk (a folder just saved): the kernel drops no dirty page."""
    import os

    for path, _ in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def measure_load_path(folder: Path, nbytes: int, pin: bool, rounds: int = ROUNDS,
                      log: Callable[[str], None] = lambda s: None) -> dict[str, Any] | None:
    """`rounds` loads of a sample of `folder`'s safetensors files (module docstring), cold where the page cache can
    drop them, else warm: the raw record load_fit reads; None where the folder holds none."""
    from chunkflow.commands.calibrate.disk import COLD_AT_MOST, _cached_share, _drop, _read_all, sample_files

    files = sample_files(folder, nbytes)
    nbytes = min(nbytes, sum(s for _, s in files))
    if nbytes <= 0:
        return None
    _settle(files)
    _drop(files)
    left = _cached_share(files)
    cold = left is not None and left <= COLD_AT_MOST
    rows = []
    for _ in range(rounds):
        if cold:
            _drop(files)
        else:  # the pages in the cache, then a load from there
            _read_all(files, nbytes, keep_cache=True)
        cached = _cached_share(files) if cold else 1.0
        rows.append(dict(seconds=_load_once(files, nbytes, pin, keep_cache=not cold), cached=cached or 0.0))
    _drop(files)  # calibrate brought them in: give them back
    how = "cold" if cold else "warm (the page cache kept the sample: no cold load measured)"
    log(f"load path: {rounds} {how} load(s) of {nbytes / 1e9:.2f} GB into a {'page-locked' if pin else 'host'} "
        f"store, {', '.join('%.2f' % r['seconds'] for r in rows)} s")
    return dict(files=[str(p) for p, _ in files], bytes=nbytes, pinned=pin, cold=cold, rows=rows)


def predicted_s(nbytes: float, cached: float, pinned: bool, hw: Any) -> float | None:
    """What the load model (pipeline/load.py, eq. L1) says a load of `nbytes` into a host store takes, its build's
    start-up left out: the reads, the locking they do not hide (`pinned`) or the new memory; None without a disk
    rate (a warm load, `cached` 1, needs only the page cache's)."""
    from chunkflow_planner.pipeline.load import LoadEstimate, load_parts

    if hw.disk_read_gbps is None and cached >= 1.0 and hw.pipeline.page_cache_gbps is not None:
        hw = hw.model_copy(update={"disk_read_gbps": hw.pipeline.page_cache_gbps})  # warm: the disk's rate has no part
    est = LoadEstimate(read_bytes=nbytes, h2d_bytes=0.0, pinned_bytes=nbytes if pinned else 0.0,
                       host_peak_bytes=nbytes, fresh_bytes=0.0 if pinned else nbytes,
                       pinned_while_reading=nbytes if pinned else 0.0)
    parts = load_parts(est, cached, hw)
    parts.pop("startup", None)
    total = sum(parts.values())
    return total if parts and total > 0 else None


def load_fit(raw: dict[str, Any], hw: Any, on: str, log: Callable[[str], None] = lambda s: None) -> Any:
    """The `load` FitQuality from measure_load_path's record against the profile `hw` measured with it: each
    round's error (measured / predicted - 1) kept as a residual, their median the bias and their spread about it (one
    value fitted) the spread; None with fewer than two rounds priced. The record gains each round's prediction."""
    from chunkflow.commands.calibrate.fit import fit_quality

    errors = []
    for row in raw.get("rows", []):
        p = predicted_s(raw["bytes"], row["cached"], raw["pinned"], hw)
        row["predicted_s"] = p
        if p:
            errors.append(row["seconds"] / p - 1.0)
    if len(errors) < 2:
        return None
    bias = statistics.median(errors)
    how = "cold" if raw["cold"] else "warm (page cache not dropped)"
    source = (f"{on}: {len(errors)} {how} load(s) of {raw['bytes'] / 1e9:.2f} GB into a "
              f"{'page-locked' if raw['pinned'] else 'host'} store against the load model")
    q = fit_quality("load", [e - bias for e in errors], source, fitted=1)
    if q is None:
        return None
    log(f"load path against the load model: {', '.join(f'{e:+.1%}' for e in errors)} (bias {bias:+.1%}, "
        f"spread {q.spread:.1%})")
    return q.model_copy(update=dict(residuals=[round(e, 6) for e in errors], bias=round(bias, 6)))
