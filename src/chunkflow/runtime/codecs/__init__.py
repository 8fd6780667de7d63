"""Codecs for streamed bytes: a block's chunks kept encoded in host memory, copied encoded, decoded on the device
before the block's forward (runtime/tiers/encoded.py holds them). `CODECS` maps a codec's name (OffloadConfig.codec)
to its interface; exponent_pack.py is the first (lossless: any bytes round-trip, bf16 weights shrink to about 0.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from chunkflow.runtime.codecs import exponent_pack, exponent_pack_gpu


@dataclass(frozen=True)
class Codec:
    """A codec's parts: `encode(flat uint8) -> Encoded` (any device), `decode(data, out, nbytes=, k=, n_escapes=)`
    the exact reference (any device), `Decode(chunks, device)` many chunks decoded by one launch on a GPU, and
    `gpu_ready()` whether that decoder can run here."""

    name: str
    encode: Callable[[torch.Tensor], exponent_pack.Encoded]
    decode: Callable[..., torch.Tensor]
    Decode: type
    Chunk: type
    gpu_ready: Callable[[], bool]


CODECS: dict[str, Codec] = {
    exponent_pack.NAME: Codec(exponent_pack.NAME, exponent_pack.encode, exponent_pack.decode, exponent_pack_gpu.Decode,
                              exponent_pack_gpu.Chunk, exponent_pack_gpu.available),
}


def codec_of(cfg) -> Codec | None:
    """The codec `cfg.codec` names (None for "none"). OffloadConfig has checked the name and refused it with fp8
    storage; a name the planner knows and this runtime does not is refused here."""
    from chunkflow.runtime.errors import OffloadError

    name = cfg.codec
    if name == "none":
        return None
    if name not in CODECS:
        raise OffloadError(f"codec={name!r}: not a codec this chunkflow's runtime has; one of 'none', "
                           f"{', '.join(map(repr, CODECS))}")
    return CODECS[name]
