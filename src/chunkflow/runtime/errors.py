"""The runtime's one error type."""


class OffloadError(ValueError):
    """A request chunkflow cannot carry out; the message says what was wrong and what to do."""
