"""Where the runtime meets the model: per-block and root hooks that stay outside any compiled region.

A hooked block's class is swapped for a subclass of the same name whose `__call__` binds the block's tensors to
device memory before the block runs (wait for its copies, prefetch the next block) and back to the host store
after it (release its slot), in functions dynamo does not trace (`torch.compiler.disable`). The block's own
`_call_impl`, with whatever `module.compile()` or diffusers' `compile_repeated_blocks()` compiled into it, runs in
between untouched: a compiled region never sees a copy, an event or a rebinding, so `fullgraph=True` works, and
its guards see parameters of the same shape, dtype and device on every block and every call (one graph for all
blocks of a class). The model code never learns it is offloaded.

The first block's enter also lets the handle bring device copies up to date with writes made since the last
forward (`handle.sync()`, runtime/writes.py). The root module's class is swapped too, for its `_apply` (`.to()`,
`.half()`, `.cuda()`), which goes through the handle: a dtype change is applied to the host store, a device
change refused before anything moves. Swapped classes refuse deepcopy and pickling with a clear error.

Swapped classes are made once per original class (`functools.cache`: the same class object for every block of a
kind, which dynamo's guards need); `remove()` puts the original class back.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

_HOOK = "_chunkflow_hook"


def _copy_refused(self, *args):
    from chunkflow.runtime.errors import OffloadError

    raise OffloadError(f"this {type(self).__name__} is offloaded by chunkflow and cannot be copied or pickled; call "
                       "handle.remove() first (or copy it before offloading)")


@torch.compiler.disable
def _enter(hook) -> None:
    hook.enter()


@torch.compiler.disable
def _exit(hook) -> None:
    hook.exit()


def _block_call(self, *args, **kwargs):
    base = type(self)._chunkflow_base
    hook = self.__dict__.get(_HOOK)
    if hook is None:
        return base.__call__(self, *args, **kwargs)
    _enter(hook)
    try:
        return base.__call__(self, *args, **kwargs)
    finally:  # a block that raises still gives its slot back, so the next forward works
        _exit(hook)


@functools.cache
def hooked_block_class(cls: type) -> type:
    """`cls` with the offloading `__call__` (same name, so class-name lookups such as diffusers' repeated blocks
    still find it)."""
    return type(cls.__name__, (cls,), {"__call__": _block_call, "_chunkflow_base": cls, "__module__": cls.__module__,
                                       "__deepcopy__": _copy_refused, "__reduce_ex__": _copy_refused})


def _root_apply(self, fn, recurse: bool = True):
    handle = self.__dict__.get(_HOOK)
    if handle is None:
        return type(self)._chunkflow_base._apply(self, fn, recurse)
    return handle.apply(fn, recurse)


def _root_dtype(self):
    """A diffusers model's `dtype`: the compute dtype while its weights are stored in fp8 (as diffusers reports it
    under layerwise casting), else the model's own answer."""
    handle = self.__dict__.get(_HOOK)
    dt = handle.compute_dtype() if handle is not None else None
    return dt if dt is not None else type(self)._chunkflow_base.dtype.__get__(self)


@functools.cache
def hooked_root_class(cls: type) -> type:
    """`cls` whose `_apply` goes through the handle (and whose `dtype`, for a diffusers model, says the compute
    dtype under fp8 storage)."""
    attrs = {"_apply": _root_apply, "_chunkflow_base": cls, "__module__": cls.__module__,
             "__deepcopy__": _copy_refused, "__reduce_ex__": _copy_refused}
    if isinstance(getattr(cls, "dtype", None), property):
        attrs["dtype"] = property(_root_dtype)
    return type(cls.__name__, (cls,), attrs)


def hook_module(module: nn.Module, hook, root: bool = False) -> None:
    """Swap in the hooked class and attach `hook` (a BlockHook, or the handle for the root)."""
    module.__class__ = (hooked_root_class if root else hooked_block_class)(type(module))
    module.__dict__[_HOOK] = hook


def unhook_module(module: nn.Module) -> None:
    module.__dict__.pop(_HOOK, None)
    base = getattr(type(module), "_chunkflow_base", None)
    if base is not None:
        module.__class__ = base


class BlockHook:
    """Block l's enter and exit, through its handle (which may lay the blocks out again between forwards)."""

    def __init__(self, handle, index: int, module: nn.Module):
        self.handle = handle
        self.index = index
        self.module = module
        hook_module(module, self)

    def enter(self) -> None:
        self.handle.enter_block(self.index)

    def exit(self) -> None:
        self.handle.exit_block(self.index)

    def remove(self) -> None:
        unhook_module(self.module)
