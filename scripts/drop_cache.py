"""Drop a folder's files from the page cache (a cold start for the next load), as the loader drops its own reads;
prints the share of their pages still cached after."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from chunkflow.loading.pagecache import drop, resident_pages

files = sorted({p.resolve() for p in Path(sys.argv[1]).rglob("*") if p.is_file()})
cached = pages = 0
for path in files:
    fd = os.open(path, os.O_RDONLY)
    drop(fd)
    vec = resident_pages(fd, os.fstat(fd).st_size)
    os.close(fd)
    if vec is not None:
        cached, pages = cached + sum(vec), pages + len(vec)
print(f"{len(files)} files dropped from the page cache; {cached / max(pages, 1):.1%} of their pages still cached")
