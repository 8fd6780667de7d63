"""The lossless codec's ratio as the planner prices it (issue 39): the bytes a codec leaves of the streamed ones,
measured by `chunkflow calibrate` on the user's weights or supposed. Apart from tiers.py (which prices the tiers and
the decode) so that overlap.py's B_pref can use it without an import circle."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkflow_planner.catalog import HardwareSpec

SUPPOSED_CODEC_RATIO = 0.71  # supposed: exponent-pack on bf16 weights left 0.69-0.71 of their bytes (random normal,
# uniform and Laplace values, docs/notes/codec-research/; trained CNN/OCR weights 0.74, their 2-D matrices 0.71:
# docs/data/codec-trained/); `chunkflow calibrate --weights DIR` measures the user's


def codec_ratio(hw: HardwareSpec | None) -> tuple[float, bool]:
    """(rho, measured): the codec's stored / raw bytes, as calibrate measured it on the user's weights, else
    SUPPOSED_CODEC_RATIO (measured False)."""
    if hw is not None and hw.codec_ratio is not None:
        return float(hw.codec_ratio), True
    return SUPPOSED_CODEC_RATIO, False


def encoded_bytes(nbytes: float, codec: str, hw: HardwareSpec | None) -> float:
    """Eq. 2's B_pref under a codec: rho B for the host tier's streamed bytes with a codec, B without."""
    return float(nbytes) if codec == "none" else codec_ratio(hw)[0] * float(nbytes)
