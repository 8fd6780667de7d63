"""The runtime's one error type."""

from chunkflow_planner.errors import ChunkflowError


class OffloadError(ChunkflowError):
    """A request chunkflow cannot carry out; the message says what was wrong and what to do."""
