"""Writes to an offloaded module's blocks between forwards, and what the next forward must redo for them.

The host store is the truth (runtime/params.py); the device holds copies: each block's resident head, and the
slot of a block prefetched before the write (the first block, prefetched during the previous forward's last).
At the start of each forward the handle asks `collect()`:
- blocks whose tensors were written in place (a version counter moved: `p.copy_`, `load_state_dict`, writes
  through `state_dict()` tensors or through `.data`, as peft's merges do) or whose `.data` was assigned are
  refreshed: their device copies are made again from the host bytes;
- a module, parameter or buffer registered inside a block (LoRA injected or unloaded, `load_state_dict(assign=
  True)`, `block.linear.weight = nn.Parameter(w)`), or a tensor replaced behind torch's back (`swap_tensors`),
  means the blocks are laid out again, new tensors included; the blocks it happened in are `replaced` (a disk
  block among them leaves the disk: its file no longer holds its values).
Writes inside a forward are seen block by block (`stale`, `written`): a write to a block not yet run in this forward
went to its host view, so its device copies are made again as it is entered; a write to the running block's own
tensors went to their device copies, which are written back to the host store as it exits (the store stays the
truth, and the next forward, or remove(), sees the write).
A `.data` assignment of another shape or dtype is refused before anything changes. `WriteWatch` is a handle's part
(runtime/feature.py): it watches each layout's blocks and listens to torch's registrations while the handle lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from chunkflow.runtime.errors import OffloadError
from chunkflow.runtime.feature import HandleFeature
from chunkflow.runtime.layout import BlockLayout
from chunkflow.runtime.params import is_offloaded, raw_data, unwrap, wrap
from chunkflow.runtime.streamer import current

_DETACH = torch._C.TensorBase.detach

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle


class WriteWatch(HandleFeature):
    """Tracks writes to the block tensors of one handle (the WriteTracker its parameters report to)."""

    def __init__(self):
        self.touched: set[int] = set()  # blocks whose parameters' .data was assigned
        self.changed = False  # a registration inside a block: lay out again
        self.replaced: set[int] = set()  # blocks with a tensor or module registered or replaced since the last layout
        self._block_of_module: dict[int, int] = {}  # id(module inside a block) -> block index
        self._by_block: dict[int, list[int]] = {}  # block index -> indices of its entries
        self._objs: dict[int, list] = {}  # block index -> its tensors (the objects watched), in layout order
        self._vers: dict[int, list[int]] = {}  # block index -> their versions as last noted
        self._block_of: dict[int, int] = {}  # id(parameter) -> block index
        self._home_of: dict[int, object] = {}  # id(parameter) -> its host view
        self._name_of: dict[int, str] = {}
        self._classes: list[tuple[nn.Parameter, type]] = []
        self._entries: list[tuple[dict, str, object, int, int]] = []  # (owner dict, attr, object, version, block)
        self._module_ids: set[int] = set()
        self._registrations: list = []
        self.refuse_new: str | None = None  # when set: registrations in `refuse_in` are refused with this message
        self.refuse_in: set[int] = set()  # ids of the modules where they are (all of the offloaded module's)

    # ---- lifetime (the handle's part)

    def attach(self, handle: OffloadHandle) -> None:
        """Watch the new layout's blocks; from the first layout on, listen to registrations."""
        self.watch(handle.layouts, handle.streamer.host_views)
        if not self._registrations:
            self.install()

    def detach(self, handle: OffloadHandle) -> None:
        self.unwatch()

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        self.uninstall()

    def refuse_registrations(self, message: str | None, module: nn.Module) -> None:
        """Refuse (with `message`, formatted with the name) every registration in `module`; None: refuse none."""
        self.refuse_new = message
        self.refuse_in = {id(m) for m in module.modules()} if message is not None else set()

    def install(self) -> None:
        """Listen to torch's module, parameter and buffer registrations (removed by `uninstall`)."""
        self._registrations = [
            torch_module.register_module_module_registration_hook(self._registered),
            torch_module.register_module_parameter_registration_hook(self._registered),
            torch_module.register_module_buffer_registration_hook(self._registered),
        ]

    def uninstall(self) -> None:
        for h in self._registrations:
            h.remove()
        self._registrations = []

    def watch(self, layouts: list[BlockLayout], host_views: list[list]) -> None:
        """Start watching: block parameters become OffloadedParameters; versions and identities are noted while
        every tensor is bound to its host view."""
        self.touched.clear()
        self.changed = False
        self.replaced = set()
        for b, views in zip(layouts, host_views):
            self._module_ids.update(id(m) for m in b.module.modules())
            self._block_of_module.update({id(m): b.index for m in b.module.modules()})
            self._by_block[b.index] = list(range(len(self._entries), len(self._entries) + len(views)))
            # plain detached aliases: they share each tensor's version counter (across the runtime's rebinding) and
            # read it several times faster than the Parameter subclass, whose getters go through __torch_function__
            self._objs[b.index] = [_DETACH(current(t)) for t, _ in views]
            self._vers[b.index] = [o._version for o in self._objs[b.index]]
            for t, view in views:
                obj = current(t)
                owner, attr = t.owners[0]
                if t.is_param:
                    self._classes.append((obj, wrap(obj, self)))
                    self._block_of[id(obj)] = b.index
                    self._home_of[id(obj)] = view
                    self._name_of[id(obj)] = f"{b.name}.{t.name}"
                    self._entries.append((owner._parameters, attr, obj, obj._version, b.index))
                else:
                    self._entries.append((owner._buffers, attr, obj, obj._version, b.index))

    def unwatch(self) -> None:
        """Parameters back to their own classes; nothing watched."""
        for p, cls in self._classes:
            unwrap(p, cls)
        self._classes, self._entries = [], []
        self._block_of, self._home_of, self._name_of = {}, {}, {}
        self._module_ids = set()
        self._block_of_module, self._by_block, self._objs, self._vers = {}, {}, {}, {}
        self.touched.clear()

    # ---- what the parameters report (WriteTracker)

    def touch(self, p: nn.Parameter) -> None:
        block = self._block_of.get(id(p))
        if block is None:
            self.changed = True
        else:
            self.touched.add(block)

    def check_data(self, p: nn.Parameter, value):
        """The host view to copy a new `.data` into, None when it is the same storage; OffloadError for a value
        that would change the parameter's shape or dtype (before anything changes)."""
        import torch

        cur = raw_data(p)
        name = self._name_of.get(id(p), "of an offloaded block")
        if not isinstance(value, torch.Tensor):
            raise OffloadError(f"parameter {name}: .data must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(cur.shape) or value.dtype != cur.dtype:
            raise OffloadError(
                f"parameter {name} is offloaded by chunkflow as {cur.dtype} {list(cur.shape)} and cannot become "
                f"{value.dtype} {list(value.shape)} while offloaded; call handle.remove() first, or change the "
                "module's dtype with module.to(dtype), which chunkflow applies to its host store")
        if value.device == cur.device and value.data_ptr() == cur.data_ptr():
            return None
        return self._home_of.get(id(p))

    def _registered(self, module: nn.Module, name: str, value) -> None:
        if self.refuse_new is not None and id(module) in self.refuse_in:
            raise OffloadError(self.refuse_new.format(name=name))  # torch asks before assigning: nothing changed
        if id(module) in self._module_ids:
            self.changed = True
            self.replaced.add(self._block_of_module[id(module)])

    # ---- at the start of a forward

    def collect(self) -> tuple[bool, set[int]]:
        """(lay out again?, blocks to refresh) since the last call; versions noted afresh."""
        dirty, self.touched = self.touched, set()
        relayout = self.changed
        for i, (owner, attr, obj, version, block) in enumerate(self._entries):
            now = owner.get(attr)
            if now is not obj or (owner is not None and isinstance(obj, nn.Parameter) and not is_offloaded(obj)):
                # replaced without a registration (`m._parameters[name] = x`), or its contents swapped
                # (`torch.utils.swap_tensors`, e.g. a LoRA hot-swap to a larger rank)
                relayout = True
                self.replaced.add(block)
            elif now._version != version:
                dirty.add(block)
                self._entries[i] = (owner, attr, obj, now._version, block)
        for block, objs in self._objs.items():  # the forward's block checks start from here too
            self._vers[block] = [o._version for o in objs]
        return relayout, dirty

    # ---- inside a forward, block by block

    def _moved(self, block: int) -> list[int]:
        """Positions (in the block's tensors) of those written since their versions were last noted: the hot path,
        a version read each (a tensor replaced meanwhile is the next forward's `collect`'s)."""
        vers = self._vers.get(block, ())
        return [j for j, o in enumerate(self._objs.get(block, ())) if o._version != vers[j]]

    def stale(self, block: int) -> list[int]:
        """Positions of a block's tensors written in this forward before it runs (through their host views): their
        device copies must be made again. The writes are noted as carried (here and for the next `collect`)."""
        moved = self._moved(block)
        if moved:
            objs, vers = self._objs[block], self._vers[block]
            for j in moved:
                vers[j] = objs[j]._version
                owner, attr, obj, _, b = self._entries[self._by_block[block][j]]
                self._entries[self._by_block[block][j]] = (owner, attr, obj, obj._version, b)
        return moved

    def written(self, block: int) -> list[int]:
        """Positions of the running block's tensors written during its forward, through their device copies: to be
        written back to the host store. Noted for the rest of this forward only: the next forward's `collect` sees
        them and makes the block's device copies again from the store (or moves a disk block to host memory)."""
        moved = self._moved(block)
        if moved:
            objs, vers = self._objs[block], self._vers[block]
            for j in moved:
                vers[j] = objs[j]._version
        return moved
