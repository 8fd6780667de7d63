"""The host's memory, read without torch or psutil: what `--host-mem-budget` defaults to."""

from __future__ import annotations

import os


def available_host_memory() -> int:
    """Bytes of memory available to a new process on this machine now (Linux: MemAvailable), else physical RAM."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 64 * 10**9
