"""fp8-scaled as a stored format's codec (runtime/codecs/base.py FormatCodec): a ScaledFp8Linear's float8_e4m3fn
weight and float32 `scale_weight` (formats/fp8_scaled.py), decoded by the layer's own `ScaledFp8Linear.dequantize`
(`weight.to(dt) * scale.to(dt)`), the function its forward runs. While bound to its decoded values the weight's class
is DecodedParameter, which the layer's forward reads as "already dequantized" and uses as it is.

The layer class is found where its module is imported (no such layer exists before): the runtime imports no format.
"""

from __future__ import annotations

import sys

import torch

from chunkflow.runtime.codecs.base import Decoding, FormatCodec
from chunkflow.runtime.params import DecodedParameter

FP8_MODULE = "chunkflow.formats.fp8_scaled"
SCALE = "scale_weight"


def _layer_class() -> type | None:
    mod = sys.modules.get(FP8_MODULE)
    return getattr(mod, "ScaledFp8Linear", None) if mod is not None else None


class Fp8ScaledWeights(FormatCodec):
    name = "fp8-scaled"
    decoded_class = DecodedParameter

    def decoding(self, t, block: list) -> Decoding | None:
        cls = _layer_class()
        if cls is None or not t.is_param or len({id(m) for m, _ in t.owners}) != 1:
            return None
        layer, attr = t.owners[0]
        if attr != "weight" or not isinstance(layer, cls) or t.dtype != torch.float8_e4m3fn:
            return None
        scale = next((e for e in block if any(m is layer and a == SCALE for m, a in e.owners)), None)
        if scale is None:
            return None
        return Decoding(tuple(t.shape), layer.compute_dtype, (scale,), type(layer))

    def decode(self, source, reads: list[torch.Tensor], out: torch.Tensor, d: Decoding) -> None:
        out.copy_(d.how.dequantize(source, reads[0], d.dtype))
