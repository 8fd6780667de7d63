"""Which block tensors are stored in fp8, and the checks on their values.

fp8 storage follows diffusers' layerwise casting (`ModelMixin.enable_layerwise_casting(storage_dtype=
torch.float8_e4m3fn, compute_dtype=...)`) exactly, in the offloaded blocks (streamed in fp8) and in the layers
outside them (kept on the device in fp8, `ResidentCasting`): the floating-point tensors of
every Conv, ConvTranspose, Linear and Embedding leaf whose dotted name (from the model's root) matches none of the
skip patterns (diffusers' defaults, the class's `_skip_layerwise_casting_patterns` and `_keep_in_fp32_modules`, and
peft's adapter layers) are stored as `tensor.to(float8_e4m3fn)` and used as `stored.to(compute_dtype)`: a plain
cast, no scale, so the arithmetic is diffusers'. A weight with values beyond float8_e4m3fn's range (+-448) would be
clipped by that cast; chunkflow refuses it instead, naming the tensor.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from chunkflow.runtime.errors import OffloadError

STORAGE_DTYPES: dict[str, torch.dtype | None] = {"bf16": None, "fp8_e4m3": torch.float8_e4m3fn}
DEFAULT_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")  # diffusers' own
PEFT_ADAPTER_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                       "hada_w1", "hada_w2", "hada_t1", "hada_t2", "lokr_w1", "lokr_w2", "lokr_t2")
CAST_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
               nn.Linear, nn.Embedding)


class Fp8RoundedWeightsWarning(UserWarning):
    """remove() after fp8 storage: the weights come back with fp8-rounded values (the originals were not kept)."""


def check_no_layerwise_casting(module: nn.Module) -> None:
    """diffusers' layerwise casting changes parameter dtypes around every layer's forward, which an offloaded module
    cannot allow (and weight_dtype fp8_e4m3 does the same job): refuse it before anything changes."""
    for name, m in module.named_modules():
        registry = m.__dict__.get("_diffusers_hook")
        hooks = getattr(registry, "hooks", None) or {}
        if "layerwise_casting" in hooks:
            raise OffloadError(
                f"{type(module).__name__} has diffusers' layerwise casting (on {name or 'the model'}); chunkflow cannot "
                "stream a module whose parameters change dtype at every forward. Load the model without "
                "enable_layerwise_casting and offload with weight_dtype='fp8_e4m3', which gives the same arithmetic.")


def storage_dtype(weight_dtype: str) -> torch.dtype | None:
    """The torch dtype of a `weight_dtype` setting; None: tensors keep their own dtype."""
    return STORAGE_DTYPES[weight_dtype]


def skip_patterns(root: nn.Module) -> tuple[str, ...]:
    """The patterns `enable_layerwise_casting` skips for this model (without user-given patterns)."""
    patterns = list(DEFAULT_SKIP_PATTERNS)
    for attr in ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns"):
        patterns += list(getattr(root, attr, None) or [])
    return tuple(dict.fromkeys(patterns + list(PEFT_ADAPTER_LAYERS)))


def cast_layers(root: nn.Module) -> list[nn.Module]:
    """The leaf layers `enable_layerwise_casting` would cast, in module order."""
    patterns = skip_patterns(root)
    out: list[nn.Module] = []

    def walk(module: nn.Module, name: str) -> None:
        if name and any(re.search(p, name) for p in patterns):
            return
        if isinstance(module, CAST_LAYERS):
            out.append(module)
            return
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(root, "")
    return out


def cast_tensors(root: nn.Module, blocks: list[tuple[str, nn.Module]], dtype: torch.dtype | None) -> dict[int, torch.dtype]:
    """id(tensor) -> storage dtype for the block tensors layerwise casting would store in `dtype` (none if None)."""
    if dtype is None:
        return {}
    inside = {id(m) for _, b in blocks for m in b.modules()}
    return {id(t): dtype for m in cast_layers(root) if id(m) in inside for _, t in ResidentCasting.tensors(m)}


class ResidentCasting:
    """fp8 storage of the layers outside the blocks (they stay on the device): each distinct tensor stored once as
    `t.to(dtype)` (a weight shared by several layers too), and bound to `stored.to(its dtype)` for a layer's forward
    only, as diffusers' LayerwiseCastingHook does. `undo()` gives each its own dtype back (with the fp8-rounded
    values)."""

    def __init__(self, layers: list[nn.Module], dtype: torch.dtype):
        self.dtype = dtype
        self.layers = layers
        self.own: dict[tuple[int, str], torch.dtype] = {}  # (id(layer), attribute) -> the tensor's own dtype
        self._held: dict[int, list[tuple[str, torch.Tensor]]] = {}
        seen: dict[int, torch.dtype] = {}
        owners = [(m, attr, t) for m in layers for attr, t in self.tensors(m)]
        for m, attr, t in owners:  # every dtype before any cast: shared tensors are seen from each owner
            self.own[(id(m), attr)] = seen.setdefault(id(t), t.dtype)
        done: set[int] = set()
        for m, attr, t in owners:
            if id(t) in done:
                continue
            done.add(id(t))
            stored = t.detach().to(dtype)
            for m2, attr2, t2 in owners:  # a buffer held by several layers is set in each
                if t2 is t:
                    _set(m2, attr2, stored)
        self.hooks = [h for m in layers for h in (m.register_forward_pre_hook(self._before),
                                                  m.register_forward_hook(self._after, always_call=True))]

    @staticmethod
    def tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The floating-point tensors of a layer: what layerwise casting casts."""
        return [(a, t) for a, t in list(m._parameters.items()) + list(m._buffers.items())
                if t is not None and t.is_floating_point()]

    @property
    def compute(self) -> dict[int, torch.dtype]:
        """id(tensor) -> its own dtype, for the tensors stored in fp8 now."""
        return {id(t): self.own[(id(m), a)] for m in self.layers for a, t in self.tensors(m) if (id(m), a) in self.own}

    def _before(self, m: nn.Module, args) -> None:
        held = []
        for attr, _ in self.tensors(m):
            own = self.own.get((id(m), attr))
            stored = _get(m, attr)
            if own is not None and stored.dtype == self.dtype:  # not already cast by a layer sharing it
                held.append((attr, stored))
                _set(m, attr, stored.to(own))
        self._held[id(m)] = held

    def _after(self, m: nn.Module, args, output) -> None:
        for attr, stored in self._held.pop(id(m), []):
            _set(m, attr, stored)

    def undo(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        # one tensor back per stored one, so shared ones stay shared: keyed by the Parameter or buffer object the
        # layers hold (alive throughout), never by `_get`'s data, a new object each call whose id can come again
        back: dict[int, torch.Tensor] = {}
        for m in self.layers:
            for attr, held in self.tensors(m):
                own = self.own.get((id(m), attr))
                cur = _get(m, attr)
                if own is not None and cur.dtype == self.dtype:
                    _set(m, attr, back.setdefault(id(held), cur.to(own)))
        self.own = {}


def _get(m: nn.Module, attr: str) -> torch.Tensor:
    """A layer's tensor as stored (a parameter's data, without telling the write tracker)."""
    from chunkflow.runtime.params import raw_data

    return raw_data(m._parameters[attr]) if attr in m._parameters else m._buffers[attr]


def _set(m: nn.Module, attr: str, value: torch.Tensor) -> None:
    """Bind a layer's tensor to `value`, keeping the Parameter object."""
    from chunkflow.runtime.params import bind_data

    if attr in m._parameters:
        bind_data(m._parameters[attr], value)
    else:
        m._buffers[attr] = value


def check_fits(name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a tensor whose values the cast to `dtype` would clip or turn into NaN (before anything is written)."""
    limit = torch.finfo(dtype).max
    if value.numel() == 0 or value.dtype == dtype:  # already stored so: nothing to clip
        return
    worst = float(value.detach().abs().amax().float())
    if not worst <= limit:  # NaN fails too
        raise OffloadError(
            f"tensor {name} holds values up to {worst:g}, beyond {dtype}'s range (+-{limit:g}); fp8 storage would "
            "clip it (diffusers' layerwise casting does the same, silently). Keep weight_dtype bf16 for this model.")
