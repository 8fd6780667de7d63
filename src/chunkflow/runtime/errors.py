"""The runtime's one error type."""

from chunkflow_planner.errors import ChunkflowError


class OffloadError(ChunkflowError):
    """A request chunkflow cannot carry out; the message says what was wrong and what to do."""


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn pointed at the first frame outside the chunkflow package: the user's own call, however many
    of chunkflow's frames (chunkflow.offload, a build helper, the handle) lie between."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
