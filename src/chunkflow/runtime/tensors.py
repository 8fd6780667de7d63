"""The module's tensors at attach and detach time: find each distinct tensor once, write block tensors into the
host store and the rest onto the device (values from the tensor or from a loader's TensorSource), and put them
back at remove()."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from chunkflow.runtime.errors import OffloadError
from chunkflow.runtime.layout import BlockLayout
from chunkflow.runtime.storage import check_fits
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.streamer import bind, current


class TensorSource(Protocol):
    """Values for a module whose tensors are (partly) on the meta device: what loaders give `offload(source=...)`.

    `provides(name)`: whether the source has a value for the tensor of that dotted name (it then overrides the
    module's own value; a meta tensor must be provided). `fill(name, module, attr, out)` writes it into `out`,
    a tensor of the final shape and dtype in its final home (host store or device)."""

    def provides(self, name: str) -> bool: ...

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None: ...


@dataclass
class ModuleTensor:
    """One distinct tensor of the module: its first dotted name, every (module, attribute) holding it, its kind and
    the device it was on before offload."""

    name: str
    owners: list[tuple[nn.Module, str]]
    is_param: bool
    device: torch.device

    def get(self) -> torch.Tensor:
        m, attr = self.owners[0]
        return m._parameters[attr] if self.is_param else m._buffers[attr]

    def set_buffer(self, value: torch.Tensor) -> None:
        for m, attr in self.owners:
            m._buffers[attr] = value


def all_tensors(module: nn.Module) -> list[ModuleTensor]:
    """Each distinct tensor of the module once, in module order (parameters, then buffers, of each module)."""
    found: dict[int, ModuleTensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), ModuleTensor(f"{prefix}.{attr}" if prefix else attr, [], True, p.device))
                found[id(p)].owners.append((m, attr))
        for attr, b in m._buffers.items():
            if b is not None:
                found.setdefault(id(b), ModuleTensor(f"{prefix}.{attr}" if prefix else attr, [], False, b.device))
                found[id(b)].owners.append((m, attr))
    return list(found.values())


def check_values(tensors: list[ModuleTensor], source: TensorSource | None) -> None:
    """Every meta tensor must get its values from the source."""
    missing = [t.name for t in tensors if t.device.type == "meta" and (source is None or not source.provides(t.name))]
    if missing:
        raise OffloadError(f"the module has tensors on the meta device (no values), e.g. {', '.join(missing[:3])}; "
                           "load real weights first, or build it with chunkflow.models.build.build_transformer")


def home(device: torch.device) -> torch.device:
    """Where a tensor goes back to at remove(): its original device, the CPU for one that had no values (meta)."""
    return torch.device("cpu") if device.type == "meta" else device


def place(tensors: list[ModuleTensor], device: torch.device | None) -> None:
    """Non-block tensors to `device` (start-up), or back where each was (None: remove). A tensor its owner no
    longer holds under that name (replaced by a parametrization since) is left to its new holder."""
    for t in tensors:
        m, attr = t.owners[0]
        if attr not in (m._parameters if t.is_param else m._buffers):
            continue
        cur = t.get()
        dev = home(t.device) if device is None else device
        if t.is_param:
            cur.data = cur.data.to(dev)
        else:
            t.set_buffer(cur.to(dev))


def _real_parameter(t: ModuleTensor) -> None:
    """A new (empty) Parameter in the place of a meta one, for every owner, so its data can be bound; or of one
    made inside torch.inference_mode(), whose writes could not be tracked."""
    old = t.get()
    new = nn.Parameter(torch.empty(0, dtype=old.dtype), requires_grad=old.requires_grad)
    for m, attr in t.owners:
        m._parameters[attr] = new


def _write(t: ModuleTensor, e, cur: torch.Tensor, source: TensorSource | None, dst: torch.Tensor) -> None:
    """Block tensor t's value into `dst` (its stored shape and dtype): from `source` if given, else its own."""
    m0, a0 = t.owners[0]
    if e.compute_dtype is not None:  # fp8 storage: the value in its own dtype, then cast
        value = cur.detach()
        if source is not None:  # a loader's value, seen only now (the module's own were checked at offload())
            value = torch.empty(e.shape, dtype=e.compute_dtype)
            source.fill(t.name, m0, a0, value)
            check_fits(t.name, value, e.dtype)
        dst.copy_(value)
    elif source is not None:
        source.fill(t.name, m0, a0, dst)
    else:
        dst.copy_(cur.detach())


def fill(layouts: list[BlockLayout], store: HostStore | None, tensors: list[ModuleTensor], device: torch.device,
         source: TensorSource | None, skip: frozenset[str] = frozenset()) -> list[ModuleTensor]:
    """Write every tensor into its home, in module order: block tensors into the host store, the rest onto the
    device. Values come from `source` where it provides them, else from the tensor. A block tensor whose tier
    supplies it (runtime/tiers/: a tail kept elsewhere; the tier is given the writer of its value, which it may use
    or not) is bound to the tier's view of it instead. `skip`:
    non-block tensors whose values are not read (offload() returns the module parked, their park home holding
    them). Returns the non-block tensors."""
    where = {id(current(e)): (b, e) for b in layouts for e in b.tensors}
    non_block: list[ModuleTensor] = []
    with torch.no_grad(), torch.inference_mode(False):
        for t in tensors:
            cur = t.get()
            m0, a0 = t.owners[0]
            from_source = source is not None and (cur.device.type == "meta" or source.provides(t.name))
            hit = where.get(id(cur))
            if t.is_param and (cur.device.type == "meta" or (hit is not None and cur.is_inference())):
                _real_parameter(t)
            if hit is not None:
                b, e = hit
                write = functools.partial(_write, t, e, cur, source if from_source else None)
                if b.tier.supply(store, b, e, write):  # its tier holds its values: bound to the tier's view
                    bind(e, b.tier.view(store, b, e))
                    continue
                dst = store.view(b.host_offset + e.offset, e.nbytes).view(e.dtype).view(e.shape)
                write(dst)
                bind(e, dst)  # from now on the tensor is its view of the host store
                continue
            non_block.append(t)
            if from_source:
                real = torch.empty(cur.shape, dtype=cur.dtype, device=device)
                if t.name not in skip:
                    source.fill(t.name, m0, a0, real)
                if t.is_param:
                    t.get().data = real
                else:
                    t.set_buffer(real)
    return non_block
