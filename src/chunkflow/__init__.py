"""chunkflow: stream a diffusion transformer's blocks from pinned host memory in chunks, one block ahead.

`chunkflow.offload(module, ...)` is the one-call API. The names below load the runtime (and torch) on
first use, so that `chunkflow plan` and the rest of the CLI that needs no torch stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["offload", "OffloadHandle", "OffloadError", "OffloadStats"]

if TYPE_CHECKING:  # pragma: no cover
    from chunkflow.runtime.handle import OffloadError, OffloadHandle, OffloadStats, offload


def __getattr__(name: str) -> Any:
    if name in __all__:
        from chunkflow.runtime import handle

        return getattr(handle, name)
    raise AttributeError(f"module 'chunkflow' has no attribute {name!r}")
