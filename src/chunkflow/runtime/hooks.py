"""Where the runtime meets the model: per-block and root hooks that stay outside any compiled region.

A hooked block's class is swapped for a subclass of the same name whose `__call__` binds the block's tensors to
device memory before the block runs (wait for its copies, prefetch the next block) and back to the host store
after it (release its slot), in functions dynamo does not trace (`torch.compiler.disable`). The block's own
`_call_impl`, with whatever `module.compile()` or diffusers' `compile_repeated_blocks()` compiled into it, runs in
between untouched: a compiled region never sees a copy, an event or a rebinding, so `fullgraph=True` works, and
its guards see parameters of the same shape, dtype and device on every block and every call (one graph for all
blocks of a class). The model code never learns it is offloaded.

The swapped class's `forward` notes that the block's own forward ran before running it (in a frame dynamo leaves
out): a cache that skips a block (diffusers' `enable_cache`) replaces the forward the block's call runs, so the
block is entered and left as usual and its run counts as skipped (runtime/runs.py). A wrapper made around a block's
forward before offload (diffusers' hook registry, an instance `forward`) holds the plain bound forward: it is
pointed at the noting one while offloaded and back at remove().

The root's call tells the handle when a forward begins and when it completed (the first one's block order is
checked then, runtime/order.py). The first block's enter also lets the handle bring device copies up to date with
writes made since the last forward (`handle.sync()`, runtime/writes.py). The root module's class is swapped too, for
its `_apply` (`.to()`, `.half()`, `.cuda()`), which goes through the handle: a dtype change is applied to the host
store, a device change refused before anything moves. Swapped classes refuse deepcopy and pickling with a clear error.

Swapped classes are made once per original class (`functools.cache`: the same class object for every block of a
kind, which dynamo's guards need); `remove()` puts the original class back. Code compiled while the module was
offloaded may still call a swapped class's functions after that: each runs as the plain class then (`_plain`), and
dynamo, whose guards see the hook gone, compiles the plain model on that call. A swapped class compares equal to, and
hashes as, the class it stands for (its metaclass says so; `is` still tells them apart): code that looks a module's
class up in a registry or a list of types finds the original's entry, as it would without offload (diffusers'
block registry behind enable_cache and apply_layer_skip, `from_pipe`'s check of its components' types).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types

import torch
from torch import nn

from chunkflow.runtime.skipping import binds_lazily

_HOOK = "_chunkflow_hook"
_PART = "_chunkflow_part"  # on every module inside an offloaded one: the handle its own `.to()` goes through
HANDLE_KEY = "_chunkflow_handle"  # on an offloaded module (every mode): its handle


def handle_of(module: nn.Module):
    """The handle of an offloaded module, None for a module chunkflow does not hold."""
    return module.__dict__.get(HANDLE_KEY)


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


@torch.compiler.disable
def _stream_in(hook) -> None:
    hook.stream_in()


def _run_block(self, base, hook, args, kwargs):
    """The block's own call between its enter (tensors bound to the device) and exit (back to the host)."""
    try:
        _enter(hook)
    except BaseException:  # the next block's prefetch failed (a disk read): the slot is given back all the same
        _exit(hook)
        raise
    try:
        if _in_backward() and torch.is_grad_enabled():  # recomputed for backward: what autograd saves of its weights
            _own_copies(hook)  # must outlive the slot they are bound to (the next block's copies refill it)
        return base.__call__(self, *args, **kwargs)
    finally:  # a block that raises still gives its slot back, so the next forward works
        _exit(hook)


@torch.compiler.disable
def _own_copies(hook) -> None:
    hook.own_copies()


def _in_backward() -> bool:
    """Whether this call runs inside a backward pass (a checkpointed block recomputed for its gradients)."""
    return torch._C._current_graph_task_id() != -1


def _records_grad(module: nn.Module, args, kwargs) -> bool:
    """Whether autograd records this block's forward: grad mode on and an input or a parameter requiring grad."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in (*args, *kwargs.values()))


def _inside_checkpoint() -> bool:
    """Whether the call runs inside torch's non-reentrant activation checkpointing (diffusers' gradient
    checkpointing): its saved tensors are dropped and the block recomputed for backward, as chunkflow would."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    pack = hooks[0] if hooks else None
    return pack is not None and "_checkpoint_hook" in getattr(pack, "__qualname__", "")


def _plain(self) -> type:
    """The class whose methods `self` runs as chunkflow never touched it: the one its swapped class stands for, or,
    once `remove()` has put its own class back, that class. A caller that kept a swapped class's function (code
    torch.compile made while the module was offloaded holds the bound `__call__` it traced) reaches here with the
    module's own class: it runs as the plain module does, and dynamo, whose guards see the hook gone, compiles that."""
    cls = type(self)
    return getattr(cls, "_chunkflow_base", cls)


def _block_call(self, *args, **kwargs):
    base = _plain(self)
    hook = self.__dict__.get(_HOOK)
    if hook is None:
        return base.__call__(self, *args, **kwargs)
    with hook.handle.lock:  # one forward at a time through an offloaded module (two threads would share its slots)
        if _records_grad(self, args, kwargs) and not _in_backward() and not _inside_checkpoint():
            # training: autograd would keep views of weights in the streaming slots, which later blocks overwrite.
            # The block is checkpointed instead (nothing of it saved; recomputed, weights brought back, for backward)
            from torch.utils.checkpoint import checkpoint

            return checkpoint(lambda *a, **k: _rerun_block(self, base, a, k), *args, use_reentrant=False, **kwargs)
        return _run_block(self, base, hook, args, kwargs)


def _rerun_block(self, base, args, kwargs):
    """A checkpointed block's run, forward or recomputed for backward, through the hook it has at that time: the
    blocks may have been laid out again in between (the first forward's order, runtime/order.py), and a hook's index
    is its block's place in the layout it was made for."""
    hook = self.__dict__.get(_HOOK)
    if hook is None:  # removed since: the block holds its own weights again
        return base.__call__(self, *args, **kwargs)
    return _run_block(self, base, hook, args, kwargs)


@functools.cache
def _standing_for(meta: type) -> type:
    """A metaclass (derived from `meta`, the original class's) under which a swapped class equals and hashes as the
    class it stands for (`_chunkflow_base`)."""

    def __eq__(cls, other):
        base = cls.__dict__.get("_chunkflow_base")  # a subclass of a swapped class is a class of its own
        if base is None:
            return other is cls
        return other is cls or other is base or (isinstance(other, type)
                                                 and other.__dict__.get("_chunkflow_base") is base)

    def __ne__(cls, other):
        return not __eq__(cls, other)

    def __hash__(cls):
        base = cls.__dict__.get("_chunkflow_base")
        return hash(base) if base is not None else type.__hash__(cls)

    return type(f"StandingFor{meta.__name__}", (meta,), {"__eq__": __eq__, "__ne__": __ne__, "__hash__": __hash__})


def _swapped_class(cls: type, attrs: dict) -> type:
    attrs = {"_chunkflow_base": cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "__deepcopy__": _copy_refused, "__reduce_ex__": _copy_refused, **attrs}
    return _standing_for(type(cls))(cls.__name__, (cls,), attrs)


def _part_apply(self, fn, recurse: bool = True):
    handle = self.__dict__.get(_PART)
    if handle is None or handle.removed:
        return _plain(self)._apply(self, fn, recurse)
    return handle.apply_part(self, fn)


def _noting_forward(forward):
    """The block's own `forward`, noting on its hook that it ran: a cache that skips the block (diffusers' caches
    replace the forward its call runs, not the call) leaves the note unset, and the block counts as skipped. Dynamo
    skips this frame (it runs in Python, the note with it) and compiles the block's own forward as it would without
    offload: the same compiled code, shared with the plain model's, one graph per block class."""

    @functools.wraps(forward)
    def noting(self, *args, **kwargs):
        hook = self.__dict__.get(_HOOK)
        if hook is not None:
            hook.ran = True
            if hook.entered is False:  # entered lazily (BlockHook.enter): its tensors bound now, as its forward runs
                _stream_in(hook)
        return forward(self, *args, **kwargs)

    return _dynamo_skips(noting)


def _dynamo_skips(fn):
    """`fn`'s frame left out of compilation, the frames it calls compiled as they are (torch._dynamo's `skip`)."""
    from torch._dynamo.decorators import skip

    return skip(fn)


@functools.cache
def hooked_block_class(cls: type) -> type:
    """`cls` with the offloading `__call__` (same name, and equal to `cls`: class lookups still find it), whose
    `.to()` goes through the handle as a part's does and whose `forward` notes that it ran."""
    return _swapped_class(cls, {"__call__": _block_call, "_apply": _part_apply,
                                "forward": _noting_forward(cls.forward)})


def _held_forwards(module: nn.Module) -> list[dict]:
    """Where wrappers made around `module.forward` keep the bound method they call: the instance's own attributes
    (an instance `forward`, accelerate's `_old_forward`) and diffusers' hook registry's function references (its
    caches' hooks call `original_forward`, the method bound when the hook was registered)."""
    registry = module.__dict__.get("_diffusers_hook")
    return [module.__dict__, *(vars(ref) for ref in getattr(registry, "_fn_refs", ()))]


def _rebind_forward(module: nn.Module, old, new) -> bool:
    """Every bound `old` forward of `module` a wrapper holds now calls `new` (a wrapper made before offload calls the
    noting forward, and the plain one again after remove). Returns whether a call of the module reaches `new`: no
    instance `forward` (the class's is called), or a wrapper holding it."""
    reached = "forward" not in module.__dict__
    for held in _held_forwards(module):
        for name, f in list(held.items()):
            if isinstance(f, types.MethodType) and f.__self__ is module and f.__func__ in (old, new):
                held[name] = types.MethodType(new, module)
                reached = True
    return reached


@contextlib.contextmanager
def _as_plain(module: nn.Module):
    """Within: the part is its own class again, without its handle (what a copy or a pickle of it should see)."""
    cls, handle = type(module), module.__dict__.pop(_PART, None)
    module.__class__ = cls._chunkflow_base
    try:
        yield module
    finally:
        module.__class__ = cls
        if handle is not None:
            module.__dict__[_PART] = handle


def _part_deepcopy(self, memo):
    with _as_plain(self):
        return copy.deepcopy(self, memo)


def _same(obj):
    return obj


def _part_reduce_ex(self, protocol):
    return _same, (_part_deepcopy(self, {}),)  # pickled as its plain copy


@functools.cache
def hooked_part_class(cls: type) -> type:
    """`cls` (a module inside an offloaded one) whose `.to()`, `.half()`, `.cuda()` go through the handle: the whole
    module's device and dtypes are the handle's to change, so a part's own change is refused before it starts. A
    copy or pickle of a part is a plain module of its own class (peft copies layers it trains apart)."""
    return _swapped_class(cls, {"_apply": _part_apply, "__deepcopy__": _part_deepcopy,
                                "__reduce_ex__": _part_reduce_ex})


def hook_part(module: nn.Module, handle) -> None:
    if "_chunkflow_base" not in type(module).__dict__:
        try:
            module.__class__ = hooked_part_class(type(module))
        except TypeError:  # a class that cannot be subclassed so (a custom metaclass): its own .to() stays its own
            return
    module.__dict__[_PART] = handle


def unhook_part(module: nn.Module) -> None:
    module.__dict__.pop(_PART, None)
    if "__call__" not in type(module).__dict__:  # a part's class (a block's goes with its BlockHook)
        unhook_module(module)


@torch.compiler.disable
def _forward_begins(handle) -> None:
    handle.lock.acquire()  # a forward in another thread waits here for the one running to end
    handle.depth += 1
    if handle.depth == 1:
        handle.order.begin()
        handle.runs.begin()


@torch.compiler.disable
def _forward_done(handle) -> None:
    handle.forward_done()


@torch.compiler.disable
def _forward_ends(handle) -> None:
    handle.depth -= 1
    handle.lock.release()


def _root_call(self, *args, **kwargs):
    """The offloaded module's call, one at a time (two threads would share its slots): the handle's lock is held
    from its start to its end, whatever ends it (an exception, an interrupt)."""
    handle = self.__dict__.get(_HOOK)
    if handle is None:
        return _plain(self).__call__(self, *args, **kwargs)
    _forward_begins(handle)
    try:
        out = _plain(self).__call__(self, *args, **kwargs)
        _forward_done(handle)
        return out
    finally:
        _forward_ends(handle)


def _root_apply(self, fn, recurse: bool = True):
    handle = self.__dict__.get(_HOOK)
    if handle is None:
        return _plain(self)._apply(self, fn, recurse)
    return handle.apply(fn, recurse)


def _root_dtype(self):
    """A diffusers model's `dtype`: the compute dtype while its weights are stored in fp8 (as diffusers reports it
    under layerwise casting), else the model's own answer."""
    handle = self.__dict__.get(_HOOK)
    dt = handle.compute_dtype() if handle is not None else None
    return dt if dt is not None else _plain(self).dtype.__get__(self)


@functools.cache
def hooked_root_class(cls: type) -> type:
    """`cls` whose `_apply` goes through the handle (and whose `dtype`, for a diffusers model, says the compute
    dtype under fp8 storage)."""
    attrs = {"_apply": _root_apply, "__call__": _root_call}
    if isinstance(getattr(cls, "dtype", None), property):
        attrs["dtype"] = property(_root_dtype)
    for name, instead in _REFUSED_METHODS.items():  # diffusers' own ways of moving or casting a model's layers
        if callable(getattr(cls, name, None)):
            attrs[name] = _refuse(name, instead)
    return _swapped_class(cls, attrs)


_REFUSED_METHODS = {
    "enable_layerwise_casting": "offload with weight_dtype='fp8_e4m3', which stores the blocks' weights in fp8 with "
                                "the same arithmetic",
    "enable_group_offload": "chunkflow already streams the blocks; use one offloader",
}


def _refuse(name: str, instead: str):
    def refused(self, *args, **kwargs):
        from chunkflow.runtime.errors import OffloadError

        if self.__dict__.get(_HOOK) is None:
            return getattr(_plain(self), name)(self, *args, **kwargs)
        raise OffloadError(f"{name}() on a module offloaded by chunkflow is refused (nothing was changed): {instead}; "
                           "or call handle.remove() first")

    refused.__name__ = name
    return refused


def hook_module(module: nn.Module, hook, root: bool = False) -> bool:
    """Swap in the hooked class and attach `hook` (a BlockHook, or the handle for the root). Returns whether a block's
    call reaches its noting forward (`_rebind_forward`; True for the root)."""
    base = type(module)
    module.__class__ = (hooked_root_class if root else hooked_block_class)(base)
    module.__dict__[_HOOK] = hook
    if root:
        return True
    return _rebind_forward(module, getattr(base, "_chunkflow_base", base).forward, type(module).forward)


def unhook_module(module: nn.Module) -> None:
    module.__dict__.pop(_HOOK, None)
    cls = type(module)
    base = cls.__dict__.get("_chunkflow_base")  # (a subclass made since, e.g. by parametrize, stays)
    if base is not None:
        if "forward" in cls.__dict__:  # a block: wrappers of its forward call the plain one again
            _rebind_forward(module, cls.forward, base.forward)
        module.__class__ = base


class BlockHook:
    """Block l's enter and exit, through its handle (which may lay the blocks out again between forwards). `ran`:
    the block's own forward ran since its enter (the noting forward says so); where its call may not reach that
    forward (a wrapper made before offload that chunkflow cannot see into), every call counts as computed."""

    def __init__(self, handle, index: int, module: nn.Module):
        self.handle = handle
        self.index = index
        self.module = module
        self.ran = False
        self.entered: bool | None = None
        self.sees_forward = hook_module(module, self)

    def enter(self) -> None:
        """The block was called. Where its own forward is seen (`sees_forward`) and only a skipping cache stands
        between the call and that forward (runtime/skipping.py), its tensors are bound when that forward begins
        (`stream_in`), so that a block the cache skips waits for no copy and prefetches none; `entered` is False
        until then (None: not called, or its enter failed)."""
        self.ran = False
        lazy = self.sees_forward and binds_lazily(self.module)
        self.entered = self.handle.enter_block(self.index, lazy=lazy)

    def stream_in(self) -> None:
        self.entered = True  # (a failure inside still gives back what it took, at exit)
        self.handle.stream_in(self.index)

    def exit(self) -> None:
        called = self.entered is not None
        ran = (self.ran or not self.sees_forward) if called else None  # None: its enter failed, not a run
        # only a lazily entered block that never began its forward has nothing bound; a failed enter gives back
        # whatever it took, as an entered block does
        entered, self.entered = self.entered is not False, None
        self.handle.exit_block(self.index, ran, entered=entered)

    def own_copies(self) -> None:
        self.handle.streamer.own_copies(self.index)

    def remove(self) -> None:
        unhook_module(self.module)
