"""How fast host memory takes a fill, by where it lives: `python scripts/shm_fill_probe.py OUT.json [GiB]` writes
GiB of bytes in 64 MiB pieces into an anonymous allocation (torch.empty), a memfd segment mapped shared (as
runtime/hostshare.py makes one), and a memfd segment allocated first with posix_fallocate; each twice, seconds and
GB/s (the shared tier's fill cost, issue 40)."""

from __future__ import annotations

import json
import mmap
import os
import sys
import time

import torch


def main() -> None:
    n = int(float(sys.argv[2] if len(sys.argv) > 2 else 8) * (1 << 30))
    src = torch.ones(64 << 20, dtype=torch.uint8)

    def fill(dst) -> float:
        t = time.perf_counter()
        for i in range(0, n, src.numel()):
            dst[i:i + src.numel()].copy_(src[: min(src.numel(), n - i)])
        return time.perf_counter() - t

    out = {"bytes": n, "rows": []}
    for rep in range(2):
        a = torch.empty(n, dtype=torch.uint8)
        out["rows"].append({"way": "anonymous", "fill_s": fill(a)})
        del a
        for fall in (False, True):
            fd = os.memfd_create("probe")
            os.ftruncate(fd, n)
            t = time.perf_counter()
            if fall:
                os.posix_fallocate(fd, 0, n)
            alloc = time.perf_counter() - t
            mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
            t = torch.frombuffer(mm, dtype=torch.uint8)
            out["rows"].append({"way": "memfd+fallocate" if fall else "memfd", "alloc_s": alloc, "fill_s": fill(t)})
            del t
            mm.close()
            os.close(fd)
    for r in out["rows"]:
        r["gbps"] = n / (r["fill_s"] + r.get("alloc_s", 0.0)) / 1e9
    print(json.dumps(out, indent=1))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
