"""Per-block forward hooks: the model code never learns it is offloaded.

Before block l runs: wait for its copies, bind its tensors to its slot, prefetch the next block into the other
slot. After it ran: release its slot to the copy stream and rebind its streamed tensors to placeholders.
"""

from __future__ import annotations

from torch import nn

from chunkflow.runtime.streamer import Streamer


class BlockHook:
    def __init__(self, streamer: Streamer, index: int, module: nn.Module):
        self.streamer = streamer
        self.index = index
        self._handles = [
            module.register_forward_pre_hook(self.pre_forward),
            # always_call: a block that raises still gives its slot back, so the next forward works
            module.register_forward_hook(self.post_forward, always_call=True),
        ]

    def pre_forward(self, module, args):
        self.streamer.before(self.index)

    def post_forward(self, module, args, output):
        if self.index in self.streamer.bound:
            self.streamer.after(self.index)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
