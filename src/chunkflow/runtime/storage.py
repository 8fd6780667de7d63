"""Which block tensors are stored in fp8, and the checks on their values.

fp8 storage follows diffusers' layerwise casting (`ModelMixin.enable_layerwise_casting(storage_dtype=
torch.float8_e4m3fn, compute_dtype=...)`) exactly, restricted to the offloaded blocks: the floating-point tensors of
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


def storage_dtype(weight_dtype: str) -> torch.dtype | None:
    """The torch dtype of a `weight_dtype` setting; None: tensors keep their own dtype."""
    return STORAGE_DTYPES[weight_dtype]


def skip_patterns(root: nn.Module) -> tuple[str, ...]:
    """The patterns `enable_layerwise_casting` skips for this model (without user-given patterns)."""
    patterns = list(DEFAULT_SKIP_PATTERNS)
    for attr in ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns"):
        patterns += list(getattr(root, attr, None) or [])
    return tuple(dict.fromkeys(patterns + list(PEFT_ADAPTER_LAYERS)))


def cast_tensors(root: nn.Module, blocks: list[tuple[str, nn.Module]], dtype: torch.dtype | None) -> dict[int, torch.dtype]:
    """id(tensor) -> storage dtype for the block tensors layerwise casting would store in `dtype` (none if None)."""
    if dtype is None:
        return {}
    patterns = skip_patterns(root)
    inside = {id(m) for _, b in blocks for m in b.modules()}
    out: dict[int, torch.dtype] = {}

    def walk(module: nn.Module, name: str) -> None:
        if name and any(re.search(p, name) for p in patterns):
            return
        if isinstance(module, CAST_LAYERS):
            if id(module) in inside:
                for t in list(module._parameters.values()) + list(module._buffers.values()):
                    if t is not None and t.is_floating_point():
                        out[id(t)] = dtype
            return
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(root, "")
    return out


def check_fits(name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a tensor whose values the cast to `dtype` would clip or turn into NaN (before anything is written)."""
    limit = torch.finfo(dtype).max
    if value.numel() == 0:
        return
    worst = float(value.detach().abs().amax().float())
    if not worst <= limit:  # NaN fails too
        raise OffloadError(
            f"tensor {name} holds values up to {worst:g}, beyond {dtype}'s range (+-{limit:g}); fp8 storage would "
            "clip it (diffusers' layerwise casting does the same, silently). Keep weight_dtype bf16 for this model.")
