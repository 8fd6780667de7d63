"""Block parameters that stay normal parameters while offloaded, and notice writes.

Outside a block's forward every block tensor is a view into the host store: its true shape, dtype and values, so
`state_dict()`, `named_parameters()`, saving and peft see the real weights. Inside the forward the hooks bind it
to device memory (a slot or the resident buffer). The host store is the truth; the device holds copies that the
handle refreshes at the next forward when a write may have changed the host bytes.

Writes are seen three ways (writes that bypass torch, through numpy or raw storage, are not):
- `p.add_(...)`, `p.copy_(...)` (e.g. `load_state_dict`), writes through `p.detach()`, `state_dict()` tensors or
  `p.data` bump the parameter's version counter (`OffloadedParameter.data` is a detached view, which shares it,
  so peft's `base_layer.weight.data += delta` counts too, as does a `.data` tensor kept and written later); the
  handle compares versions at each forward;
- `p.data = new` goes through `OffloadedParameter.data`'s setter, which tells the handle (`touch`): a new value of
  the same shape and dtype is copied into the host view (the binding never leaves the store), any other is
  refused before anything changes;
- new or replaced modules and parameters inside a block (LoRA injection and unloading, `load_state_dict(assign=
  True)`) reach the handle through torch's module registration hooks; the next forward lays the blocks out again.

`_DATA` is torch's own `.data` descriptor: the runtime binds with it directly, so its own binding is no write.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

_DATA = torch._C.TensorBase.data


class WriteTracker(Protocol):
    def touch(self, p: nn.Parameter) -> None: ...

    def check_data(self, p: nn.Parameter, value: torch.Tensor) -> torch.Tensor | None: ...


def raw_data(p: torch.Tensor) -> torch.Tensor:
    """The tensor's data without telling anyone (the runtime's own reads)."""
    return _DATA.__get__(p)


def bind_data(p: torch.Tensor, value: torch.Tensor) -> None:
    """Point a parameter at `value` without telling anyone (the runtime's own binding)."""
    _DATA.__set__(p, value)


class OffloadedParameter(nn.Parameter):
    """A parameter of an offloaded block (see the module docstring). Behaves as nn.Parameter everywhere else."""

    def __repr__(self) -> str:
        return "Parameter containing:\n" + repr(_DATA.__get__(self))

    @property
    def data(self) -> torch.Tensor:
        # A detached view shares the parameter's version counter (a plain `.data` would get its own): writes
        # through it, now or whenever its holder makes them, move the counter the handle watches.
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        tracker = self.__dict__.get("_chunkflow_tracker")
        if tracker is not None:
            home = tracker.check_data(self, value)  # raises for another shape or dtype
            tracker.touch(self)
            if home is not None:  # copy into the host view: the store stays the truth
                home.copy_(value)
                bound = _DATA.__get__(self)
                if bound.data_ptr() != home.data_ptr():  # inside a forward: its device copy too, for the rest of it
                    bound.copy_(value)
                return
        _DATA.__set__(self, value)


DECODED = "chunkflow_decoded"  # a class attribute, True on the class of a parameter bound to its decoded values


class DecodedParameter(OffloadedParameter):
    """A parameter of quantized bytes while bound, inside its block's forward, to its values decoded ahead into its
    layer's compute dtype (runtime/codecs/ahead.py): a plain parameter of those values (ops on it give plain tensors,
    as nn.Parameter's do), whose class says so (`DECODED`; formats/fp8_scaled.py's layer reads it). Its offloaded
    class comes back when the block exits."""

    chunkflow_decoded = True


_OFFLOADED: dict[type, type] = {nn.Parameter: OffloadedParameter}  # a parameter class -> its offloaded class


def offloaded_class(before: type) -> type:
    """The class a parameter of class `before` has while offloaded: OffloadedParameter for nn.Parameter; for a
    parameter class that stores quantized bytes (runtime/quantized.py: diffusers' GGUFParameter) a subclass of
    both, so the layers that read it (GGUFLinear dequantizing `weight.quant_type`) find it as it was, and the
    results of torch ops on it are `before`'s, as without offload."""
    cls = _OFFLOADED.get(before)
    if cls is None:
        torch_function = before.__torch_function__.__func__

        def __torch_function__(_cls, func, types, args=(), kwargs=None):
            return torch_function(before, func, types, args, kwargs)

        cls = type(f"Offloaded{before.__name__}", (OffloadedParameter, before),
                   {"__torch_function__": classmethod(__torch_function__), "__module__": __name__})
        _OFFLOADED[before] = cls
    return cls


def is_offloaded(p: torch.Tensor) -> bool:
    """Whether `p` is a parameter the runtime wrapped (its class not swapped since, e.g. by swap_tensors)."""
    return type(p) in _OFFLOADED.values()


def wrap(p: nn.Parameter, tracker: WriteTracker) -> type:
    """Make `p` (an nn.Parameter, or a quantized one) offloaded (`offloaded_class`) and watched by `tracker`;
    returns its class before."""
    before = type(p)
    p.__class__ = offloaded_class(before)
    p.__dict__["_chunkflow_tracker"] = tracker
    return before


def unwrap(p: nn.Parameter, before: type) -> None:
    p.__dict__.pop("_chunkflow_tracker", None)
    p.__class__ = before
