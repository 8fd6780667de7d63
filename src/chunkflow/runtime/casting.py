"""fp8 storage as a feature: the weights stored in float8 and cast to their compute dtype on the device.

`Fp8Storage` (the handle's part) decides which tensors are stored in fp8 (runtime/storage.py, diffusers' layerwise
casting), keeps the layers outside the blocks in fp8 on the device (`ResidentCasting`) and gives the streamer a
`BlockCasts`. That one owns the cast buffers: before a block runs its fp8 tensors are cast into one cast buffer
(their compute dtype, on the compute stream, after the block's copies are ready) and bound there, as diffusers'
layerwise casting does at each layer's forward. With `on_copy` a streamed block is cast on the copy stream
instead, right after its copies and before `ready[l]`, into a cast buffer that belongs to its slot (two in all,
released with the slot): the cast leaves the compute stream's path. Either cast is one kernel per tensor
(runtime/fp8cast.py: Triton's hardware conversion where it is exact, else PyTorch's copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from chunkflow.runtime.errors import warn_user
from chunkflow.runtime.feature import BlockFeature, HandleFeature
from chunkflow.runtime.fp8cast import cast_into, cast_kernel_name
from chunkflow.runtime.layout import BlockLayout, TensorEntry, align_up
from chunkflow.runtime.params import raw_data
from chunkflow.runtime.storage import (
    Fp8RoundedWeightsWarning,
    ResidentCasting,
    cast_layers,
    cast_tensors,
    check_fits,
)
from chunkflow.runtime.streamer import bind, current, storage_refs
from chunkflow.runtime.tensors import ModuleTensor, TensorSource

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle
    from chunkflow.runtime.streamer import Streamer

FP8_NO_NEW_MODULES = (
    "cannot add, replace or remove {name!r} while chunkflow stores this module's weights in fp8: a LoRA would be "
    "created in fp8 (peft gives adapters the dtype of the layer they wrap), silently losing precision, and other "
    "module surgery is not supported on fp8 storage; nothing was changed. Load and fuse LoRAs (or make such changes) "
    "before offloading, or offload with weight_dtype bf16.")


def _cast_view(buf: torch.Tensor, off: int, t: TensorEntry) -> torch.Tensor:
    return buf[off : off + t.compute_nbytes].view(t.compute_dtype).view(t.shape)


class BlockCasts(BlockFeature):
    """The cast buffers of the streamed and resident blocks' fp8 tensors, and their casts around each block."""

    def __init__(self, layouts: list[BlockLayout], device: torch.device, on_copy: bool):
        self.layouts = layouts
        self.device = device
        self.on_copy = on_copy
        self.buffer_bytes = max((b.cast_extent for b in layouts if not self._on_copy(b)), default=0)
        self.slot_buffer_bytes = max((b.cast_extent for b in layouts if self._on_copy(b)), default=0)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=device)
        self.views: list[list[tuple[TensorEntry, torch.Tensor]]] = []  # per block: cast on the compute stream
        self.casting: int | None = None  # the block whose fp8 tensors occupy the cast buffer now
        self.slot_buffers: list[torch.Tensor] = []  # on_copy: one cast buffer per slot
        self.slot_views: dict[tuple[int, int], list[tuple[TensorEntry, torch.Tensor, torch.Tensor]]] = {}
        self.buffer_refs = 0  # references to the cast buffer's memory its views hold (more: someone kept one)
        self.slot_refs: list[int] = []
        self.slot_of: dict[int, int] = {}

    def _on_copy(self, b: BlockLayout) -> bool:
        return self.on_copy and b.is_streamed

    def device_bytes(self) -> int:
        return self.buffer.numel() + sum(b.numel() for b in self.slot_buffers)

    # ---- buffers (not the hot path)

    def allocate(self, streamer: Streamer) -> None:
        """The cast buffer and each block's views in it; on_copy: a cast buffer per slot and, per (streamed block,
        slot), each fp8 tensor's source (its slot or resident view) and target (in that slot's cast buffer)."""
        self._new_buffer()
        self.slot_buffers = [torch.empty(self.slot_buffer_bytes, dtype=torch.uint8, device=self.device)
                             for _ in range(2 if self.slot_buffer_bytes else 0)]
        self.slot_views = {}
        for s in range(len(self.slot_buffers)):
            self.slot_renewed(streamer, s)
        self.slot_refs = [storage_refs(buf) for buf in self.slot_buffers]
        self.slot_of = {}  # running blocks cast into a slot's cast buffer, and that slot

    def _new_buffer(self) -> None:
        """The compute-stream cast buffer and each block's views in it."""
        self.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        self.views = []
        for b in self.layouts:
            views, off = [], 0
            for t in ([] if self._on_copy(b) else b.cast_tensors()):
                off = align_up(off)
                views.append((t, _cast_view(self.buffer, off, t)))
                off += t.compute_nbytes
            self.views.append(views)
        self.casting = None
        self.buffer_refs = storage_refs(self.buffer)

    def slot_renewed(self, streamer: Streamer, slot: int) -> None:
        """Slot `slot`'s cast sources are views of the streamer's (new) slot."""
        if self.slot_buffers:
            for b in self.layouts:
                if b.is_streamed and b.cast_tensors():
                    self.slot_views[(b.index, slot)] = self._slot_casts(streamer, b, slot, self.slot_buffers[slot])

    @staticmethod
    def _slot_casts(streamer: Streamer, b: BlockLayout, s: int, buf: torch.Tensor) -> list:
        src = {id(t): v for t, v in streamer.slot_views[(b.index, s)] + streamer.resident_views[b.index]}
        views, off = [], 0
        for t in b.cast_tensors():
            off = align_up(off)
            views.append((t, src[id(t)], _cast_view(buf, off, t)))
            off += t.compute_nbytes
        return views

    def release(self, streamer: Streamer) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.views = []
        self.casting = None
        self.slot_buffers = []
        self.slot_views = {}
        self.slot_of = {}

    # ---- around each block (hot path)

    def copies_done(self, streamer: Streamer, block: int, slot: int) -> None:
        casts = self.slot_views.get((block, slot))
        if casts:  # on_copy: fp8 -> compute dtype on the copy stream, before the block is marked ready
            with streamer.backend.on(streamer.backend.copy_stream):
                for _, src, dst in casts:
                    cast_into(dst, src)

    def entered(self, streamer: Streamer, block: int) -> None:
        slot = streamer.bound.get(block)
        casts = self.slot_views.get((block, slot)) if slot is not None else None
        if casts:  # cast on the copy stream already (copies_done), into the cast buffer of the block's slot
            for t, _, dst in casts:
                bind(t, dst)
            self.slot_of[block] = slot
        elif self.views[block]:
            self._cast(block)

    def _cast(self, l: int) -> None:
        """fp8 -> compute dtype on the compute stream (after `ready[l]`, which the streamer waited for); a block
        entered while another one's casts occupy the buffer (nested blocks) gets its own tensors."""
        busy = self.casting is not None
        for t, view in self.views[l]:
            stored = current(t)
            src = raw_data(stored) if t.is_param else stored
            dst = torch.empty(t.shape, dtype=t.compute_dtype, device=self.device) if busy else view
            cast_into(dst, src)
            bind(t, dst)
        if not busy:
            self.casting = l

    def exited(self, streamer: Streamer, block: int) -> None:
        """The block's cast buffer is free again; one something still refers to (a weight taken inside the forward
        without a copy) is left to it with the block's values, and a new one made (as the streamer does for slots)."""
        if self.casting == block:
            self.casting = None
            if storage_refs(self.buffer) > self.buffer_refs:
                self._new_buffer()
        s = self.slot_of.pop(block, None)
        if s is not None and storage_refs(self.slot_buffers[s]) > self.slot_refs[s]:
            self.slot_buffers[s] = torch.empty(self.slot_buffer_bytes, dtype=torch.uint8, device=self.device)
            self.slot_renewed(streamer, s)
            self.slot_refs[s] = storage_refs(self.slot_buffers[s])


class Fp8Storage(HandleFeature):
    """The handle's fp8 part: which tensors are stored in `dtype`, the layers outside the blocks kept so on the
    device while a layout lives, the streamer's `BlockCasts`, and what `stats()` and `compute_dtype()` say of it."""

    def __init__(self, dtype: torch.dtype, on_copy: bool):
        self.dtype = dtype
        self.on_copy = on_copy
        self.block_dtypes: dict[int, torch.dtype] = {}  # id(block tensor) -> storage dtype, for the next layout
        self.outside: list[nn.Module] = []  # the layers outside the blocks stored in fp8
        self.resident: ResidentCasting | None = None  # their fp8 storage while attached
        self.casts: BlockCasts | None = None  # the streamer's cast buffers while attached

    def plan(self, module: nn.Module, blocks: list[tuple[str, nn.Module]]) -> dict[int, torch.dtype]:
        """Which tensors the next layout stores in fp8: returns the block tensors' (for `block_layouts`)."""
        self.block_dtypes = cast_tensors(module, blocks, self.dtype)
        inside = {id(m) for _, b in blocks for m in b.modules()}
        self.outside = [m for m in cast_layers(module) if id(m) not in inside]
        return self.block_dtypes

    def check_values(self, tensors: list[ModuleTensor], source: TensorSource | None) -> None:
        """Refuse weights fp8 cannot hold, before anything is written (a loader's values are checked in `fill`)."""
        every = {**self.block_dtypes, **{id(t): self.dtype for m in self.outside for _, t in ResidentCasting.tensors(m)}}
        for t in tensors:
            cur = t.get()
            if id(cur) in every and cur.device.type != "meta" and (source is None or not source.provides(t.name)):
                check_fits(t.name, cur, every[id(cur)])

    @property
    def stores_any(self) -> bool:
        """Whether any tensor of the module is stored in fp8."""
        return bool(self.block_dtypes) or bool(self.outside)

    def block_casts(self, layouts: list[BlockLayout], device: torch.device) -> list[BlockCasts]:
        """The streamer's block features: the cast buffers where some block holds fp8 tensors (the cast kernel is
        picked, and compiled, now rather than in the first forward)."""
        if not self.block_dtypes:
            return []
        if device.type == "cuda":
            cast_kernel_name(device)
        self.casts = BlockCasts(layouts, device, self.on_copy)
        return [self.casts]

    def store_outside(self) -> None:
        """The layers outside the blocks stored in fp8 on the device (called when the handle has placed them, before
        the streamer's buffers are made; `detach` undoes it). Their values were checked (first layout) or come from
        fp8 (a re-layout)."""
        if self.outside:
            self.resident = ResidentCasting(self.outside, self.dtype)

    def detach(self, handle: OffloadHandle) -> None:
        """The layers outside the blocks get their own dtype back (before the layout goes)."""
        if self.resident is not None:
            self.resident.undo()
            self.resident = None
        self.casts = None

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        if restore and (any(b.cast_tensors() for b in handle.layouts) or self.resident is not None):
            warn_user("chunkflow: the weights were stored in fp8 while offloaded; remove() gives them back in "
                      "their own dtype with the fp8-rounded values (the originals were not kept). Load the "
                      "checkpoint again for the exact weights.", Fp8RoundedWeightsWarning)

    # ---- reporting

    def resident_compute(self) -> dict[int, torch.dtype]:
        """id(tensor) -> its own dtype, for the tensors outside the blocks stored in fp8 now."""
        return self.resident.compute if self.resident is not None else {}

    def compute_dtype(self, layouts: list[BlockLayout]) -> torch.dtype | None:
        """The dtype fp8-stored weights are cast to for the forward (None where none is stored in fp8)."""
        for b in layouts:
            for t in b.cast_tensors():
                return t.compute_dtype
        if self.resident is not None and self.resident.own:
            return next(iter(self.resident.own.values()))
        return None

    def tensor_count(self, layouts: list[BlockLayout]) -> int:
        return sum(len(b.cast_tensors()) for b in layouts) + (len(self.resident.own) if self.resident is not None else 0)

    def buffer_bytes(self) -> int:
        return self.casts.device_bytes() if self.casts is not None else 0
