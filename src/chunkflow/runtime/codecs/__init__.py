"""Codecs for streamed bytes: a layer over any tier (runtime/codecs/layer.py). A block's chunks are held encoded by
its tier, copied encoded and decoded on the device before the block's forward. `CODECS` maps a codec's name
(OffloadConfig.codec) to its implementation of the interface (runtime/codecs/base.py); exponent-pack is the first
(lossless: any bytes round-trip, bf16 weights shrink to 0.70-0.75: docs/data/codec-trained/).
"""

from __future__ import annotations

from chunkflow.runtime.codecs.base import Codec
from chunkflow.runtime.codecs.exponent_pack_codec import ExponentPack

CODECS: dict[str, Codec] = {c.name: c for c in (ExponentPack(),)}


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
