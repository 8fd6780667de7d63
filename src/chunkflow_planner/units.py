"""Parse and format sizes ("24GB", "16MiB") and durations ("1.2s", "850ms")."""

from __future__ import annotations

import math
import re

from chunkflow_planner.errors import ChunkflowError

_SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0}
DEFAULT_CHUNK_BYTES = 16 * 10**6  # the paper's operating point (section 4.4); here, not in offload.py, so that the
# command line's help (bench's --chunk-sizes default) imports no pydantic model to print it

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class UnitError(ChunkflowError):
    """A size or duration that cannot be parsed; the message says what is accepted."""


def parse_size(text: str | int | float, flag: str | None = None) -> int:
    """Bytes in a size such as "24GB" (10^9), "24GiB" (2^30), "512MB" or a plain byte count.

    Units are case-insensitive: B, KB, MB, GB, TB (powers of ten) and KiB, MiB, GiB, TiB
    (powers of two). The result must be a positive, finite, whole number of bytes. `flag` prefixes errors.
    """
    try:
        return _parse_size(text)
    except UnitError as exc:
        raise UnitError(f"{flag}: {exc}" if flag else str(exc)) from None


def _parse_size(text: str | int | float) -> int:
    if isinstance(text, bool):
        raise UnitError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        match = _NUMBER_UNIT.match(str(text))
        if not match:
            raise UnitError(
                f"cannot read size {text!r}: write a number and a unit, e.g. 24GB, 24GiB, 16MB, 512MiB"
            )
        value, unit = float(match.group(1)), (match.group(2) or "").lower()
        if not unit and math.isfinite(value) and (value != int(value) or value < 1024):  # "1.25", "24": a unit
            # left out, not bytes meant
            raise UnitError(f"size {text!r} has no unit; write e.g. {text}GB or {text}GiB"
                            + (f" ({text}B for bytes)" if value == int(value) else ""))
        unit = unit or "b"
    if not math.isfinite(value):
        raise UnitError(f"size must be finite, got {text!r}")
    if unit not in _SIZE_UNITS:
        raise UnitError(
            f"unknown size unit {unit!r} in {text!r}: use B, KB, MB, GB, TB (powers of 10) "
            "or KiB, MiB, GiB, TiB (powers of 2)"
        )
    size = value * _SIZE_UNITS[unit]
    if not math.isfinite(size) or size >= 2**63:
        raise UnitError(f"size {text!r} is too large")
    if size <= 0:
        raise UnitError(f"size must be positive, got {text!r}")
    if size < 1:
        raise UnitError(f"size {text!r} is less than one byte")
    return int(round(size))


def parse_duration(text: str | int | float, flag: str | None = None) -> float:
    """Seconds in a duration such as "1.2s", "850ms" or a plain number of seconds; positive and finite. `flag`
    prefixes errors."""
    try:
        return _parse_duration(text)
    except UnitError as exc:
        raise UnitError(f"{flag}: {exc}" if flag else str(exc)) from None


def _parse_duration(text: str | int | float) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "s"
    else:
        match = _NUMBER_UNIT.match(str(text))
        if not match:
            raise UnitError(f"cannot read duration {text!r}: write e.g. 1.2s or 850ms")
        value, unit = float(match.group(1)), (match.group(2) or "s").lower()
    if not math.isfinite(value):
        raise UnitError(f"duration must be finite, got {text!r}")
    if unit not in _TIME_UNITS:
        raise UnitError(f"unknown time unit {unit!r} in {text!r}: use s, ms, us or min")
    seconds = value * _TIME_UNITS[unit]
    if seconds <= 0:
        raise UnitError(f"duration must be positive, got {text!r}")
    return seconds


def format_bytes(n: float, binary: bool = False) -> str:
    """A byte count for people: 24.0 GB (powers of ten) or 22.4 GiB with binary=True."""
    base, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000.0, ["B", "KB", "MB", "GB", "TB"])
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def short_bytes(n: float) -> str:
    """A compact size for labels: 16MB, 3KB, 1.5GB."""
    return format_bytes(n).replace(" ", "").replace(".00", "").replace(".0", "")


def format_seconds(t: float) -> str:
    """A duration for people, in the unit its size calls for: 12 us, 850.0 ms, 1.234 s, 22.9 min, 1.52 h."""
    if t == float("inf"):
        return "inf"
    a = abs(t)
    if 0 < a < 1e-3:
        return f"{t * 1e6:.0f} us"
    if a < 1.0:
        return f"{t * 1e3:.1f} ms"
    if a < 60.0:
        return f"{t:.3f} s"
    if a < 3600.0:
        return f"{t / 60:.1f} min"
    return f"{t / 3600:.2f} h"


def format_rate(bytes_per_s: float) -> str:
    """A transfer rate for people, in the unit its size calls for: 850.00 KB/s, 12.40 MB/s, 1.52 GB/s."""
    return format_bytes(bytes_per_s) + "/s"


def format_seconds_apart(a: float, b: float) -> tuple[str, str]:
    """Two durations formatted so that different values never read the same (a target and a time compared with it):
    format_seconds, with more digits where it would round both to one text."""
    fa, fb = format_seconds(a), format_seconds(b)
    if fa != fb or a == b or not (math.isfinite(a) and math.isfinite(b)):
        return fa, fb
    scale = next(((s, u) for s, u in ((1e-6, "us"), (1e-3, "ms"), (1.0, "s")) if max(abs(a), abs(b)) < s * 1000),
                 (1.0, "s"))
    for digits in range(2, 10):
        fa, fb = f"{a / scale[0]:.{digits}f} {scale[1]}", f"{b / scale[0]:.{digits}f} {scale[1]}"
        if fa != fb:
            break
    return fa, fb
