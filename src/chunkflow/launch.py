"""Is this process one rank of a torchrun job? Read from torchrun's environment (no torch import)."""

from __future__ import annotations

import os


def torchrun_world() -> int:
    """WORLD_SIZE of the torchrun job this process belongs to; 1 outside torchrun."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def torchrun_rank() -> int:
    """This process's RANK in its torchrun job; 0 outside torchrun."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
