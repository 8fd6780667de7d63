"""The evidence script's CPU dry run (TINY=1): the three held-out pipelines as the tests build them, tiny (the same
classes; a few channels), saved as diffusers folders with save_pretrained.

    python3 docs/data/gpu-firstgen/tiny.py NAME FOLDER      (NAME: ltx-video, cogvideox-5b or pixart-sigma)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from test_pipelines_53 import _pixart  # noqa: E402
from test_run_any import _cogvideox, _ltx  # noqa: E402

BUILDERS = {"ltx-video": _ltx, "cogvideox-5b": _cogvideox, "pixart-sigma": _pixart}

if __name__ == "__main__":
    name, folder = sys.argv[1], Path(sys.argv[2])
    folder.parent.mkdir(parents=True, exist_ok=True)
    BUILDERS[name](folder)
    print(f"{name}: saved (tiny) to {folder}")
