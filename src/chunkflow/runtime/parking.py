"""Parking as a feature: an offloaded module gives its device memory back between uses (`handle.park()`) and takes
it back at its next forward; `take_turns` parks the others before one of several modules runs (e.g. the two experts
of Wan2.2-A14B).

While parked the streamer's resident buffer and slots are given back and the non-block tensors sit in their park
home (runtime/tiers/): by default host memory, one allocation (pinned on CUDA) kept for the next park, where a tensor
not written since the last unpark is not copied again; with `offload(park_to="disk")` the checkpoint's files, read
back to the device at the next forward. The block tensors stay where their tiers keep them, as between any two
forwards.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
from torch import nn

from chunkflow.runtime.feature import HandleFeature
from chunkflow.runtime.hooks import handle_of
from chunkflow.runtime.tiers import HostParking, ParkHome

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
    """The park state of one handle: the forward pre-hook that unparks, and the home of the non-block tensors while
    parked (runtime/tiers/: a pinned host copy, `HostParking`, by default; the checkpoint's files, `DiskParking`)."""

    def __init__(self, home: ParkHome | None = None):
        self.resume: torch.utils.hooks.RemovableHandle | None = None  # while parked: the forward pre-hook
        self.home = home if home is not None else HostParking()

    @property
    def parked(self) -> bool:
        return self.resume is not None

    def starts_parked(self, tensors) -> frozenset[str]:
        """At offload: names of the non-block tensors the home holds already (not read: offload() parks)."""
        return frozenset(self.home.starts_parked(tensors))

    def attach(self, handle: OffloadHandle) -> None:
        self.home.attach(handle)

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        """restore: unparked first (the non-block tensors leave their park home); else the hooks only go."""
        if restore:
            self.unpark(handle)
        else:
            self._unhook(handle.module)
        self.release_store()
        self.home.close(handle, restore)

    def release_store(self) -> None:
        """Free what the park home keeps between parks (the next park makes it again)."""
        self.home.release_store()

    def stats(self) -> dict:
        return self.home.stats()

    def park(self, handle: OffloadHandle) -> None:
        """Device buffers given back, the non-block tensors in their home, the unpark hook on (see the module)."""
        if handle.streamer is not None:
            handle.streamer.release_device()
        self.home.park(handle.non_block, handle.device)
        if handle.device.type == "cuda":
            torch.cuda.synchronize(handle.device)
        self.resume = handle.module.register_forward_pre_hook(_unpark_before_forward)
        if "_hf_hook" not in handle.module.__dict__:  # tell diffusers where this module's inputs go while parked
            handle.module.__dict__["_hf_hook"] = ExecutionDevice(handle.device)

    def unpark(self, handle: OffloadHandle) -> None:
        """Everything back on the device (nothing to do when not parked)."""
        if self.resume is None:
            return
        self._unhook(handle.module)
        self.home.unpark(handle.non_block, handle.device)
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
