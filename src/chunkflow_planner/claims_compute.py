"""The functions docs/claims.yaml names: each recomputes a published figure from the raw files under docs/data/
(JSON, CSV and the text the evidence scripts wrote), with the standard library; where a figure is one of the
planner's own formulas (activation bytes, a copy's time, a fit's figures) or a count its catalog keeps (a model's
blocks), the planner's function computes it, as it does in a plan.

Every function takes the row's raw files (paths, in the row's order) and the row's `args`, and returns a number or
a tuple of numbers in the unit the text quotes (percentages as percent, seconds, GB as 1e9 bytes); the row's
`format` turns them into the quoted string. A `key` is a path into a JSON document: segments joined by `/`, each a
dict key, a list index, or `field=value` (the first list item whose field is that value; several joined by `&`).
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from chunkflow_planner.bands import FITS
from chunkflow_planner.catalog import ModelSpec, Workload, get_hardware, get_model
from chunkflow_planner.memory import activation_bytes
from chunkflow_planner.overlap import T_pref
from chunkflow_planner.workload import per_forward


def _load(path: Path) -> Any:
    """A JSON file's document."""
    return json.loads(path.read_text())


def _dig(data: Any, key: str) -> Any:
    """The item at `key` (segments joined by '/'; '*' maps the rest over a list) in a JSON document."""
    segs = key.split("/")
    for i, seg in enumerate(segs):
        if seg == "*":
            rest = "/".join(segs[i + 1:])
            return [_dig(x, rest) if rest else x for x in data]
        if isinstance(data, list):
            if "=" in seg:
                conds = [c.split("=", 1) for c in seg.split("&")]
                data = next(x for x in data if all(str(x.get(f)) == w for f, w in conds))
            else:
                data = data[int(seg)]
        else:
            data = data[seg]
    return data


def _at(path: Path, key: str) -> Any:
    return _dig(_load(path), key)


def _flat(x: Any) -> list[float]:
    """A number or a (nested) list of numbers as a flat list."""
    if isinstance(x, list):
        return [v for item in x for v in _flat(item)]
    return [float(x)]


# ---- generic: one value, two values, a range, a ratio, a relative change ------------------------------------------


def value(raw: list[Path], key: str, scale: float = 1.0) -> float:
    """The number at `key` in the first file, times `scale`."""
    return float(_at(raw[0], key)) * scale


def pair(raw: list[Path], key: str, key2: str | None = None, scale: float = 1.0) -> tuple[float, float]:
    """`key` in the first file and `key2` (default: `key`) in the last, each times `scale` ("A against B")."""
    return float(_at(raw[0], key)) * scale, float(_at(raw[-1], key2 or key)) * scale


def values(raw: list[Path], key: str, scale: float = 1.0) -> tuple[float, ...]:
    """The number at `key` in each file, times `scale`."""
    return tuple(float(_at(p, key)) * scale for p in raw)


def fields(raw: list[Path], keys: list[str], scales: list[float] | None = None) -> tuple[float, ...]:
    """Several numbers of one file (a table line's cells): each of `keys` in the first file, times its scale."""
    return tuple(float(_at(raw[0], k)) * s for k, s in zip(keys, scales or [1.0] * len(keys), strict=True))


def values_each(raw: list[Path], keys: list[str], scale: float = 1.0) -> tuple[float, ...]:
    """`keys[i]` read from `raw[i]`, times `scale`."""
    return tuple(float(_at(p, k)) * scale for p, k in zip(raw, keys, strict=True))


def span(raw: list[Path], key: str, scale: float = 1.0, keys: list[str] | None = None) -> tuple[float, float]:
    """The smallest and largest number at `key` (or at each of `keys`) over every file, times `scale`."""
    found = [v for p in raw for k in (keys or [key]) for v in _flat(_at(p, k))]
    return min(found) * scale, max(found) * scale


def ratio(raw: list[Path], key: str, key2: str | None = None) -> float:
    """`key` in the first file over `key2` (default: `key`) in the last."""
    return float(_at(raw[0], key)) / float(_at(raw[-1], key2 or key))


def change(raw: list[Path], key: str, key2: str | None = None) -> float:
    """`key` in the first file against `key2` (default: `key`) in the last, in percent (a/b - 1)."""
    return (ratio(raw, key, key2) - 1.0) * 100.0


def against(raw: list[Path], key: str) -> tuple[float, float, float]:
    """`key` in the first file and in the last, and the first against the last in percent ("5.70 s against 5.63 s,
    +1.2%")."""
    a, b = float(_at(raw[0], key)), float(_at(raw[-1], key))
    return a, b, (a / b - 1.0) * 100.0


def before_after(raw: list[Path], key: str) -> tuple[float, float, float]:
    """`key` before (the first file) and after (the last), and how much less it is after, in percent."""
    a, b = float(_at(raw[0], key)), float(_at(raw[-1], key))
    return a, b, (1.0 - b / a) * 100.0


def codec_bytes(raw: list[Path]) -> tuple[float, float, float]:
    """A codec run's streamed bytes raw and as stored, in GB, and their ratio (the report's codec_stats)."""
    stats = _at(raw[0], "codec_stats")
    raw_b, stored = float(stats["codec_raw_bytes"]), float(stats["codec_stored_bytes"])
    return raw_b / 1e9, stored / 1e9, stored / raw_b


def codec_savings(raw: list[Path]) -> tuple[float, float, float, float]:
    """A codec run (the last file) against the same run without it (the first), in percent: fewer bytes copied a
    step, a smaller store of streamed weights (1 - its ratio), a lower host peak; then the ratio itself."""
    off, on = _load(raw[0]), _load(raw[-1])
    fewer = (1.0 - on["h2d_bytes_per_step"] / off["h2d_bytes_per_step"]) * 100.0
    ratio_ = codec_bytes(raw[-1:])[2]
    return fewer, (1.0 - ratio_) * 100.0, (1.0 - on["host_peak_bytes"] / off["host_peak_bytes"]) * 100.0, ratio_


def difference(raw: list[Path], key: str, key2: str | None = None, scale: float = 1.0) -> float:
    """`key` in the first file less `key2` (default: `key`) in the last, times `scale`."""
    return (float(_at(raw[0], key)) - float(_at(raw[-1], key2 or key))) * scale


def changes(raw: list[Path], key: str, key2: str) -> tuple[float, ...]:
    """Per file: `key` against `key2` in that file, in percent (a run's measured figure against its plan's)."""
    return tuple((float(_at(p, key)) / float(_at(p, key2)) - 1.0) * 100.0 for p in raw)


def span_each(raw: list[Path], keys: list[str], scale: float = 1.0) -> tuple[float, float]:
    """The smallest and largest of `keys[i]` read from `raw[i]`, times `scale`."""
    found = [v for p, k in zip(raw, keys, strict=True) for v in _flat(_at(p, k))]
    return min(found) * scale, max(found) * scale


def cache_saving(raw: list[Path]) -> float:
    """A cached run's block runs skipped, in percent of its block runs (the report's generation.cache)."""
    c = _at(raw[0], "generation/cache")
    return 100.0 * c["blocks_skipped"] / (c["blocks_skipped"] + c["blocks_computed"])


def all_of(raw: list[Path], key: str, word: str) -> str:
    """`word` where every value at `key` in every file is true (bit-identical flags), else 'NOT ALL'."""
    flags = [v for p in raw for v in (_at(p, key) if isinstance(_at(p, key), list) else [_at(p, key)])]
    return word if flags and all(flag is True for flag in flags) else "NOT ALL"


def every_line(raw: list[Path], text: str, word: str) -> str:
    """`word` where every non-empty line of the file holds `text` (a comparison's verdict), else 'NOT ALL'."""
    lines = [x for x in raw[0].read_text().splitlines() if x.strip()]
    return word if lines and all(text in x for x in lines) else "NOT ALL"


def ratios(raw: list[Path], key: str, key2: str | None = None) -> tuple[float, ...]:
    """Per pair of files (1st/2nd, 3rd/4th, ...): `key` in the first over `key2` (default `key`) in the second."""
    return tuple(float(_at(a, key)) / float(_at(b, key2 or key)) for a, b in zip(raw[::2], raw[1::2]))


def ratio_span(raw: list[Path], key: str, key2: str | None = None) -> tuple[float, float]:
    """The smallest and largest of `ratios`."""
    found = ratios(raw, key, key2)
    return min(found), max(found)


# ---- CPU timings: scripts/bench_plan_speed.sh's table --------------------------------------------------------------


def _speed_rows(path: Path) -> dict[str, tuple[float, float, float]]:
    """Each timed command of a plan-speed table: the current tree's min, median and max CPU seconds."""
    rows = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if line.startswith("chunkflow ") and len(parts) > 3 and parts[-2].count("/") == 2:
            now = tuple(float(x) for x in parts[-2].split("/"))
            rows[" ".join(parts[:-3])] = (now[0], now[1], now[2])
    return rows


def plan_speed_median(raw: list[Path], command: str) -> float:
    """The median CPU seconds of one timed command (the current tree's)."""
    return _speed_rows(raw[0])[command][1]


def plan_speed_span(raw: list[Path], prefix: str = "chunkflow plan ") -> tuple[float, float]:
    """The smallest and largest median of the timed commands starting with `prefix` (--help lines left out)."""
    meds = [m for cmd, (_, m, _) in _speed_rows(raw[0]).items() if cmd.startswith(prefix) and "--help" not in cmd]
    return min(meds), max(meds)


# ---- CPU timings: scripts/cpu_timings.py's output ------------------------------------------------------------------

_TIMED = re.compile(r"^\s*([\d.]+)\s+([\d.]+)(\s+\([\d.]+-[\d.]+\))?\s+(\S.*)$")


def _timed(path: Path) -> list[tuple[float, float, bool, str]]:
    """Each timed line: wall seconds, CPU seconds, whether it is a median of several (a CPU range follows), the
    command (what follows a ';' left out)."""
    out = []
    for line in path.read_text().splitlines():
        m = _TIMED.match(line)
        if m:
            out.append((float(m[1]), float(m[2]), bool(m[3]), m[4].split(";")[0].strip()))
    return out


def cpu_line(raw: list[Path], command: str) -> tuple[float, float]:
    """One timed command's wall and CPU seconds (the median where it was run several times)."""
    want = " ".join(command.split())
    return next((w, c) for w, c, _, cmd in _timed(raw[0]) if cmd == want)


def cpu_span(raw: list[Path], prefix: str) -> tuple[float, float]:
    """The smallest and largest CPU median of the single commands run several times that start with `prefix`."""
    cpus = [c for _, c, many, cmd in _timed(raw[0]) if many and cmd.startswith(prefix) and "&&" not in cmd]
    return min(cpus), max(cpus)


def cpu_summary(raw: list[Path], what: str) -> tuple[float, float]:
    """A summary line's wall and CPU seconds ('WHAT ...: N s wall, M s CPU')."""
    m = re.search(re.escape(what) + r"[^:]*: ([\d.]+) s wall, ([\d.]+) s CPU", raw[0].read_text())
    if m is None:
        raise ValueError(f"{raw[0]} has no summary of {what!r}")
    return float(m[1]), float(m[2])


def pip_sources(raw: list[Path]) -> tuple[int, int]:
    """Over the timed installs: the packages other than torch that came from this machine's folders, and the
    packages downloaded."""
    local = downloaded = 0
    for source, n in re.findall(r"(this machine's [^:]+|downloaded from [^:]+): (\d+)", raw[0].read_text()):
        if source.startswith("downloaded"):
            downloaded += int(n)
        else:
            local += int(n)
    return local - 1, downloaded


# ---- run reports (`chunkflow run --report`): generations scaled to the plan's steps, disk reads --------------------


def _scaled(report: dict[str, Any], steps: int) -> float:
    """A report's measured generation plus the steps it did not run at its median step (the docs' "scaled")."""
    measured = report["measured"]
    extra = steps - len(measured["step_times_s"])
    return float(report["generation"]["generation_time_s"]) + extra * float(measured["median_step_s"])


def scaled_ratio(raw: list[Path], steps: int = 50) -> float:
    """The first report's generation scaled to `steps` over the last's."""
    return _scaled(_load(raw[0]), steps) / _scaled(_load(raw[-1]), steps)


def scaled_change(raw: list[Path], steps: int = 50) -> float:
    """The first report's generation scaled to `steps` against the last's, in percent."""
    return (scaled_ratio(raw, steps) - 1.0) * 100.0


def scaled_and_plan(raw: list[Path], steps: int = 50) -> tuple[float, float, float]:
    """A report's generation scaled to `steps`, its plan's generation at those steps, and the error in percent."""
    report = _load(raw[0])
    scaled, planned = _scaled(report, steps), float(report["plan"]["prediction"]["generation_time_s"])
    return scaled, planned, (scaled / planned - 1.0) * 100.0


def scaled_vs_plan(raw: list[Path], steps: int = 50) -> float:
    """A report's generation scaled to `steps` against its plan's generation at those steps, in percent."""
    return scaled_and_plan(raw, steps)[2]


def run_vs_plan(raw: list[Path]) -> tuple[float, float, float]:
    """A report's generation at the steps it ran, its plan's at those steps (the plan's generation less the steps
    not run at its step time) and the error in percent."""
    report = _load(raw[0])
    pred = report["plan"]["prediction"]
    not_run = int(report["plan"]["workload"]["steps"]) - len(report["measured"]["step_times_s"])
    planned = float(pred["generation_time_s"]) - not_run * float(pred["step_time_s"])
    measured = float(report["generation"]["generation_time_s"])
    return measured, planned, (measured / planned - 1.0) * 100.0


def phase_vs_plan(raw: list[Path], phase: str) -> tuple[float, float, float]:
    """A report's measured phase (`denoise`: its steps) at the steps it ran, its plan's at those steps (the plan's
    phase less the steps not run at its step time) and the error in percent."""
    report = _load(raw[0])
    pred = report["plan"]["prediction"]
    not_run = int(report["plan"]["workload"]["steps"]) - len(report["measured"]["step_times_s"])
    planned = float(pred["phases"][phase]["time_s"]) - not_run * float(pred["step_time_s"])
    measured = float(report["generation"]["phases"][phase]["measured_time_s"])
    return measured, planned, (measured / planned - 1.0) * 100.0


def load_rate(raw: list[Path]) -> tuple[float, float]:
    """A report's load: the bytes it read from the checkpoint's files (GB) and at what rate (GB/s)."""
    load = _at(raw[0], "generation/load")
    return float(load["read_bytes"]) / 1e9, float(load["read_bytes"]) / 1e9 / float(load["read_seconds"])


def trace_same(raw: list[Path], keys: list[str]) -> int:
    """How many samples of a report's memory trace (one after every step) have the first sample's value at every
    one of `keys` (all of them where that memory never moved)."""
    trace = _at(raw[0], "measured/memory_trace")
    return sum(all(x[k] == trace[0][k] for k in keys) for x in trace)


def trace_growth(raw: list[Path], key: str) -> tuple[float, float]:
    """How much `key` of a report's memory trace grew from its first sample to its last, in MB, and that over the
    run's timed steps, in KB a step."""
    report = _load(raw[0])
    trace = report["measured"]["memory_trace"]
    grown = float(trace[-1][key]) - float(trace[0][key])
    return grown / 1e6, grown / len(report["measured"]["step_times_s"]) / 1e3


def measured_vs_planned(raw: list[Path], key: str, key2: str, scale: float = 1.0) -> tuple[float, float, float]:
    """`key` (measured) and `key2` (planned) in one file, times `scale`, and the error in percent."""
    measured, planned = float(_at(raw[0], key)), float(_at(raw[0], key2))
    return measured * scale, planned * scale, (measured / planned - 1.0) * 100.0


def first_step_extra(raw: list[Path]) -> tuple[float, ...]:
    """Per report: how much longer its first step took than its median step, in seconds."""
    return tuple(float(_at(p, "measured/step_times_s/0")) - float(_at(p, "measured/median_step_s")) for p in raw)


def run_vs_plan_span(raw: list[Path]) -> tuple[float, float]:
    """The smallest and largest error of `run_vs_plan` over the reports, in percent."""
    errors = [run_vs_plan([p])[2] for p in raw]
    return min(errors), max(errors)


def _disk_read(report: dict[str, Any]) -> int:
    """Bytes a run read from the checkpoint's files: every component's, else the transformer's disk tier's."""
    per_component = report["generation"].get("disk_read_bytes")
    return sum(per_component.values()) if per_component else int(report["stats"]["disk_bytes_read"])


def disk_reads(raw: list[Path]) -> tuple[float, float, float]:
    """The bytes two runs read from disk, in GB, and the first's as a percentage of the last's."""
    first, last = _disk_read(_load(raw[0])) / 1e9, _disk_read(_load(raw[-1])) / 1e9
    return first, last, 100.0 * first / last


def _planned_reads(plan: dict[str, Any]) -> float:
    """A plan's disk reads a generation: its own figure, else its reads a step times its steps."""
    pred = plan["prediction"]
    if pred.get("disk_read_bytes_per_generation") is not None:
        return float(pred["disk_read_bytes_per_generation"])
    return float(pred["disk_read_bytes_per_step"]) * int(plan["workload"]["steps"])


def planned_reads(raw: list[Path]) -> tuple[float, float, float]:
    """Two plans' disk reads a generation: the first's in GB, the last's in TB, the first as a % of the last."""
    first, last = _planned_reads(_load(raw[0])), _planned_reads(_load(raw[-1]))
    return first / 1e9, last / 1e12, 100.0 * first / last


def text_contains(raw: list[Path], text: str, word: str) -> str:
    """`word` where the file holds `text` (a log's verdict line), else 'NOT FOUND'."""
    return word if text in raw[0].read_text() else "NOT FOUND"


# ---- bands: verdicts of runs against their bands, and calibrations against each other's ----------------------------


def _rows(path: Path, report: str | None = None) -> list[dict[str, Any]]:
    rows = _load(path)["rows"]
    return [r for r in rows if report is None or r["report"] == report]


def verdicts_inside(raw: list[Path], report: str | None = None) -> tuple[int, int]:
    """How many of a verdicts file's measurements (of one report, or all) fell inside their bands, of how many:
    |error| <= band, from each row's error and band."""
    rows = _rows(raw[0], report)
    return sum(abs(r["error"]) <= r["band"] for r in rows), len(rows)


def verdict(raw: list[Path], report: str, key: str, field: str = "error") -> float:
    """One verdict's error or band, in percent."""
    row = next(r for r in _rows(raw[0], report) if r["key"] == key)
    return float(row[field]) * 100.0


def compare_inside(raw: list[Path], both: bool = False) -> tuple[int, int]:
    """How many of a second calibration's figures fell inside the first's bands (|diff| <= band_first; `both`: and
    the first inside the second's, band_second), of how many."""
    rows = _load(raw[0])["rows"]
    inside = [abs(r["diff"]) <= r["band_first"] and (not both or abs(r["diff"]) <= r["band_second"]) for r in rows]
    return sum(inside), len(rows)


def compare_misses(raw: list[Path], fit: str) -> tuple[float, float]:
    """The smallest and largest |move| of one fit's figures outside the first calibration's bands, in percent."""
    rows = _load(raw[0])["rows"]
    moved = [abs(r["diff"]) * 100.0 for r in rows if r["fit"] == fit and abs(r["diff"]) > r["band_first"]]
    return min(moved), max(moved)


def compare_miss_count(raw: list[Path], fit: str) -> int:
    """How many of one fit's figures fell outside the first calibration's bands."""
    return sum(r["fit"] == fit and abs(r["diff"]) > r["band_first"] for r in _load(raw[0])["rows"])


def kernel_span(raw: list[Path], prefix: str = "full_") -> tuple[int, float, float]:
    """scripts/codec_kernels.py's decode variants named `prefix`...: how many, the slowest and the fastest rate of
    output (GB/s)."""
    rates = [v["gbps_out"] for k, v in _load(raw[0]).items() if k.startswith(prefix) and v.get("ok")]
    return len(rates), min(rates), max(rates)


# ---- transformer-only timings: scripts/format_bench.py and gguf_bench.py's time-*.json -----------------------------


def plan_errors(raw: list[Path]) -> tuple[float, ...]:
    """A plan's step over its guidance passes against the measured median forward, in percent, per pair of files
    (a way's time-*.json, the plan it ran)."""
    errors = []
    for timed_path, plan_path in zip(raw[::2], raw[1::2]):
        timed, plan = _load(timed_path), _load(plan_path)
        per_forward = float(timed["predicted_step_s"]) / int(plan["workload"]["cfg_passes"])
        errors.append((per_forward / float(timed["median_s"]) - 1.0) * 100.0)
    return tuple(errors)


def plan_per_forward(raw: list[Path]) -> float:
    """The largest miss (by size) of `plan_errors` over the pairs."""
    return max(plan_errors(raw), key=abs)


def faster_and_peaks(raw: list[Path]) -> tuple[float, float, float, float, float]:
    """One way against another (two time-*.json): how much faster in percent, both medians in ms, both peaks in GB."""
    a, b = _load(raw[0]), _load(raw[1])
    faster = (1.0 - a["median_s"] / b["median_s"]) * 100.0
    peaks = a["peak_allocated_bytes"] / 1e9, b["peak_allocated_bytes"] / 1e9
    return faster, a["median_s"] * 1e3, b["median_s"] * 1e3, *peaks


def format_table_row(raw: list[Path]) -> tuple[float, ...]:
    """One model and format of docs/data/gpu-formats' table, from its files [gpu, forward, chunkflow (ahead),
    leaf or none, plan]: each way's median forward in ms, forward / GPU, leaf / forward (where leaf ran), the plan's
    forward / the measured one, and the forward's peak allocated bytes / the plan's peak."""
    gpu, fwd, ahead = (_load(p) for p in raw[:3])
    leaf = _load(raw[3]) if len(raw) == 5 else None
    plan = _load(raw[-1])
    ms = [w["median_s"] * 1e3 for w in (gpu, fwd, ahead, leaf) if w]
    per_forward = fwd["predicted_step_s"] / int(plan["workload"]["cfg_passes"])
    ratios_ = [fwd["median_s"] / gpu["median_s"]] + ([leaf["median_s"] / fwd["median_s"]] if leaf else [])
    return (*ms, *ratios_, per_forward / fwd["median_s"], fwd["peak_allocated_bytes"] / fwd["predicted_peak_bytes"])


def replan_change(raw: list[Path], name: str) -> float:
    """A run's measured median step against its plan made again with head dim 64's attention table, in percent: raw
    is docs/data/h200-any/replan.txt (replan.py's output, which needs the planner) and the run's report. The error
    is recomputed from the report's step and replan.txt's planned step (printed to 1 ms), and replan.txt's own
    error (from the unrounded plan) is returned where the two agree within that rounding."""
    line = next(x for x in raw[0].read_text().splitlines() if x.split()[:1] == [name])
    planned = float(re.findall(r"(\d+\.\d+) s", line)[-1])
    printed = float(re.findall(r"\(([+-]\d+\.\d+)%\)", line)[-1])
    again = (float(_at(raw[1], "measured/median_step_s")) / planned - 1.0) * 100.0
    slack = 100.0 * 0.0005 / planned + 0.05
    if abs(again - printed) > slack:
        raise ValueError(f"{name}: replan.txt says {printed:+.1f}%, its figures give {again:+.2f}%")
    return printed


# ---- host memory from /proc/meminfo samples (docs/data/h200-shared) ------------------------------------------------


def meminfo_peak_gb(raw: list[Path]) -> tuple[float, ...]:
    """The host memory each run took at its peak, in GB, over pairs of files: MemAvailable before it (/proc/meminfo
    lines) less the smallest MemAvailable sampled while it ran (lines 'time MemAvailable_kB Shmem_kB')."""
    out = []
    for before_path, samples_path in zip(raw[::2], raw[1::2]):
        lines = before_path.read_text().splitlines()
        before = next(int(x.split()[1]) for x in lines if x.startswith("MemAvailable"))
        low = min(int(x.split()[1]) for x in samples_path.read_text().splitlines() if x.strip())
        out.append((before - low) * 1024 / 1e9)
    return tuple(out)


def _meminfo_line(path: Path, label: str) -> dict[str, float]:
    """One line of an evidence script's meminfo.log ('MemAvailable: N kB Cached: N kB ... LABEL'), each field in
    GB (/proc/meminfo's kB are 1024 bytes)."""
    line = next(x for x in path.read_text().splitlines() if x.rstrip().endswith(f" {label}"))
    return {k: int(v) * 1024 / 1e9 for k, v in re.findall(r"(\w+): (\d+) kB", line)}


def meminfo_values(raw: list[Path], field: str, labels: list[str]) -> tuple[float, ...]:
    """A /proc/meminfo field (GB) at each of meminfo.log's lines labelled `labels`."""
    return tuple(_meminfo_line(raw[0], label)[field] for label in labels)


def _cache_left(path: Path, label: str) -> float:
    """The page cache a run left (GB): meminfo.log's Cached after it ('after LABEL') less before it."""
    return _meminfo_line(path, f"after {label}")["Cached"] - _meminfo_line(path, f"before {label}")["Cached"]


def cache_left(raw: list[Path], labels: list[str]) -> tuple[float, ...]:
    """The page cache each run labelled `labels` in meminfo.log left, in GB."""
    return tuple(_cache_left(raw[0], label) for label in labels)


def fields_and_cache(raw: list[Path], keys: list[str], label: str,
                     scales: list[float] | None = None) -> tuple[float, ...]:
    """A run's table line: `fields` of its file (the first) and the page cache it left (the last, meminfo.log)."""
    return (*fields(raw[:1], keys, scales), _cache_left(raw[-1], label))


def host_with_cache(raw: list[Path], keys: list[str], labels: list[str]) -> tuple[float, ...]:
    """Per run (raw[i], its host peak at keys[i], its label in meminfo.log, the last file): the host memory it
    held at its peak plus the page cache it left, in GB."""
    return tuple(float(_at(p, k)) / 1e9 + _cache_left(raw[-1], label)
                 for p, k, label in zip(raw[:-1], keys, labels, strict=True))


# ---- many generations per load (docs/data/h200-many) --------------------------------------------------------------


def wall_s(raw: list[Path]) -> float:
    """The wall seconds the evidence script wrote ('... wall_s N'), every one in the files summed."""
    return sum(float(x) for p in raw for x in re.findall(r"wall_s ([\d.]+)", p.read_text()))


def tsv_sum(raw: list[Path]) -> float:
    """The sum of a 'name<TAB>seconds' file's seconds."""
    return sum(float(x.split()[1]) for x in raw[0].read_text().splitlines() if x.strip())


def serve_times(raw: list[Path]) -> tuple[float, float]:
    """A server run's wall seconds, start to exit (its serve.log), and when it was up (its serve-client.json)."""
    return wall_s(raw[:1]), float(_at(raw[1], "ready_after_s"))


def speedups(raw: list[Path]) -> tuple[float, ...]:
    """The ten single processes' summed seconds (raw[0], singles.tsv) over each other way's wall seconds."""
    singles = tsv_sum(raw[:1])
    return tuple(singles / wall_s([p]) for p in raw[1:])


def many_walls(raw: list[Path]) -> tuple[float, ...]:
    """Each way's wall seconds (the files' 'wall_s N'), then the single processes' summed seconds (the last file,
    singles.tsv)."""
    return (*(wall_s([p]) for p in raw[:-1]), tsv_sum(raw[-1:]))


def jobs_host(raw: list[Path]) -> tuple[float, float, float]:
    """A prompt file's run (jobs-report.json): the smallest and largest resident set after a job, and the plan's host
    memory, in GB."""
    report = _load(raw[0])
    rss = [float(j["host_rss_bytes"]) / 1e9 for j in report["jobs"]]
    return min(rss), max(rss), float(report["plan"]["prediction"]["host_memory_bytes"]) / 1e9


def job_seconds(raw: list[Path], first: int = 1) -> tuple[float, float, float]:
    """The median, shortest and longest of a server's jobs' seconds, from the job numbered `first` (0-based) on."""
    secs = [float(j["seconds"]) for j in _load(raw[0])["jobs"][first:]]
    return statistics.median(secs), min(secs), max(secs)


def job_errors(raw: list[Path], first: int = 1) -> tuple[float, float, float]:
    """The median, smallest and largest error of a server's jobs' seconds against their predictions, in percent."""
    errs = [(j["seconds"] / j["predicted_s"] - 1.0) * 100.0 for j in _load(raw[0])["jobs"][first:]]
    return statistics.median(errs), min(errs), max(errs)


def finish_errors(raw: list[Path], after_first: bool = True) -> tuple[float, float]:
    """The smallest and largest error of a server's predicted finish times against the measured ones, in percent,
    from the first submission: predicted once the first job was done (jobs 2 on), else at submission."""
    jobs = _load(raw[0])["jobs"]
    t0 = min(j["submitted"] for j in jobs)
    key = "predicted_finish_after_first" if after_first else "predicted_finish_at_submit"
    errs = [((j["finished"] - t0) / (j[key] - t0) - 1.0) * 100.0 for j in jobs if j.get(key)]
    return min(errs), max(errs)


# ---- the transformer bench (`chunkflow bench`'s bench.csv) --------------------------------------------------------


def _bench(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _bench_ratio(rows: list[dict[str, str]], mode: str, frames: str, column: str, base: str) -> float:
    pick = {r["mode"]: float(r[column]) for r in rows if r["value"] == frames}
    return pick[mode] / pick[base]


def bench_ratio(raw: list[Path], mode: str, frames: str, column: str = "measured_step_s",
                base: str = "none") -> float:
    """A mode's figure over the baseline's at one point of bench.csv."""
    return _bench_ratio(_bench(raw[0]), mode, frames, column, base)


def bench_ratios(raw: list[Path], mode: str, frames: list[str], column: str = "measured_step_s",
                 base: str = "none") -> tuple[float, ...]:
    """A mode's figure over the baseline's at each of the points `frames` of bench.csv."""
    rows = _bench(raw[0])
    return tuple(_bench_ratio(rows, mode, f, column, base) for f in frames)


def bench_table_row(raw: list[Path], mode: str, frames: str, base: str = "none") -> tuple[float, ...]:
    """One line of a bench table: the step (s), against the baseline's, peak allocated (GB), against the
    baseline's, peak reserved (GB) and pinned host memory (GB)."""
    rows = _bench(raw[0])
    row = next(r for r in rows if r["mode"] == mode and r["value"] == frames)
    return (float(row["measured_step_s"]), _bench_ratio(rows, mode, frames, "measured_step_s", base),
            float(row["measured_peak_bytes"]) / 1e9, _bench_ratio(rows, mode, frames, "measured_peak_bytes", base),
            float(row["peak_reserved_bytes"]) / 1e9, float(row["pinned_bytes"] or 0) / 1e9)


def bench_worst(raw: list[Path], column: str, modes: list[str] | None = None, scale: float = 100.0) -> float:
    """The largest |value| of a bench.csv column over the points (of `modes`, else all with a value), times
    `scale` (a plan's worst error, in percent)."""
    rows = [r for r in _bench(raw[0]) if r[column] and (modes is None or r["mode"] in modes)]
    return max(abs(float(r[column])) for r in rows) * scale


def bench_max(raw: list[Path], column: str, mode: str, scale: float = 1e-9) -> float:
    """The largest value of a bench.csv column over one mode's points, times `scale`."""
    return max(float(r[column]) for r in _bench(raw[0]) if r["mode"] == mode) * scale


def bench_excess(raw: list[Path], mode: str, column: str = "measured_step_s") -> tuple[float, float]:
    """The smallest and largest excess of the mode's figure over the baseline's, in percent, over bench.csv's
    points."""
    low, high = bench_share(raw, mode, column)
    return low - 100.0, high - 100.0


def bench_worsts(raw: list[Path], columns: list[str]) -> tuple[float, ...]:
    """`bench_worst` of each column, in percent."""
    return tuple(bench_worst(raw, c) for c in columns)


def bench_rss(raw: list[Path], modes: tuple[str, str] = ("chunkflow", "diffusers-group")) -> tuple[float, float]:
    """The bench process's resident set (GB) during two modes' points (their largest)."""
    return bench_max(raw, "host_rss_bytes", modes[0]), bench_max(raw, "host_rss_bytes", modes[1])


def bench_within(raw: list[Path], mode: str, column: str = "measured_step_s", base: str = "none") -> int:
    """The mode's largest excess over the baseline at any point of bench.csv, in whole percent rounded up."""
    rows = _bench(raw[0])
    worst = max(_bench_ratio(rows, mode, r["value"], column, base) for r in rows if r["mode"] == mode)
    return math.ceil((worst - 1.0) * 100.0 - 1e-9)


def bench_share(raw: list[Path], mode: str, column: str = "measured_peak_bytes",
                base: str = "none") -> tuple[float, float]:
    """The smallest and largest of the mode's figure as a percentage of the baseline's, over bench.csv's points."""
    rows = _bench(raw[0])
    shares = [100.0 * _bench_ratio(rows, mode, r["value"], column, base) for r in rows if r["mode"] == mode]
    return min(shares), max(shares)


def bench_steps(raw: list[Path], mode: str, frames: str) -> tuple[float, ...]:
    """A mode's measured step (s) at one point of each bench.csv."""
    return tuple(float(next(r for r in _bench(p) if r["mode"] == mode and r["value"] == frames)["measured_step_s"])
                 for p in raw)


def bench_faster(raw: list[Path], mode: str, frames: list[str], base: str | None = None) -> tuple[float, ...]:
    """Per point: how much less time a mode's step took in the first bench.csv than `base`'s (default: the same
    mode's) in the last, in percent (1 - a/b)."""
    first, last = _bench(raw[0]), _bench(raw[-1])
    out = []
    for f in frames:
        a = next(float(r["measured_step_s"]) for r in first if r["mode"] == mode and r["value"] == f)
        b = next(float(r["measured_step_s"]) for r in last if r["mode"] == (base or mode) and r["value"] == f)
        out.append((1.0 - a / b) * 100.0)
    return tuple(out)


def bench_faster_span(raw: list[Path], mode: str, frames: list[str], base: str | None = None) -> tuple[float, float]:
    """The smallest and largest of `bench_faster`."""
    found = bench_faster(raw, mode, frames, base)
    return min(found), max(found)


def bench_slower_span(raw: list[Path], mode: str, frames: list[str]) -> tuple[float, float]:
    """The smallest and largest excess of a mode's step in the first bench.csv over its step in the last, in
    percent (a/b - 1), over the points `frames`."""
    found = [-x for x in bench_faster(raw, mode, frames)]
    return min(found), max(found)


def bench_pair_row(raw: list[Path], mode: str, frames: str, base: str = "none") -> tuple[float, float, float, float]:
    """One line of a two-run table: the baseline's step and the mode's (s) in the first bench.csv, the mode's over
    the baseline's there, and the same ratio in the last bench.csv (the earlier run)."""
    first = _bench(raw[0])
    return (bench_steps(raw[:1], base, frames)[0], bench_steps(raw[:1], mode, frames)[0],
            _bench_ratio(first, mode, frames, "measured_step_s", base),
            _bench_ratio(_bench(raw[-1]), mode, frames, "measured_step_s", base))


def bench_ratio_drift(raw: list[Path], mode: str, frames: list[str], base: str = "none") -> int:
    """The largest change of a mode's step over the baseline's between the first bench.csv and the last, over the
    points `frames`, in whole percent rounded up (|r1/r2 - 1|)."""
    first, last = _bench(raw[0]), _bench(raw[-1])
    moved = [abs(_bench_ratio(first, mode, f, "measured_step_s", base)
                 / _bench_ratio(last, mode, f, "measured_step_s", base) - 1.0) for f in frames]
    return math.ceil(max(moved) * 100.0 - 1e-9)


def bench_column_span(raw: list[Path], column: str, scale: float = 100.0) -> tuple[float, float]:
    """The smallest and largest value of a bench.csv column over the points that have one, times `scale` (a plan's
    errors, in percent)."""
    found = [float(r[column]) for r in _bench(raw[0]) if r[column]]
    return min(found) * scale, max(found) * scale


def bench_identical(raw: list[Path], word: str, mode: str | None = None, frames: str | None = None) -> str:
    """`word` where bench.csv's bit_identical is True at every point (of `mode`, at `frames`), 'not ' + `word`
    where it is False at every one, else 'MIXED'."""
    flags = [r["bit_identical"] == "True" for r in _bench(raw[0])
             if (mode is None or r["mode"] == mode) and (frames is None or r["value"] == frames)]
    if flags and all(flags):
        return word
    return f"not {word}" if flags and not any(flags) else "MIXED"


# ---- whole generations from real checkpoint folders (docs/checkpoint-h200.md) ---------------------------------------


def checkpoint_row(raw: list[Path]) -> tuple[Any, ...]:
    """One line of scripts/checkpoint_doc.py's table from a run report (the first file) and, where given, diffusers'
    load of the same folder (the last): the page cache's share (%), load seconds and error (%), read rate (GB/s),
    host peak (GB) and error (%), the largest phase peak (GB), its phase, the GPU budget (GB), denoise and generation
    seconds and their errors (%); then diffusers' load seconds and 'yes'/'NO' for identical latents."""
    r = _load(raw[0])
    g, ld = r["generation"], r["generation"]["load"]
    phases = g["phases"]
    worst = max(phases, key=lambda k: phases[k]["measured_peak_memory_bytes"])

    def err(m: float, p: float) -> float:
        return (m / p - 1.0) * 100.0

    den = phases["denoise"]
    out: tuple[Any, ...] = (
        ld["cached_fraction"] * 100.0, ld["measured_time_s"], err(ld["measured_time_s"], ld["predicted_time_s"]),
        ld["read_bytes"] / ld["read_seconds"] / 1e9,
        g["host_peak_bytes"] / 1e9, err(g["host_peak_bytes"], g["predicted_host_memory_bytes"]),
        phases[worst]["measured_peak_memory_bytes"] / 1e9, worst, g["gpu_budget_bytes"] / 1e9,
        den["measured_time_s"], err(den["measured_time_s"], den["predicted_time_s"]),
        g["generation_time_s"], err(g["generation_time_s"], g["predicted_generation_time_s"]))
    if len(raw) > 1:
        ref = _load(raw[-1])
        out += (ref["load_s"], "yes" if ref["latents_identical"] else "NO")
    return out


def worst_of(raw: list[Path], keys: list[str], scale: float = 100.0) -> float:
    """The value of largest magnitude at any of `keys` in any file, sign kept, times `scale` (a worst error, %)."""
    found = [v for p in raw for k in keys for v in _flat(_at(p, k))]
    return max(found, key=abs) * scale


def within(raw: list[Path], keys: list[str], scale: float = 100.0) -> int:
    """The largest |value| at any of `keys` in any file, times `scale`, in whole units rounded up ("within N%")."""
    return math.ceil(abs(worst_of(raw, keys, scale)) - 1e-9)


def count_within(raw: list[Path], key: str, limit: float, scale: float = 100.0) -> tuple[int, int]:
    """How many files have |`key` x `scale`| <= `limit`, of how many."""
    found = [abs(float(_at(p, key))) * scale for p in raw]
    return sum(v <= limit for v in found), len(found)


def load_rates(raw: list[Path]) -> tuple[float, ...]:
    """Per run report: its load's read rate, the bytes it read from the folder over the seconds reading, GB/s."""
    return tuple(_at(p, "generation/load/read_bytes") / _at(p, "generation/load/read_seconds") / 1e9 for p in raw)


def load_rate_slower(raw: list[Path]) -> float:
    """How much slower the last report's load read than the first's, in percent (1 - last/first)."""
    first, last = load_rates([raw[0], raw[-1]])
    return (1.0 - last / first) * 100.0


def load_beyond_reads(raw: list[Path]) -> tuple[float, ...]:
    """Per run report: its load's seconds beyond the seconds reading the folder (start-up, page-locking, copies)."""
    return tuple(_at(p, "generation/load/measured_time_s") - _at(p, "generation/load/read_seconds") for p in raw)


def phase_peak_max(raw: list[Path]) -> float:
    """The largest peak GPU memory (reserved, GB) of any phase of any run report."""
    return max(ph["measured_peak_memory_bytes"] for p in raw for ph in _at(p, "generation/phases").values()) / 1e9


# ---- planner accuracy over bench.csv files (docs/planner-accuracy-h200.md) ------------------------------------------


def bench_accuracy_row(raw: list[Path], mode: str, frames: str) -> tuple[float, ...]:
    """One line of an accuracy table: measured and predicted step (s) and the error (%), measured and predicted
    peak allocated memory (GB) and the error (%), at one point of bench.csv."""
    row = next(r for r in _bench(raw[0]) if r["mode"] == mode and r["value"] == frames)
    return (float(row["measured_step_s"]), float(row["predicted_step_s"]), float(row["err_step"]) * 100.0,
            float(row["measured_peak_bytes"]) / 1e9, float(row["predicted_peak_bytes"]) / 1e9,
            float(row["err_peak"]) * 100.0)


def _points(raw: list[Path], last_modes: list[str] | None) -> list[dict[str, str]]:
    """Every point of the bench.csv files that the planner predicted (baselines such as diffusers-group have no
    prediction); of the last file only the modes `last_modes` (a point measured later, completing an earlier file),
    where given."""
    rows = [r for p in raw[:-1] for r in _bench(p)] if last_modes else []
    last = _bench(raw[-1]) if last_modes else [r for p in raw for r in _bench(p)]
    rows += [r for r in last if not last_modes or r["mode"] in last_modes]
    return [r for r in rows if r["err_step"]]


def bench_accuracy_summary(raw: list[Path], last_modes: list[str] | None = None) -> tuple[float, ...]:
    """Over the points of `_points`: the largest |step error| and |peak error| (%), how many points, and the
    median |step error| and |peak error| (%)."""
    pts = _points(raw, last_modes)
    step = [abs(float(r["err_step"])) * 100.0 for r in pts]
    peak = [abs(float(r["err_peak"])) * 100.0 for r in pts]
    return max(step), max(peak), len(pts), statistics.median(step), statistics.median(peak)


def bench_peak_gap(raw: list[Path], last_modes: list[str] | None = None) -> tuple[float, float]:
    """Over the points of `_points`: the smallest and largest measured peak less the predicted one, GB."""
    gaps = [(float(r["measured_peak_bytes"]) - float(r["predicted_peak_bytes"])) / 1e9
            for r in _points(raw, last_modes)]
    return min(gaps), max(gaps)


def bench_abs_span(raw: list[Path], column: str, scale: float = 100.0) -> tuple[float, float]:
    """The smallest and largest |value| of a bench.csv column over the points that have one, times `scale`."""
    found = [abs(float(r[column])) for r in _bench(raw[0]) if r[column]]
    return min(found) * scale, max(found) * scale


def jsonl_worsts(raw: list[Path], keys: list[str], scale: float = 100.0) -> tuple[float, ...]:
    """Per key: the largest |value| over a JSON-lines file's records (run reports), times `scale`."""
    records = [json.loads(line) for line in raw[0].read_text().splitlines() if line.strip()]
    return tuple(max(abs(float(_dig(r, k))) for r in records) * scale for k in keys)


def log_numbers(raw: list[Path], pattern: str) -> tuple[float, ...]:
    """Per file: the numbers `pattern`'s groups capture in its first match (a figure a log line printed)."""
    out: list[float] = []
    for p in raw:
        m = re.search(pattern, p.read_text())
        if m is None:
            raise ValueError(f"{p}: no line matches {pattern!r}")
        out += [float(g) for g in m.groups()]
    return tuple(out)


# ---- one host copy shared by two processes (docs/shared-host-h200.md) ---------------------------------------------


def _kb_field(path: Path, field: str) -> float:
    """A /proc/meminfo field of a copy of it ('Field: N kB'), in GB."""
    line = next(x for x in path.read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024 / 1e9


def meminfo_used(raw: list[Path]) -> tuple[float, float, float, float, float, float, float]:
    """The host's memory around a run, in GB, from [a meminfo copy with MemTotal, one before the run, its samples
    ('time MemAvailable_kB Shmem_kB' every 0.5 s), one after]: MemTotal, the smallest MemAvailable sampled, the peak
    used (MemTotal less that), used before, the largest Shmem sampled, used after, the peak used less before."""
    total = _kb_field(raw[0], "MemTotal")
    rows = [x.split() for x in raw[2].read_text().splitlines() if x.strip()]
    low = min(int(r[1]) for r in rows) * 1024 / 1e9
    shmem = max(int(r[2]) for r in rows) * 1024 / 1e9
    before, after = total - _kb_field(raw[1], "MemAvailable"), total - _kb_field(raw[3], "MemAvailable")
    return total, low, total - low, before, shmem, after, total - low - before


def streamed_rates(raw: list[Path], bytes_key: str, keys: list[str]) -> tuple[float, ...]:
    """Per forward time at `keys`: that time in ms, then the bytes at `bytes_key` over it in GB/s."""
    size = float(_at(raw[0], bytes_key))
    return tuple(x for k in keys for x in (float(_at(raw[0], k)) * 1e3, size / float(_at(raw[0], k)) / 1e9))


def fill_times(raw: list[Path], bytes_key: str) -> tuple[float, float, float, float, float]:
    """The bench's streamed bytes (raw[0], bench.json) filled at the fill probe's rates (raw[1], probe.json), in
    seconds: the slowest and fastest into a memfd, the slowest and fastest into anonymous memory; then the owner's
    offload shared less private."""
    size = float(_at(raw[0], bytes_key))
    rows = _at(raw[1], "rows")
    memfd = [size / (r["gbps"] * 1e9) for r in rows if r["way"] == "memfd"]
    anon = [size / (r["gbps"] * 1e9) for r in rows if r["way"] == "anonymous"]
    extra = difference(raw[:1], "rounds/round=shared/ranks/0/offload_s", "rounds/round=private/ranks/0/offload_s")
    return min(memfd), max(memfd), min(anon), max(anon), extra


# ---- batched CFG and fp8 weight storage (docs/levers.md) ----------------------------------------------------------


def levers_row(raw: list[Path]) -> tuple[float, ...]:
    """One line of scripts/levers_doc.py's run tables, from [a `chunkflow run` report, the no offload report it is
    held against (default: itself)]: step measured and predicted (ms), the error in percent, the step over the
    reference's, peak allocated measured and predicted and pinned host bytes (GB)."""
    rep, ref = _load(raw[0]), _load(raw[-1])
    m, p = rep["measured"], rep["predicted"]
    step, pred = m["median_step_s"], p["step_time_s"]
    return (step * 1e3, pred * 1e3, (step - pred) / pred * 100, step / ref["measured"]["median_step_s"],
            m["peak_allocated_bytes"] / 1e9, p["peak_memory_bytes"] / 1e9, m["pinned_host_bytes"] / 1e9)


def levers_then_row(raw: list[Path]) -> tuple[float, ...]:
    """One line of docs/levers.md's 07:20-07:52 Qwen-Image table, from [a run report, the no offload report beside
    it]: step measured and predicted then (ms), the step over no offload's measured and predicted, peak allocated and
    pinned host bytes (GB)."""
    rep, ref = _load(raw[0]), _load(raw[-1])
    step, pred = rep["measured"]["median_step_s"], rep["predicted"]["step_time_s"]
    return (step * 1e3, pred * 1e3, step / ref["measured"]["median_step_s"], pred / ref["predicted"]["step_time_s"],
            rep["measured"]["peak_allocated_bytes"] / 1e9, rep["measured"]["pinned_host_bytes"] / 1e9)


def cast_row(raw: list[Path], word: str = "yes") -> tuple[Any, ...]:
    """The fp8 cast placement at one frame count, from [cast on the compute stream, on the copy stream, no offload (run
    reports), the two latents' comparison]: each step (ms) and its ratio to no offload's, both peaks allocated (GB),
    and `word` where the comparison says bit-identical True."""
    a, b, ref = (_load(p)["measured"] for p in raw[:3])
    same = word if "bit-identical True" in raw[3].read_text() else "NOT SAME"
    return (a["median_step_s"] * 1e3, a["median_step_s"] / ref["median_step_s"], b["median_step_s"] * 1e3,
            b["median_step_s"] / ref["median_step_s"], a["peak_allocated_bytes"] / 1e9,
            b["peak_allocated_bytes"] / 1e9, same)


def crossover_line(raw: list[Path]) -> str:
    """scripts/levers_doc.py's crossover line of one `chunkflow bench` frame sweep (bench.csv): chunkflow r=0 over no
    offload by frames, from where it stays within 1.05x, the prefetch stall over the step, from where it stays under
    2%, and the planner's critical frame count."""
    rows = _bench(raw[0])
    none = {int(r["value"]): float(r["measured_step_s"]) for r in rows if r["mode"] == "none"}
    cf = {int(r["value"]): r for r in rows if r["mode"] == "chunkflow"}
    values = sorted(v for v in cf if v in none)
    ratio = {v: float(cf[v]["measured_step_s"]) / none[v] for v in values}
    stall = {v: float(cf[v]["prefetch_stall_s"]) / float(cf[v]["measured_step_s"]) for v in values}

    def first_from(ok: dict[int, bool]) -> str:
        good = [v for i, v in enumerate(values) if all(ok[u] for u in values[i:])]
        return f"from {good[0]} frames on" if good else "at none of them"

    pairs = ", ".join(f"{v}: {ratio[v]:.3f}x" for v in values)
    stalls = ", ".join(f"{v}: {stall[v]:.0%}" for v in values)
    crit = float(cf[values[0]]["critical"])
    return (f"chunkflow r=0 / no offload by frames: {pairs}; within 1.05x "
            f"{first_from({v: ratio[v] <= 1.05 for v in values})}. Prefetch stall / step: {stalls}; under 2% "
            f"{first_from({v: stall[v] < 0.02 for v in values})}; predicted critical frames {crit:.1f}")


def crossover_frames(raw: list[Path]) -> tuple[int, float, int, float, float]:
    """Two frame sweeps (bench.csv: bf16, then fp8 storage): the first frame count from which chunkflow r=0's prefetch
    stall stays under 2% of the step and the planner's critical frames, for each; then the fp8 count over bf16's."""
    out: list[Any] = []
    for path in raw:
        cf = {int(r["value"]): r for r in _bench(path) if r["mode"] == "chunkflow"}
        values = sorted(cf)
        low = [v for i, v in enumerate(values)
               if all(float(cf[u]["prefetch_stall_s"]) < 0.02 * float(cf[u]["measured_step_s"]) for u in values[i:])]
        out += [low[0], float(cf[values[0]]["critical"])]
    return out[0], out[1], out[2], out[3], out[2] / out[0]


def bench_extra(raw: list[Path], mode: str, frames: list[str], base: str = "none") -> tuple[float, ...]:
    """Per point of bench.csv: how much longer a mode's step took than `base`'s, in percent (a/b - 1)."""
    return tuple((r - 1.0) * 100.0 for r in bench_ratios(raw, mode, frames, base=base))


def shorter_span(raw: list[Path], key: str) -> tuple[float, float]:
    """Per pair of files (1st/2nd, 3rd/4th, ...): how much less `key` is in the first than in the second, in percent
    (1 - a/b); the smallest and largest."""
    out = [(1.0 - r) * 100.0 for r in ratios(raw, key)]
    return min(out), max(out)


# ---- communication awareness on NVLink (docs/results.md section 6: paced and unpaced bench.csv of one model) --------


def _point(rows: list[dict[str, str]], mode: str, value: str, column: str = "measured_step_s",
           chunk: str = "16000000.0") -> float:
    """A column of one mode at one point of bench.csv; chunkflow at `chunk` bytes and residency 0 (the sweeps'
    other chunkflow points left out)."""
    return next(float(r[column]) for r in rows if r["mode"] == mode and r["value"] == value
                and (mode != "chunkflow" or (r["chunk_bytes"] == chunk and float(r["residency"]) == 0.0)))


def _point_ratio(rows: list[dict[str, str]], mode: str, value: str, column: str = "measured_step_s") -> float:
    """A mode's `column` over no offload's at one point of bench.csv (chunkflow at 16 MB, residency 0)."""
    return _point(rows, mode, value, column) / _point(rows, "none", value, column)


def point_columns(raw: list[Path], value: str, column: str, modes: list[str], scale: float = 1e3) -> tuple[float, ...]:
    """`column` of each of `modes` at one point of the first bench.csv (chunkflow at 16 MB, r = 0), times `scale`."""
    rows = _bench(raw[0])
    return tuple(_point(rows, m, value, column) * scale for m in modes)


def predicted_measured(raw: list[Path], mode: str, value: str) -> tuple[float, float]:
    """A mode's step over no offload's at one point of the first bench.csv, as the planner predicted it and as
    measured."""
    rows = _bench(raw[0])
    return _point_ratio(rows, mode, value, "predicted_step_s"), _point_ratio(rows, mode, value)


def none_steps_ms(raw: list[Path], value: str) -> tuple[float, ...]:
    """No offload's measured step (ms) at one point of each bench.csv (the same point on different runs)."""
    return tuple(_point(_bench(p), "none", value) * 1e3 for p in raw)


def aware_point(raw: list[Path], value: str) -> tuple[float, float, float]:
    """One point of a model's paced run (the first bench.csv) and unpaced run (the last): layerwise over no offload
    (paced run), chunkflow over no offload paced, and unpaced (each against its own run's no offload)."""
    paced, unpaced = _bench(raw[0]), _bench(raw[-1])
    return (_point_ratio(paced, "layerwise", value), _point_ratio(paced, "chunkflow", value),
            _point_ratio(unpaced, "chunkflow", value))


def aware_cost(raw: list[Path], values: list[str]) -> float:
    """The most pacing cost: per pair of files (paced, unpaced bench.csv of one model) and its point in `values`,
    chunkflow's step over no offload's paced less unpaced (in no-offload steps); the largest."""
    return max(aware_point(raw[2 * i:2 * i + 2], v)[1] - aware_point(raw[2 * i:2 * i + 2], v)[2]
               for i, v in enumerate(values))


def aware_hidden_span(raw: list[Path], what: str = "cost") -> tuple[float, float]:
    """Over the points the paced run's bench.csv marks hidden (past the critical point), per pair of files (paced,
    unpaced): `cost` paced less unpaced chunkflow over no offload, or `unpaced` |unpaced over no offload - 1|, in
    percent of no offload's step; the smallest and largest."""
    out = []
    for i in range(0, len(raw), 2):
        for v in [r["value"] for r in _bench(raw[i]) if r["mode"] == "none" and r["regime"] == "hidden"]:
            _, paced, unpaced = aware_point(raw[i:i + 2], v)
            out.append((paced - unpaced if what == "cost" else abs(unpaced - 1.0)) * 100.0)
    return min(out), max(out)


# ---- reference


def fp8_cast_speedups(raw: list[Path]) -> tuple[float, float]:
    """The Triton fp8 cast over PyTorch's copy, from [the cast tests' log (a kernel-shape sweep, then PyTorch's copy),
    calibrate's log]: the smaller and the larger of the sweep's best rate and calibrate's, each over PyTorch's."""
    number = r"(\d+(?:\.\d+)?)"
    (base,) = log_numbers(raw[:1], rf"torch copy: {number} GB/s")
    (calibrated,) = log_numbers(raw[1:2], rf"fp8 cast {number} GB/s \(triton\)")
    _, best = log_span(raw[:1], rf"triton BLOCK=\d+ warps=\d+: {number} GB/s")
    found = sorted((best / base, calibrated / base))
    return found[0], found[1]


def activation_multiples(raw: list[Path], phase: str = "denoise") -> tuple[float, ...]:
    """Per pair of files (a plan, its run report): the activations the phase held over the plan's activation model
    (memory.activation_bytes on the plan's model spec and workload, one forward's batch); held is the phase's measured
    peak allocation less the plan's allocation without its activations."""
    out = []
    for plan_path, report_path in zip(raw[::2], raw[1::2]):
        plan = _load(plan_path)
        spec = ModelSpec.model_validate(plan["model"]["spec"])
        work = Workload.model_validate({k: v for k, v in plan["workload"].items() if k != "tokens"})
        forward, _ = per_forward(work, bool(plan["offload"].get("cfg_batched")))
        act = activation_bytes(spec, forward, plan["parallel"]["sp_degree"])
        others = float(plan["prediction"]["phases"][phase]["allocated_bytes"]) - act
        held = float(_at(report_path, f"generation/phases/{phase}/measured_peak_allocated_bytes")) - others
        out.append(held / act)
    return tuple(out)


def eta_ratio(raw: list[Path], dim: str, base: str, tokens: float) -> float:
    """docs/data/h200-any/attn_head_dim.py's output: attention's efficiency at head dim `dim` over head dim `base`'s,
    at `tokens` queries and as many keys."""
    eta = _at(raw[0], "eta")

    def at(d: str) -> float:
        return next(float(e) for q, k, e in eta[d] if q == tokens and k == tokens)

    return at(dim) / at(base)


# ---- measurements


def abs_worst(raw: list[Path], keys: list[str], scale: float = 100.0) -> float:
    """The largest |value| at any of `keys` in any file, times `scale` ("within N%")."""
    return abs(worst_of(raw, keys, scale))


def all_within(raw: list[Path], keys: list[str], limit: float, scale: float = 100.0) -> float:
    """`limit` where every |value| at `keys` in every file, times `scale`, is at most `limit` (a goal met), else
    the largest, which then differs from the text."""
    worst = abs_worst(raw, keys, scale)
    return limit if worst <= limit else worst


def records_span(raw: list[Path], field: str, tag: str = "loop") -> tuple[float, float, float]:
    """A diagnostic's records (records.json) of one tag: the smallest and largest `field`, and the largest over the
    smallest."""
    found = [float(r[field]) for r in _at(raw[0], "records") if r["tag"] == tag]
    return min(found), max(found), max(found) / min(found)


def host_op_over_records(raw: list[Path], key: str, tag: str = "loop") -> float:
    """A calibration's host time an operator (the first file, at `key`, us) over the one a diagnostic's eager
    forwards ran at (the last file: the median of its `tag` records' eager_ms for two forwards of n_ops each)."""
    diag = _load(raw[-1])
    eager = statistics.median(float(r["eager_ms"]) for r in diag["records"] if r["tag"] == tag)
    return float(_at(raw[0], key)) / (eager * 1e3 / (2 * diag["n_ops"]))


def drift_rms(raw: list[Path], fits: list[str]) -> tuple[float, float]:
    """How far a second calibration moved from the first (compare.json's rows), in percent: per fit the root mean
    square of its figures' changes, second / first - 1, as bands.drift_between takes it (h2d's figures are the copy
    times bands.FITS["h2d"] gives for the fitted link rate and start-up); the smallest and largest over `fits`."""
    rows = _load(raw[0])["rows"]
    out = []
    for fit in fits:
        mine = [r for r in rows if r["fit"] == fit]
        if fit == "h2d":
            c = {r["constant"]: r for r in mine}
            first, second = (get_hardware("h200").model_copy(update={k: c[k][which] for k in
                                                                      ("h2d_link_gbps", "dma_startup_us")})
                             for which in ("first", "second"))
            was = dict(FITS["h2d"].values(first))
            changes = [v / was[k] - 1.0 for k, v in FITS["h2d"].values(second)]
        else:
            changes = [float(r["diff"]) for r in mine]
        out.append(math.sqrt(sum(x * x for x in changes) / len(changes)) * 100.0)
    return min(out), max(out)


def way_spans(raw: list[Path], ways: list[str]) -> tuple[float, ...]:
    """A fill probe's rates (probe.json rows, GB/s): per way in `ways`, the slowest and fastest."""
    rows = _at(raw[0], "rows")
    out: list[float] = []
    for way in ways:
        rates = [float(r["gbps"]) for r in rows if r["way"] == way]
        out += [min(rates), max(rates)]
    return tuple(out)


def run_residency_row(raw: list[Path]) -> tuple[float, ...]:
    """A run report's residency as it ran (run/offload/residency, percent), then `levers_row` of [the report, the
    no offload report it is held against]."""
    return (float(_at(raw[0], "run/offload/residency")) * 100.0, *levers_row(raw))


def peak_per_model(raw: list[Path], counts: list[int]) -> tuple[float, ...]:
    """`phase_peak_max` of consecutive groups of run reports, `counts` of them each (one model's runs a group), GB."""
    out: list[float] = []
    start = 0
    for n in counts:
        out.append(phase_peak_max(raw[start:start + n]))
        start += n
    return tuple(out)


# ---- tiers


def generation_row(raw: list[Path], steps: int = 50) -> tuple[float, ...]:
    """One line of a run report's generation table: encode, denoise, decode and generation seconds, the generation
    scaled to `steps`, the host peak (GB), the largest phase's peak GPU memory (GB) and the bytes read from disk
    (GB)."""
    report = _load(raw[0])
    g = report["generation"]
    phases = g["phases"]
    return (*(float(phases[p]["measured_time_s"]) for p in ("encode", "denoise", "decode")),
            float(g["generation_time_s"]), _scaled(report, steps), float(g["host_peak_bytes"]) / 1e9,
            phase_peak_max(raw[:1]), _disk_read(report) / 1e9)


def one_off_share(raw: list[Path], key: str, steps: int = 50) -> tuple[float, float, float]:
    """A one-off cost: `key` in the first report less in the last (seconds), and that as a percentage of the last
    report's generation as measured and as scaled to `steps`."""
    extra = difference(raw, key)
    last = _load(raw[-1])
    return extra, 100.0 * extra / float(last["generation"]["generation_time_s"]), 100.0 * extra / _scaled(last, steps)


def log_cases(raw: list[Path], marker: str, text: str) -> tuple[int, int]:
    """Over a log's lines holding `marker` (one line per case a check ran): how many also hold `text` (its verdict),
    and how many."""
    cases = [line for line in raw[0].read_text().splitlines() if marker in line]
    return sum(text in line for line in cases), len(cases)


def load_rate_span(raw: list[Path]) -> tuple[float, float]:
    """The slowest and fastest of the reports' load read rates (GB/s)."""
    rates = load_rates(raw)
    return min(rates), max(rates)


def load_time_spans(raw: list[Path]) -> tuple[float, float, float, float]:
    """Over the reports: the shortest and longest load (s), then the shortest and longest load their plans
    predicted (s)."""
    return (*span(raw, "generation/load/measured_time_s"), *span(raw, "generation/load/predicted_time_s"))


_BENCH_LINE = re.compile(r"^\s*(\S.*?) frames (\d+): ([\d.]+) s measured")


def _bench_log(path: Path) -> dict[tuple[str, int], float]:
    """A `chunkflow bench` console log's measured steps: (config, frames) -> seconds."""
    out = {}
    for line in path.read_text().splitlines():
        m = _BENCH_LINE.match(line)
        if m:
            out[(m[1], int(m[2]))] = float(m[3])
    return out


def bench_log_steps(raw: list[Path], config: str, frames: list[int], scale: float = 1e3) -> tuple[float, ...]:
    """Per bench log, per frame count: the config's measured step, times `scale` (ms)."""
    return tuple(_bench_log(p)[(config, f)] * scale for p in raw for f in frames)


def bench_log_spans(raw: list[Path], config: str, frames: list[int], per: int = 2,
                    scale: float = 1e3) -> tuple[float, ...]:
    """Per group of `per` consecutive bench logs (the rounds of one version): the config's fastest and slowest
    measured step over the frame counts, times `scale` (ms)."""
    out: list[float] = []
    for i in range(0, len(raw), per):
        found = bench_log_steps(raw[i:i + per], config, frames, scale)
        out += [min(found), max(found)]
    return tuple(out)


def bench_log_spreads(raw: list[Path], config: str, frames: list[int], per: int = 2) -> tuple[float, ...]:
    """Per group of `per` consecutive bench logs: the config's slowest step over its fastest (over the frame counts
    and the logs), less 1, in percent."""
    spans = bench_log_spans(raw, config, frames, per)
    return tuple((hi / lo - 1.0) * 100.0 for lo, hi in zip(spans[::2], spans[1::2]))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def jsonl_step_ratios(raw: list[Path], mode: str, frames: list[int], key: str = "step_s",
                      base: str = "none") -> tuple[float, ...]:
    """A JSON-lines results file (one record per mode and frame count): the mode's `key` over the baseline's at each
    of `frames`."""
    pick = {(r["mode"], int(r["frames"])): float(r[key]) for r in _jsonl(raw[0])}
    return tuple(pick[(mode, f)] / pick[(base, f)] for f in frames)


def jsonl_excess_span(raw: list[Path], mode: str, key: str = "step_s", base: str = "none") -> tuple[float, float]:
    """The smallest and largest excess of a mode's `key` over the baseline's, in percent, over the frame counts of a
    JSON-lines results file."""
    frames = sorted({int(r["frames"]) for r in _jsonl(raw[0]) if r["mode"] == mode})
    found = [(x - 1.0) * 100.0 for x in jsonl_step_ratios(raw, mode, frames, key, base)]
    return min(found), max(found)


def none_spread(raw: list[Path], value: str) -> float:
    """No offload's slowest measured step over its fastest at one point of several bench.csv (the same point on
    different runs), less 1, in percent."""
    steps = none_steps_ms(raw, value)
    return (max(steps) / min(steps) - 1.0) * 100.0


def block_move_and_compute(raw: list[Path], frames: int) -> tuple[float, float]:
    """A block's copy and its compute, in ms, from [bench.csv, calibration.json]: the pinned bytes of the points over
    the bench model's blocks (its catalog entry's n_blocks) at calibrate's fitted H2D rate, and calibrate's one-block
    forward of that model at `frames`."""
    rows = _bench(raw[0])
    pinned = max(float(r["pinned_bytes"] or 0) for r in rows)
    model = _bench_model(rows)
    cal = _load(raw[-1])
    block = next(b for b in cal["blocks"] if b["model"] == model and int(b["frames"]) == frames)
    return pinned / _n_blocks(model) / (float(cal["h2d_fit"]["gbps"]) * 1e9) * 1e3, float(block["time_s"]) * 1e3


def _bench_model(rows: list[dict[str, str]]) -> str:
    """The one model a bench.csv measured."""
    models = {r["model"] for r in rows}
    if len(models) != 1:
        raise ValueError(f"bench.csv holds {sorted(models)}, not one model")
    return models.pop()


def _n_blocks(model: str) -> int:
    """A model's transformer blocks, as the planner's catalog counts them."""
    return get_model(model).n_blocks


# ---- levers -------------------------------------------------------------------------------------------------------


def log_span(raw: list[Path], pattern: str, scale: float = 1.0) -> tuple[float, float]:
    """The smallest and largest number `pattern`'s first group captures over every match in every file, times
    `scale` (a rate several logs printed)."""
    found = [float(m.group(1)) * scale for p in raw for m in re.finditer(pattern, p.read_text())]
    if not found:
        raise ValueError(f"no line matches {pattern!r}")
    return min(found), max(found)


def change_span(raw: list[Path], key: str, key2: str) -> tuple[float, float]:
    """The smallest and largest of `changes` (per file, `key` against `key2` in percent)."""
    found = changes(raw, key, key2)
    return min(found), max(found)


def bench_extra_span(raw: list[Path], mode: str, frames: list[str], base: str = "none") -> tuple[float, float]:
    """The smallest and largest of `bench_extra` (a mode's step over `base`'s less 1, in percent, per point)."""
    found = bench_extra(raw, mode, frames, base)
    return min(found), max(found)


def spread(raw: list[Path], key: str) -> float:
    """How far apart `key` lies over the files: the largest over the smallest less 1, in percent."""
    found = [float(_at(p, key)) for p in raw]
    return (max(found) / min(found) - 1.0) * 100.0


def plan_point(raw: list[Path]) -> tuple[float, float, float]:
    """A plan's own figures (`chunkflow plan --out` JSON): its residency in percent, its predicted step over its
    predicted no offload step, and how far under its target that leaves it (in percent of no offload's step)."""
    plan = _load(raw[0])
    pred, none = plan["prediction"]["step_time_s"], plan["prediction"]["baselines"]["none"]["step_time_s"]
    return plan["offload"]["residency"] * 100.0, pred / none, (plan["target_step_time_s"] - pred) / none * 100.0


def over_target(raw: list[Path]) -> float:
    """How far a run's step over its no offload run's lies above its plan's target, from [run report, no offload
    report, plan], in percent of no offload's step."""
    rep, ref, plan = (_load(p) for p in raw[:3])
    target = plan["target_step_time_s"] / plan["prediction"]["baselines"]["none"]["step_time_s"]
    return (rep["measured"]["median_step_s"] / ref["measured"]["median_step_s"] - target) * 100.0


def cast_cost(raw: list[Path]) -> tuple[float, float, float, float]:
    """A plan's fp8 cast of one block as its model prices it: the profile's cast rate (GB/s), the block's bf16 bytes
    (MB), their cast time and the block's predicted compute (ms)."""
    plan = _load(raw[0])
    rate = float(plan["hardware"]["spec"]["fp8_cast_gbps"])
    block = plan["model"]["block_bytes_total"] / plan["model"]["n_blocks"]
    return rate, block / 1e6, block / (rate * 1e9) * 1e3, plan["analysis"]["t_comp_s"] * 1e3


def streamed_block(raw: list[Path]) -> tuple[float, float, float, float]:
    """A run's streamed bytes a block (MB, from [run report, its plan]: the report's offloaded less resident bytes over
    its blocks), the plan's link rate (GB/s), their copy time (overlap.T_pref at the plan's eta_pref) and the plan's
    compute a block (ms)."""
    stats, plan = _load(raw[0])["stats"], _load(raw[1])
    block = (stats["bytes_offloaded"] - stats["resident_bytes"]) / stats["n_blocks"]
    link = float(plan["hardware"]["h2d_gbps"])
    copy = T_pref(block, link * 1e9, float(plan["hardware"]["eta_pref"]))
    return block / 1e6, link, copy * 1e3, plan["analysis"]["t_comp_s"] * 1e3


def _bf16_tensor(path: Path, name: str = "latents") -> list[float]:
    """A bf16 tensor of a .safetensors file as floats (standard library: each bf16 is a float32's upper half)."""
    import array
    import struct

    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + size])[name]
    if head["dtype"] != "BF16":
        raise ValueError(f"{path}: {name} is {head['dtype']}, not BF16")
    a, b = head["data_offsets"]
    body = data[8 + size + a:8 + size + b]
    out = bytearray(2 * len(body))
    out[2::4], out[3::4] = body[0::2], body[1::2]
    return list(array.array("f", bytes(out)))


def latents_rel_norm(raw: list[Path]) -> float:
    """The first file's latents against the second's (.safetensors, bf16): |a - b| / |b| (L2), in percent."""
    a, b = _bf16_tensor(raw[0]), _bf16_tensor(raw[1])
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / sum(y * y for y in b)) * 100.0


# ---- pipeline: whole generations against their plans (docs/pipeline-h200.md) -----------------------------------------


def medians(raw: list[Path], key: str, scale: float = 1.0) -> tuple[float, ...]:
    """Per file: the median of the list at `key` (a phase's or a part's times over the measured generations), times
    `scale`."""
    return tuple(statistics.median(_flat(_at(p, key))) * scale for p in raw)


def listed(raw: list[Path], key: str, scale: float = 1.0) -> tuple[float, ...]:
    """Every number of the list at `key` in each file, in order, times `scale` (each generation's time)."""
    return tuple(v * scale for p in raw for v in _flat(_at(p, key)))


def parts_against_plan(raw: list[Path], parts: list[str], phase: str = "encode",
                       scale: float = 1e3) -> tuple[float, ...]:
    """A run report's parts of a phase: per part its median over the measured generations and its plan's figure
    (`predicted_parts_s`), times `scale` (ms)."""
    ph = _at(raw[0], f"generation/phases/{phase}")
    return tuple(v for part in parts for v in (statistics.median(ph["parts_s"][part]) * scale,
                                               float(ph["predicted_parts_s"][part]) * scale))


def first_generation_errors(raw: list[Path], phases: list[str]) -> tuple[float, ...]:
    """A run report's first generation (start-up included) against its plan, in percent, per phase of `phases`
    (`generation`: the phases' sum against the plan's): `first_phase_times_s` against the plan's phase `time_s`."""
    r = _load(raw[0])
    first, plan = r["generation"]["first_phase_times_s"], r["plan"]["prediction"]["phases"]
    out = []
    for ph in phases:
        names = ["encode", "denoise", "decode"] if ph == "generation" else [ph]
        out.append((sum(first[n] for n in names) / sum(plan[n]["time_s"] for n in names) - 1.0) * 100.0)
    return tuple(out)


def host_forwards(raw: list[Path], arch: str, forwards: int = 2) -> tuple[float, float]:
    """A calibration's host cost of one operator for `arch`'s stand-in (us; the first file, calibration.json) and
    that times the operators a forward counted by a diagnostic (the last file's 'ops per forward N') times
    `forwards`, in ms."""
    us = float(_at(raw[0], f"operators/host/host_op_us/{arch}"))
    (ops,) = log_numbers(raw[-1:], r"ops per forward (\d+)")
    return us, us * ops * forwards / 1e3


def printed_list_span(raw: list[Path], prefix: str) -> tuple[float, float, int]:
    """Over the lines of a diagnostic's output starting with `prefix`, each ending in a bracketed list of times: the
    smallest and largest time and how many."""
    found = [float(x) for line in raw[0].read_text().splitlines() if line.startswith(prefix)
             for x in line.rsplit("[", 1)[1].rstrip("]").split(",")]
    return min(found), max(found), len(found)


def longest_over_next(raw: list[Path], key: str) -> float:
    """The largest number of the list at `key` less the next largest (how much longer the slowest generation's
    phase took than the other ones)."""
    found = sorted(_flat(_at(raw[0], key)), reverse=True)
    return found[0] - found[1]


def quotient(raw: list[Path], key: str, key2: str, scale: float = 1.0) -> float:
    """`ratio` times `scale` (bytes over a rate: a time)."""
    return ratio(raw, key, key2) * scale


def same_change(raw: list[Path], key: str, key2: str) -> tuple[float, float]:
    """Over files that all hold the same number at `key` and at `key2` (runs of one workload): `key` against `key2`
    in percent, and `key` in GB; an error where the files differ."""
    pairs = {(float(_at(p, key)), float(_at(p, key2))) for p in raw}
    if len(pairs) != 1:
        raise ValueError(f"the files differ at {key} or {key2}: {sorted(pairs)}")
    (a, b), = pairs
    return (a / b - 1.0) * 100.0, a / 1e9


def first_encode_startups(raw: list[Path]) -> tuple[float, float, float]:
    """Per run report, a process's first encode less its measured (later) encode: the median over the reports, the
    smallest and the largest, in seconds."""
    found = [float(_at(p, "generation/first_phase_times_s/encode"))
             - float(_at(p, "generation/phases/encode/measured_time_s")) for p in raw]
    return statistics.median(found), min(found), max(found)


def inverse_excess(raw: list[Path], key: str) -> float:
    """1 over the number at `key` less 1, in percent (a scale below 1 as the time it stands for over 1)."""
    return (1.0 / float(_at(raw[0], key)) - 1.0) * 100.0


def unscaled_error(raw: list[Path], key: str, key2: str, scale_key: str) -> float:
    """A run report's measured `key` against its prediction `key2` taken without a calibration's scale (the last
    file's `scale_key`: the prediction times it), in percent."""
    measured, predicted = float(_at(raw[0], key)), float(_at(raw[0], key2))
    return (measured / (predicted * float(_at(raw[-1], scale_key))) - 1.0) * 100.0


_CELL = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _table_rows(path: Path) -> dict[tuple[str, str], list[str]]:
    """docs/data/h200-repredict's file of scripts/pipeline_doc.py tables, one per report after a '## REPORT' line:
    (report, phase) -> the row's cells."""
    rows: dict[tuple[str, str], list[str]] = {}
    report = ""
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            report = line[3:].strip()
        elif line.startswith("| ") and report:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[(report, cells[1].strip("*"))] = cells
    return rows


def _cell(cells: list[str], column: int) -> float:
    """The first number a table row's cell prints."""
    m = _CELL.search(cells[column])
    if m is None:
        raise ValueError(f"no number in {cells[column]!r}")
    return float(m.group(0))


def table_cells(raw: list[Path], cells: list[list[Any]], scale: float = 1.0) -> tuple[float, ...]:
    """Cells of scripts/pipeline_doc.py tables kept per report (docs/data/h200-repredict): each [file index, report,
    phase, column] (columns from 0: pipeline, phase, measured, predicted, error, first generation, predicted, error,
    peak GPU memory, predicted, error), the number it prints, times `scale`."""
    tables = [_table_rows(p) for p in raw]
    return tuple(_cell(tables[i][(rep, ph)], col) * scale for i, rep, ph, col in cells)


def table_span(raw: list[Path], column: int, phases: list[str], name: str = "") -> tuple[float, float]:
    """The smallest and largest number of `column` over the rows of `phases` (pipelines whose name holds `name`) of a
    file of scripts/pipeline_doc.py tables kept per report."""
    found = [_cell(c, column) for (_, ph), c in _table_rows(raw[0]).items() if ph in phases and name in c[0]]
    return min(found), max(found)


def table_cells_and_values(raw: list[Path], cells: list[list[Any]], key: str,
                           scale: float = 100.0) -> tuple[float, ...]:
    """`table_cells` of the first file (cells' file index 0), then the number at `key` in each further file (run
    reports: what their own plans gave), times `scale`."""
    return table_cells(raw[:1], cells) + tuple(float(_at(p, key)) * scale for p in raw[1:])


def per_call_span(raw: list[Path], vae: str, scale: float = 1e3) -> tuple[float, float]:
    """A calibration's tiled decodes of one VAE (calibration.json's `vae` rows): each decode's seconds over its
    decoder calls, times `scale` (ms); the smallest and largest."""
    found = [float(v["time_s"]) / int(v["decoder_calls"]) * scale for v in _at(raw[0], "vae")
             if v["vae"] == vae and v["tiled"]]
    return min(found), max(found)


# ---- results ------------------------------------------------------------------------------------------------------
# docs/results.md (two H200s, SP=2: scripts/gpu_results.py's bench.csv per model and link), docs/shared-host-h200.md.


def _regime_points(raw: list[Path], regime: str | None,
                   exclude: list[list[str]] | None = None) -> list[tuple[list[dict[str, str]], str]]:
    """(rows, value) of every point of each bench.csv whose no offload row the bench marks `regime` (any where None),
    less the points `exclude` names as [model, value]."""
    skip = {tuple(e) for e in exclude or []}
    out = []
    for p in raw:
        rows = _bench(p)
        out += [(rows, r["value"]) for r in rows if r["mode"] == "none" and (regime is None or r["regime"] == regime)
                and (r["model"], r["value"]) not in skip]
    return out


def contention_removed_span(raw: list[Path], regime: str = "hidden", exclude: list[list[str]] | None = None,
                            min_excess: float = 1.0) -> tuple[float, float]:
    """(layerwise - chunkflow) / (layerwise - no offload) in percent (chunkflow at 16 MB, r = 0) at the points of
    `regime` where layerwise's step is more than `min_excess` percent over no offload's (results_doc.py's "none to
    remove" otherwise); the smallest and largest."""
    found = []
    for rows, v in _regime_points(raw, regime, exclude):
        n, lw, cf = (_point(rows, m, v) for m in ("none", "layerwise", "chunkflow"))
        if lw - n > min_excess / 100.0 * n:
            found.append((lw - cf) / (lw - n) * 100.0)
    return min(found), max(found)


def step_ratio_span(raw: list[Path], modes: list[str], regime: str | None = "hidden",
                    exclude: list[list[str]] | None = None, excess: bool = False) -> tuple[float, float]:
    """Each mode's step over no offload's (chunkflow at 16 MB, r = 0) at the points of `regime`; the smallest and
    largest, as ratios or (`excess`) in percent over no offload."""
    found = [_point_ratio(rows, m, v) for rows, v in _regime_points(raw, regime, exclude) for m in modes]
    if excess:
        found = [(x - 1.0) * 100.0 for x in found]
    return min(found), max(found)


def point_excess(raw: list[Path], value: str, mode: str = "chunkflow") -> float:
    """A mode's step over no offload's at one point of the first bench.csv (chunkflow at 16 MB, r = 0), in percent
    over it."""
    return (_point_ratio(_bench(raw[0]), mode, value) - 1.0) * 100.0


def peak_spans(raw: list[Path], regime: str | None = None) -> tuple[float, float, float, float, float, float]:
    """Over the points of the bench.csv files (of `regime`, else every one): chunkflow's peak allocated (16 MB,
    r = 0) and no offload's, GB, each the smallest and largest; then the share chunkflow saves against no offload,
    percent, smallest and largest."""
    cf, none, saved = [], [], []
    for rows, v in _regime_points(raw, regime):
        c, n = _point(rows, "chunkflow", v, "measured_peak_bytes"), _point(rows, "none", v, "measured_peak_bytes")
        cf.append(c / 1e9)
        none.append(n / 1e9)
        saved.append((1.0 - c / n) * 100.0)
    return min(cf), max(cf), min(none), max(none), min(saved), max(saved)


def best_speedups(raw: list[Path]) -> tuple[Any, ...]:
    """Per bench.csv: the largest layerwise step over chunkflow's (16 MB, r = 0) over its points, and that point."""
    out: list[Any] = []
    for p in raw:
        rows = _bench(p)
        best = max(((_point(rows, "layerwise", v) / _point(rows, "chunkflow", v), v)
                    for r in rows if r["mode"] == "none" for v in [r["value"]]), key=lambda t: t[0])
        out += [best[0], best[1]]
    return tuple(out)


def _same(values: list[float], digits: int) -> float:
    """The value all of `values` round to at `digits` decimals; an error where they differ there."""
    rounded = {round(x, digits) for x in values}
    if len(rounded) != 1:
        raise ValueError(f"values {values} differ at {digits} decimals")
    return rounded.pop()


def _at_residency(rows: list[dict[str, str]], residency: float) -> tuple[dict[str, str], dict[str, str]]:
    """bench.csv's chunkflow row (16 MB) at residency `residency` (the residency sweep's point) and no offload's row
    at the same point."""
    x = next(r for r in rows if r["mode"] == "chunkflow" and r["chunk_bytes"] == "16000000.0"
             and abs(float(r["residency"]) - residency) < 1e-9)
    return x, next(r for r in rows if r["mode"] == "none" and r["value"] == x["value"])


def residency_at(raw: list[Path], residency: float, digits: int = 0) -> tuple[float, float, float]:
    """Per bench.csv, chunkflow (16 MB) at residency `residency` at the residency sweep's point against no offload
    there: the smallest and largest step ratio over the files, and the peak memory it saves (percent), the same in
    every file to `digits` decimals."""
    ratios, saved = [], []
    for p in raw:
        x, n = _at_residency(_bench(p), residency)
        ratios.append(float(x["measured_step_s"]) / float(n["measured_step_s"]))
        saved.append((1.0 - float(x["measured_peak_bytes"]) / float(n["measured_peak_bytes"])) * 100.0)
    return min(ratios), max(ratios), _same(saved, digits)


def accuracy_all(raw: list[Path]) -> tuple[float, ...]:
    """Over every predicted point of the bench.csv files: how many, the median |step error| and |peak error| (%),
    and the largest step and peak errors with their sign (%), as results_doc.py's accuracy table gives them."""
    pts = _points(raw, None)
    step = [float(r["err_step"]) * 100.0 for r in pts]
    peak = [float(r["err_peak"]) * 100.0 for r in pts]
    return (len(pts), statistics.median(abs(x) for x in step), statistics.median(abs(x) for x in peak),
            max(step, key=abs), max(peak, key=abs))


def _chunk_sweep(rows: list[dict[str, str]], value: str) -> dict[float, float]:
    """bench.csv's chunk sweep at one point: chunkflow's measured step (r = 0) by chunk bytes."""
    return {float(r["chunk_bytes"]): float(r["measured_step_s"]) for r in rows
            if r["mode"] == "chunkflow" and r["value"] == value and float(r["residency"]) == 0.0}


def _chunk_gaps(raw: list[Path]) -> list[float]:
    """Over pairs (bench.csv, its summary.md): the planner's chunk size as the bench's summary names it ('the planner
    picks NMB', at 'At V frames') measured against the best chunk size measured there (chunkflow, r = 0), in percent
    over the best."""
    gaps = []
    for csv_path, summary in zip(raw[::2], raw[1::2]):
        m = re.search(r"At (\d+) \w+: best measured \d+MB .*?the planner picks (\d+)MB", summary.read_text())
        if m is None:
            raise ValueError(f"{summary}: no chunk verdict")
        sweep = _chunk_sweep(_bench(csv_path), m.group(1))
        gaps.append((sweep[float(m.group(2)) * 1e6] / min(sweep.values()) - 1.0) * 100.0)
    return gaps


def chunk_pick_gap(raw: list[Path]) -> float:
    """The largest of `_chunk_gaps`: the planner's chunk pick against the best measured, percent over it."""
    return max(_chunk_gaps(raw))


def chunk_gap_span(raw: list[Path]) -> tuple[float, float]:
    """The smallest and largest of `_chunk_gaps`."""
    gaps = _chunk_gaps(raw)
    return min(gaps), max(gaps)


def chunk_point(raw: list[Path], value: str, chunk: str) -> tuple[float, float]:
    """At one point of the first bench.csv: chunkflow at `chunk` bytes (r = 0) over no offload, and layerwise over
    no offload."""
    rows = _bench(raw[0])
    n = _point(rows, "none", value)
    return _point(rows, "chunkflow", value, chunk=chunk) / n, _point(rows, "layerwise", value) / n


def block_copy_share(raw: list[Path], value: str) -> tuple[float, float, float]:
    """[bench.csv, bench.json]: a block's copy at the bench profile's H2D bandwidth (overlap.T_pref of the block's
    bytes, f_block / i_block of bench.csv, at hardware/h2d_link_gbps and eta_pref), ms; no offload's measured step
    over the model's blocks (its catalog entry's n_blocks), ms; the first as a share of the second, percent."""
    rows = _bench(raw[0])
    row = next(r for r in rows if r["mode"] == "none" and r["value"] == value)
    hw = _at(raw[1], "hardware")
    copy_ms = T_pref(float(row["f_block"]) / float(row["i_block"]), float(hw["h2d_link_gbps"]) * 1e9,
                     float(hw["eta_pref"])) * 1e3
    block_ms = float(row["measured_step_s"]) / _n_blocks(_bench_model(rows)) * 1e3
    return copy_ms, block_ms, copy_ms / block_ms * 100.0


def meminfo_peak_change(raw: list[Path]) -> tuple[float, float, float]:
    """`meminfo_peak_gb` of two runs (pairs of files) and the second's change against the first, percent."""
    a, b = meminfo_peak_gb(raw)
    return a, b, (b / a - 1.0) * 100.0


def meminfo_vs_plans(raw: list[Path], key: str = "prediction/host_memory_bytes") -> tuple[float, ...]:
    """Per triple of files (meminfo before, meminfo samples, a plan): the run's host peak (`meminfo_peak_gb`)
    against the plan's figure at `key`, percent over it."""
    out = []
    for i in range(0, len(raw), 3):
        (peak,) = meminfo_peak_gb(raw[i:i + 2])
        out.append((peak / (float(_at(raw[i + 2], key)) / 1e9) - 1.0) * 100.0)
    return tuple(out)


def run_against_codec_run(raw: list[Path]) -> tuple[float, ...]:
    """[a `chunkflow run --report` report, a scripts/codec_compare.py record]: the generation (s) of each and the
    first's change against the second (%), the median step of each (ms), the host peak of each (GB), and the encoded
    bytes stored (GB) of each."""
    rep, rec = _load(raw[0]), _load(raw[1])
    gen_a, gen_b = float(rep["generation"]["generation_time_s"]), float(rec["generation_s"])
    return (gen_a, gen_b, (gen_a / gen_b - 1.0) * 100.0, float(rep["measured"]["median_step_s"]) * 1e3,
            statistics.median(rec["step_times_s"]) * 1e3, float(rep["generation"]["host_peak_bytes"]) / 1e9,
            float(rec["host_peak_bytes"]) / 1e9, float(rep["stats"]["codec_stored_bytes"]) / 1e9,
            float(rec["codec_stats"]["codec_stored_bytes"]) / 1e9)


def all_to_all(raw: list[Path]) -> tuple[float, ...]:
    """[calibrate's log over NVLink, with P2P disabled]: per log the 56 MB all-to-all's ms, GB/s and slowdown with an
    H2D copy in flight as calibrate printed them, then the second's time over the first's."""
    found = log_numbers(raw, r"all-to-all 56 MB: ([\d.]+) ms \(([\d.]+) GB/s\), with H2D in flight x([\d.]+)")
    return (*found, found[3] / found[0])


def speedup_span(raw: list[Path], regime: str | None = "exposed") -> tuple[float, float]:
    """Layerwise's step over chunkflow's (16 MB, r = 0) at the points of `regime`; the smallest and largest."""
    found = [_point(rows, "layerwise", v) / _point(rows, "chunkflow", v) for rows, v in _regime_points(raw, regime)]
    return min(found), max(found)


def overhead_shares(raw: list[Path]) -> tuple[float, ...]:
    """Over every chunkflow point of the bench.csv files: the largest runtime overhead (overhead_s, ms), how many
    points, and the overhead as a share of the step (percent): the median, the 90th percentile (Python's
    statistics.quantiles, n = 10) and the largest."""
    pts = [r for p in raw for r in _bench(p) if r["mode"] == "chunkflow"]
    share = [float(r["overhead_s"]) / float(r["measured_step_s"]) * 100.0 for r in pts]
    return (max(float(r["overhead_s"]) for r in pts) * 1e3, len(pts), statistics.median(share),
            statistics.quantiles(share, n=10)[8], max(share))


def chunk_sweep(raw: list[Path], value: str, small_max: float, big: str) -> tuple[float, float, float]:
    """The chunk sweep at one point of the first bench.csv (chunkflow, r = 0): the spread of the steps of the chunk
    sizes up to `small_max` bytes (largest over smallest, percent over it), the `big` chunk size's step over no
    offload's (percent over it) and its prefetch stall (ms)."""
    rows = _bench(raw[0])
    small = [t for c, t in _chunk_sweep(rows, value).items() if c <= small_max]
    return ((max(small) / min(small) - 1.0) * 100.0, (_point(rows, "chunkflow", value, chunk=big)
            / _point(rows, "none", value) - 1.0) * 100.0,
            _point(rows, "chunkflow", value, "prefetch_stall_s", chunk=big) * 1e3)


def sweep_span_ms(raw: list[Path], mode: str = "chunkflow") -> tuple[float, float]:
    """The smallest and largest measured step (ms) of a mode's points in the first bench.csv."""
    found = [float(r["measured_step_s"]) * 1e3 for r in _bench(raw[0]) if r["mode"] == mode]
    return min(found), max(found)


def profile_copy(raw: list[Path], chunk_bytes: float) -> tuple[float, float, float, int]:
    """From a hardware profile's text (h2d_link_gbps, eta_pref, dma_startup_us): the start-up (us), one copy of
    `chunk_bytes` (t0 + overlap.T_pref, the planner's t0 + C/BW, ms), the start-up's share of that copy (percent) and
    that share rounded up to a whole percent."""
    gbps, eta, t0_us = (log_numbers(raw, rf"{name}: ([\d.]+)")[0] for name in ("h2d_link_gbps", "eta_pref",
                                                                                "dma_startup_us"))
    copy_s = t0_us * 1e-6 + T_pref(chunk_bytes, gbps * 1e9, eta)
    share = t0_us * 1e-6 / copy_s * 100.0
    return t0_us, copy_s * 1e3, share, math.ceil(share - 1e-9)


def block_compute_ms(raw: list[Path], value: str, mode: str = "none") -> float:
    """A mode's measured compute (compute_s) at one point of the first bench.csv over the model's blocks (its catalog
    entry's n_blocks), ms."""
    rows = _bench(raw[0])
    return _point(rows, mode, value, "compute_s") / _n_blocks(_bench_model(rows)) * 1e3


def residency_steps(raw: list[Path], residencies: list[float]) -> tuple[float, ...]:
    """chunkflow (16 MB) at each residency of `residencies` over no offload at the residency sweep's point of the
    first bench.csv."""
    rows = _bench(raw[0])
    return tuple(float(x["measured_step_s"]) / float(n["measured_step_s"])
                 for x, n in (_at_residency(rows, res) for res in residencies))


def together_rates(raw: list[Path], rounds: list[str], digits: int = 0) -> tuple[float, float]:
    """The shared-host bench (bench.json): per rank of the rounds `rounds`, its streamed bytes over its forward with
    the other rank at once (GB/s), the value they all share to `digits` decimals; then the two ranks' rates summed
    per round, the same."""
    doc = _load(raw[0])
    each, summed = [], []
    for name in rounds:
        ranks = next(r for r in doc["rounds"] if r["round"] == name)["ranks"]
        rates = [float(k["streamed_bytes"]) / float(k["together_s"]) / 1e9 for k in ranks]
        each += rates
        summed.append(sum(rates))
    return _same(each, digits), _same(summed, digits)


def singles_shares(raw: list[Path]) -> tuple[float, ...]:
    """Each other way's wall seconds as a share of the ten single processes' summed seconds (raw[0], singles.tsv),
    percent; then `speedups` (the inverse, as ratios)."""
    ups = speedups(raw)
    return (*(100.0 / x for x in ups), *ups)


def rss_over_plan(raw: list[Path]) -> tuple[float, float]:
    """[a prompt file's jobs-report.json, then server clients' serve-client.json]: every job's resident set after it
    against the prompt file's plan's host memory, percent over it; the smallest and largest."""
    report = _load(raw[0])
    plan = float(report["plan"]["prediction"]["host_memory_bytes"])
    rss = [float(j["host_rss_bytes"]) for j in report["jobs"]]
    rss += [float(j["rss_after_bytes"]) for p in raw[1:] for j in _load(p)["jobs"]]
    return (min(rss) / plan - 1.0) * 100.0, (max(rss) / plan - 1.0) * 100.0
