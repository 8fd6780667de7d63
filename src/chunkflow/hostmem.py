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


def shared_segments() -> tuple[int, dict[int, int]]:
    """This process's maps of the host segments the local ranks share (runtime/hostshare.py: memfds named
    chunkflow-...): the bytes of them its resident set counts (shared pages, each map's own; not copy-on-write pages
    it wrote, which are its own), and each segment's size by inode (the same inode in every process of the host)."""
    counted, sizes = 0, {}
    inode, fields = None, {}

    def close() -> None:
        nonlocal counted
        if inode is not None:
            counted += fields.get("Rss", 0) - fields.get("Anonymous", 0)
            sizes[inode] = max(sizes.get(inode, 0), fields.get("Size", 0))

    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":") and "-" in head:  # a map's first line: range perms offset dev inode path
                    close()
                    parts = line.split()
                    inode = int(parts[4]) if len(parts) > 5 and "memfd:chunkflow" in parts[5] else None
                    fields = {}
                elif inode is not None and head in ("Size:", "Rss:", "Anonymous:"):
                    fields[head[:-1]] = int(line.split()[1]) * 1024
        close()
    except (OSError, ValueError, IndexError):
        return 0, {}
    return counted, sizes


def own_peak_bytes() -> tuple[int, dict[int, int]]:
    """(peak resident memory less the shared segments' pages it counts, the segments by inode): summed over the
    local ranks, plus each segment once, what the host holds for them."""
    counted, sizes = shared_segments()
    return max(0, peak_rss_bytes() - counted), sizes
