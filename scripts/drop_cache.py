"""Drop a folder's files from the page cache (a cold start for the next load), as the loader drops its own reads;
prints the share of their pages still cached after."""

from __future__ import annotations

import sys
from pathlib import Path

from chunkflow.loading.libraries import cached_share

files = sorted({p.resolve() for p in Path(sys.argv[1]).rglob("*") if p.is_file()})
still = cached_share(files, drop_first=True)
print(f"{len(files)} files dropped from the page cache; "
      + ("whether their pages stayed cannot be told here" if still is None else
         f"{still:.1%} of their pages still cached"))
