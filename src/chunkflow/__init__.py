"""chunkflow: stream a diffusion transformer's blocks from pinned host memory in chunks, one block ahead."""

from chunkflow.runtime.handle import OffloadError, OffloadHandle, OffloadStats, offload

__all__ = ["offload", "OffloadHandle", "OffloadError", "OffloadStats"]
