"""chunkflow: stream a diffusion transformer's blocks from pinned host memory in chunks, one block ahead.

`chunkflow.offload(module, ...)` is the one-call API; `chunkflow.load(plan, weights=DIR)` loads a plan's whole
pipeline once and generates from it as often as wanted (chunkflow.session); `chunkflow.batch_cfg(pipe)` runs a
pipeline's two guidance passes as one forward; `OffloadConfig` is the offload setting it takes (also what a plan
file holds). Every error the package raises for bad input is a `ChunkflowError` (a ValueError). The runtime names load torch on first use, so that `chunkflow plan` and the rest of the CLI
that needs no torch stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chunkflow_planner import __version__
from chunkflow_planner.errors import ChunkflowError

__all__ = ["offload", "load", "Session", "take_turns", "batch_cfg", "OffloadConfig", "ChunkflowError", "OffloadHandle", "OffloadError",
           "OffloadStats", "__version__"]
_RUNTIME = ("take_turns", "OffloadHandle", "OffloadError", "OffloadStats")

if TYPE_CHECKING:  # pragma: no cover
    from chunkflow.cfg import batch_cfg
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow.api import offload
    from chunkflow.session import Session, load
    from chunkflow.runtime.handle import OffloadError, OffloadHandle, OffloadStats, take_turns


def __getattr__(name: str) -> Any:
    if name == "offload":
        from chunkflow.api import offload

        return offload
    if name in ("load", "Session"):
        from chunkflow import session

        return getattr(session, name)
    if name in _RUNTIME:
        from chunkflow.runtime import handle

        return getattr(handle, name)
    if name == "batch_cfg":
        from chunkflow.cfg import batch_cfg

        return batch_cfg
    if name == "OffloadConfig":  # imported on first use too (pydantic): the command line starts with little
        from chunkflow_planner.offload import OffloadConfig

        return OffloadConfig
    raise AttributeError(f"module 'chunkflow' has no attribute {name!r}")
