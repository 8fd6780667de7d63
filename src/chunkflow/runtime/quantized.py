"""Block parameters stored quantized, streamed as stored: diffusers' GGUFParameter (a GGUF file loaded with
`from_single_file(..., quantization_config=GGUFQuantizationConfig(...))`).

Such a parameter holds a tensor's GGUF blocks as uint8 bytes and its `quant_type`; the layer holding it
(GGUFLinear) dequantizes it in its forward. The runtime treats its bytes as any tensor's: laid out, stored in the
host store (or read from the file by the disk tier), copied to the device slots, bound back; the parameter object and
its class stay the module's (runtime/params.py `offloaded_class`), so the layer's dequantization runs on the device
exactly as without offload; a streamed block's are decoded ahead of its forward by the same function
(runtime/codecs/ahead.py, the default), and the layer finds them decoded. What does not apply to bytes already
quantized is refused before anything changes.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from chunkflow.runtime.errors import OffloadError

GGUF_MODULE = "diffusers.quantizers.gguf.utils"


def quantized_classes() -> tuple[type, ...]:
    """The parameter classes holding quantized bytes that the runtime streams as stored (none until diffusers'
    GGUF support is imported: no such parameter can exist before)."""
    mod = sys.modules.get(GGUF_MODULE)
    return (mod.GGUFParameter,) if mod is not None and hasattr(mod, "GGUFParameter") else ()


def is_quantized(p: torch.Tensor) -> bool:
    """Whether `p` is (or, offloaded, was) a parameter of quantized bytes."""
    classes = quantized_classes()
    return bool(classes) and isinstance(p, classes)


def quant_name(p: torch.Tensor) -> str:
    """'Q8_0' for a GGUF parameter of that type."""
    q = getattr(p, "quant_type", None)
    return getattr(q, "name", str(q))


def streamable(p: nn.Parameter) -> bool:
    """A plain nn.Parameter, or one of quantized bytes the runtime streams as stored."""
    return type(p) is nn.Parameter or type(p) in quantized_classes()


def check_quantized(blocks: list[tuple[str, nn.Module]], weight_dtype: str, codec: str) -> None:
    """Refuse, before anything changes, what cannot apply to blocks holding quantized bytes: fp8 storage (they are
    quantized already) and a codec (exponent-pack packs 16-bit floats' exponents: quantized bytes do not shrink)."""
    first = next(((f"{name}.{pname}", p) for name, b in blocks for pname, p in b.named_parameters()
                  if is_quantized(p)), None)
    if first is None:
        return
    where = f"{first[0]} is stored quantized ({quant_name(first[1])}, a GGUF file)"
    if weight_dtype not in ("bf16", "auto", "none", None) and "fp8" in str(weight_dtype):
        raise OffloadError(f"weight_dtype={weight_dtype!r}: {where}; fp8 storage casts 16-bit weights and these are "
                           "quantized already: offload with weight_dtype='bf16' (the file's bytes are streamed as "
                           "they are)")
    if codec not in ("none", None):
        raise OffloadError(f"codec={codec!r}: {where}; exponent-pack shrinks 16-bit floats' exponents and quantized "
                           "bytes gain nothing from it: offload with codec='none' (a GGUF file already moves 0.3-0.53 "
                           "of bf16's bytes)")
