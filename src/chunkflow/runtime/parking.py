"""Parking as a feature: an offloaded module gives its device memory back between uses (`handle.park()`) and takes
it back at its next forward; `take_turns` parks the others before one of several modules runs (e.g. the two experts
of Wan2.2-A14B).

While parked the streamer's resident buffer and slots are given back and the non-block tensors sit in host memory:
one allocation (pinned on CUDA), kept for the next park, where a tensor not written since the last unpark is not
copied again. The block tensors stay in the host store, as between any two forwards.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from torch import nn

from chunkflow.runtime.feature import HandleFeature
from chunkflow.runtime.hooks import handle_of
from chunkflow.runtime.store import HostStore

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle


class ExecutionDevice:
    """Where a parked module's inputs must go, said the way diffusers asks (`get_module_execution_device` and a
    pipeline's `_execution_device` read `module._hf_hook.execution_device`, the attribute accelerate's offloading
    hooks carry): its weights sit in host memory until its forward takes them back. A plain marker: `detach_hook`
    lets accelerate's `remove_hook_from_module` take it off."""

    def __init__(self, device: torch.device):
        self.execution_device = device

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module


@torch.compiler.disable
def _unpark_before_forward(module: nn.Module, args) -> None:
    handle_of(module).unpark()


class Parking(HandleFeature):
    """The park state of one handle: the forward pre-hook that unparks, the host homes of the non-block tensors
    while parked, and what they held at the last unpark."""

    def __init__(self):
        self.resume: torch.utils.hooks.RemovableHandle | None = None  # while parked: the forward pre-hook
        self.store: HostStore | None = None  # host homes of the non-block tensors while parked
        self.store_device: torch.device | None = None  # the device the store's tensors were copied to and from
        self.versions: list[tuple[int, int]] | None = None  # (version, data_ptr) of each at the last unpark

    @property
    def parked(self) -> bool:
        return self.resume is not None

    def attach(self, handle: OffloadHandle) -> None:
        self.versions = None  # new non-block tensors: each is copied at the next park

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        """restore: unparked first (the non-block tensors leave the park store); else the hooks only go."""
        if restore:
            self.unpark(handle)
        else:
            self._unhook(handle.module)
        self.release_store()

    def release_store(self) -> None:
        """Free the park store (the next park makes another), once any copy out of it has finished."""
        if self.store is not None:
            if self.store_device is not None and self.store_device.type == "cuda":
                torch.cuda.synchronize(self.store_device)
            self.store.release()
            self.store = None

    def park(self, handle: OffloadHandle) -> None:
        """Device buffers given back, the non-block tensors in host memory, the unpark hook on (see the module)."""
        if handle.streamer is not None:
            handle.streamer.release_device()
        self._move_to_host(handle.non_block, handle.device)
        if handle.device.type == "cuda":
            torch.cuda.synchronize(handle.device)
        self.resume = handle.module.register_forward_pre_hook(_unpark_before_forward)
        if "_hf_hook" not in handle.module.__dict__:  # tell diffusers where this module's inputs go while parked
            handle.module.__dict__["_hf_hook"] = ExecutionDevice(handle.device)

    def _move_to_host(self, tensors, device: torch.device) -> None:
        views = self._views(tensors, device)
        with torch.no_grad(), torch.inference_mode(False):
            for t, host, version in zip(tensors, views, self.versions or [None] * len(views)):
                cur = t.get()
                if version is None or (cur._version, cur.data_ptr()) != version or cur.device == host.device:
                    host.copy_(cur.detach())
                if t.is_param:
                    cur.data = host
                else:
                    t.set_buffer(host)

    def _views(self, tensors, device: torch.device) -> list[torch.Tensor]:
        """Host homes of the non-block tensors while parked: views of one host allocation (pinned on CUDA)."""
        sizes = [t.get().numel() * t.get().element_size() for t in tensors]
        offsets, total = [], 0
        for n in sizes:
            total = -(-total // 256) * 256
            offsets.append(total)
            total += n
        if self.store is None or self.store.nbytes != total:
            if self.store is not None:
                self.store.release()
            self.store = HostStore(total, pin=device.type == "cuda")
            self.store_device = device
            self.versions = None
        out = []
        for t, off, n in zip(tensors, offsets, sizes):
            cur = t.get()
            out.append(self.store.alias(off, n).view(cur.dtype).view(cur.shape))
        return out

    def unpark(self, handle: OffloadHandle) -> None:
        """Everything back on the device (nothing to do when not parked)."""
        if self.resume is None:
            return
        self._unhook(handle.module)
        versions = []
        with torch.no_grad(), torch.inference_mode(False):
            for t in handle.non_block:
                cur = t.get()
                dev = cur.detach().to(handle.device, non_blocking=handle.device.type == "cuda", copy=True)
                if t.is_param:
                    cur.data = dev
                else:
                    t.set_buffer(dev)
                versions.append((t.get()._version, t.get().data_ptr()))
        self.versions = versions
        if handle.streamer is not None:
            with torch.inference_mode(False):  # a forward under inference_mode may unpark: normal tensors still
                handle.streamer.acquire_device()

    def _unhook(self, module: nn.Module) -> None:
        if self.resume is not None:
            self.resume.remove()
            self.resume = None
        if isinstance(module.__dict__.get("_hf_hook"), ExecutionDevice):
            del module.__dict__["_hf_hook"]


def take_turns(*handles: OffloadHandle) -> TurnTaking:
    """Let offloaded modules take turns on the device: before one runs a forward, the others are parked, so the
    device holds one of them at a time (its resident bytes, slots and non-block tensors) while host memory holds
    all. For models used one after the other, such as Wan2.2-A14B's two experts. They share one lock: a forward
    of one (parking the others first) waits for a forward of any of them in another thread. `.remove()` ends it."""
    shared = threading.RLock()
    for h in handles:
        h.lock = shared
    return TurnTaking(list(handles))


class TurnTaking:
    """The forward pre-hooks of `take_turns`."""

    def __init__(self, handles: list[OffloadHandle]):
        self.handles = handles
        self.hooks = [h.module.register_forward_pre_hook(self._before(h), prepend=True) for h in handles]

    def _before(self, mine: OffloadHandle):
        @torch.compiler.disable
        def park_others(module, args) -> None:
            for h in self.handles:
                if h is not mine:
                    h.park()

        return park_others

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for h in self.handles:  # each its own lock again
            h.lock = threading.RLock()
