"""This process's host memory, as the kernel counts it (Linux /proc; 0 where it cannot be read)."""

from __future__ import annotations

from pathlib import Path


def _status_kb(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes() -> int:
    """Resident set size now (VmRSS): host memory this process holds, pinned pages included."""
    return _status_kb("VmRSS")


def peak_rss_bytes() -> int:
    """The largest resident set size so far (VmHWM)."""
    return _status_kb("VmHWM")
