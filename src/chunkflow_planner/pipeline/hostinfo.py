"""The host's memory, read without torch or psutil: what `--host-mem-budget` defaults to.

A plan is for the machine, not for the moment: its default host budget is the memory this machine (or the
container's cgroup, where it has a limit) has in all, less a share kept for the system and other programs
(SYSTEM_SHARE). What happens to be free when `chunkflow plan` runs would make the same command pass or fail with
whatever else runs.
"""

from __future__ import annotations

import os

SYSTEM_SHARE = 0.10  # of the machine's memory, kept for the system, the desktop and other programs
UNCHECKED_HOST_BUDGET = 2**62  # the host budget the policy is given where none is known: nothing binds


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 memory.max, or v1 limit_in_bytes), None where it has none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 says "no limit" with a huge number, v2 with "max"
            return int(text)
    return None


def machine_memory() -> tuple[int, str]:
    """(bytes, where they come from): the container's memory limit where it has one below the machine's memory,
    else the machine's memory (Linux: MemTotal; elsewhere: physical pages)."""
    total = _meminfo("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            total = 64 * 10**9
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        return limit, "this container's memory limit"
    return total, "this machine's memory"


def default_host_budget() -> tuple[int, str]:
    """(bytes, how they were chosen) of the host budget a plan gets without --host-mem-budget."""
    from chunkflow_planner.units import format_bytes

    total, where = machine_memory()
    budget = int(total * (1 - SYSTEM_SHARE))
    return budget, f"{where} ({format_bytes(total)}) less {SYSTEM_SHARE:.0%} for the system and other programs"


def available_host_memory() -> int:
    """The default host budget in bytes (default_host_budget)."""
    return default_host_budget()[0]
