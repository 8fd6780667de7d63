"""`chunkflow.offload`: the runtime's offload() with the module's blocks found from the catalog, or in the module
for a class the catalog does not know (models/adapters.py, models/discover.py), when the caller does not list them,
so that the runtime itself only ever receives a block list."""

from __future__ import annotations

from typing import Any

__all__ = ["offload"]


def offload(module, config=None, *, blocks=None, **keywords: Any):
    """Stream `module`'s blocks from pinned host memory (chunkflow.runtime.handle.offload, whose keywords it takes);
    `blocks` default: the block lists models.yaml names for the module's class, else those found in the module
    (models/discover.py); their order is checked on the first forward (runtime/order.py)."""
    from chunkflow.models.adapters import find_blocks
    from chunkflow.runtime.errors import OffloadError
    from chunkflow.runtime.handle import offload as stream
    from chunkflow.runtime.resolve import BlocksUnknown, unwrap_module

    why = None
    if blocks is None:
        try:
            blocks = find_blocks(unwrap_module(module))
        except LookupError as exc:  # needed only to stream or to check a plan: the runtime says when
            why = str(exc)
        except OffloadError:  # not a module: the runtime's own message
            pass
    try:
        return stream(module, config, blocks=blocks, **keywords)
    except BlocksUnknown:
        if why is None:
            raise
        raise OffloadError(why) from None
