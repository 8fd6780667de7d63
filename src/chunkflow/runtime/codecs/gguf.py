"""GGUF as a stored format's codec (runtime/codecs/base.py FormatCodec): diffusers' GGUFLinear weights, its
GGUFParameters holding a GGUF type's blocks as uint8 bytes (runtime/quantized.py), decoded by diffusers' own
`dequantize_gguf_tensor`, the function GGUFLinear's forward runs, then cast to the layer's `compute_dtype` (the
forward's `.to(compute_dtype)`: `out.copy_` is the same cast kernel, without an intermediate tensor).

While bound to its decoded values the weight is a `DecodedGGUFParameter`: no `quant_type` to read, so diffusers'
`dequantize_gguf_tensor` gives it back as it is (its first line: a tensor without `quant_type` is not quantized), and
no GGUFParameter, so no op on it is wrapped as one. GGUFLinear's forward then runs `F.linear` on the same values.

Not taken (dequantized in the forward as diffusers does): unquantized types (F32/F16/BF16 GGUFParameters), a weight
whose owner is not a GGUFLinear's `weight`, and every weight where diffusers' CUDA GGUF kernels are on (its
`forward_cuda` reads the quantized bytes itself: `DIFFUSERS_GGUF_CUDA_KERNELS`).
"""

from __future__ import annotations

import sys

import torch

from chunkflow.runtime.codecs.base import Decoding, FormatCodec
from chunkflow.runtime.params import DecodedParameter

GGUF_MODULE = "diffusers.quantizers.gguf.utils"


class DecodedGGUFParameter(DecodedParameter):
    """A GGUF weight bound to its decoded values (module docstring)."""

    @property
    def quant_type(self):
        raise AttributeError("decoded ahead by chunkflow: these are the weight's values in the compute dtype")


def _diffusers_gguf():
    """diffusers' GGUF module where it is imported (no GGUFParameter can exist before), else None."""
    mod = sys.modules.get(GGUF_MODULE)
    return mod if mod is not None and hasattr(mod, "dequantize_gguf_tensor") else None


class GGUFWeights(FormatCodec):
    name = "gguf"
    decoded_class = DecodedGGUFParameter

    def decoding(self, t, block: list) -> Decoding | None:
        mod = _diffusers_gguf()
        if mod is None or getattr(mod, "ops", None) is not None or not t.is_param:
            return None
        if any(attr != "weight" or not isinstance(m, mod.GGUFLinear) for m, attr in t.owners):
            return None
        p = t.owners[0][0]._parameters["weight"]
        qt = p.__dict__.get("quant_type") if isinstance(p, mod.GGUFParameter) else None
        if qt is None or qt in mod.UNQUANTIZED_TYPES or qt not in mod.dequantize_functions:
            return None
        dtypes = {m.compute_dtype for m, _ in t.owners}
        if len(dtypes) != 1 or not isinstance(next(iter(dtypes)), torch.dtype):
            return None
        block_size, type_size = mod.GGML_QUANT_SIZES[qt]
        shape = (*t.shape[:-1], t.shape[-1] // type_size * block_size)
        return Decoding(tuple(shape), dtypes.pop(), (), qt)

    def source(self, stored: torch.Tensor, d: Decoding):
        """The stored bytes as a GGUFParameter of their quant type (what the layer's weight is in its forward)."""
        return _diffusers_gguf().GGUFParameter(stored, quant_type=d.how)

    def decode(self, source, reads: list[torch.Tensor], out: torch.Tensor, d: Decoding) -> None:
        out.copy_(_diffusers_gguf().dequantize_gguf_tensor(source))
