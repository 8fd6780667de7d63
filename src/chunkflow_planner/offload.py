"""How an offload configuration splits each block into resident and streamed bytes.

Shared by the memory and step-time models so both see the same chunks: block l keeps
R_l = min(round(r n_l) C, V_l) bytes resident, whole chunks of its n_l = ceil(V_l / C) and streams the rest in
ceil((V_l - R_l) / C) copies. `layerwise` is one copy of the whole block, r = 0; `none` streams nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["none", "layerwise", "chunkflow"]


def resident_bytes(V: int | float, C: int | float, r: float) -> int | float:
    """R_l: the whole-chunk prefix of a V-byte block (chunks of C bytes, the last one shorter) nearest to r V."""
    if r <= 0 or V <= 0:
        return 0
    k = math.floor(r * V / C)
    below, above = min(k * C, V), min((k + 1) * C, V)
    return above if (above - r * V) <= (r * V - below) else below


@dataclass(frozen=True)
class OffloadConfig:
    """One point of the design space: mode, chunk size C (bytes), residency r, communication awareness."""

    mode: Mode
    chunk_bytes: int | None = None
    residency: float = 0.0
    comm_aware: bool = True

    def __post_init__(self) -> None:
        if self.mode == "chunkflow" and (self.chunk_bytes is None or self.chunk_bytes <= 0):
            raise ValueError("chunkflow needs a positive chunk size")
        if not 0.0 <= self.residency <= 1.0:
            raise ValueError(f"residency must be in [0, 1], got {self.residency}")

    def resident_bytes(self, V: float) -> float:
        """R_l: bytes of a V-byte block kept on the GPU, in whole chunks."""
        if self.mode == "none":
            return V
        if self.mode == "layerwise" or self.residency == 0.0:
            return 0.0
        return float(resident_bytes(V, float(self.chunk_bytes), self.residency))  # type: ignore[arg-type]

    def streamed_bytes(self, V: float) -> float:
        """Bytes of a V-byte block copied host-to-device once per forward."""
        return V - self.resident_bytes(V)

    def copies(self, V: float) -> int:
        """H2D copies per forward for a V-byte block (each pays the DMA start-up cost)."""
        streamed = self.streamed_bytes(V)
        if streamed <= 0:
            return 0
        if self.mode == "layerwise":
            return 1
        return math.ceil(streamed / float(self.chunk_bytes))  # type: ignore[arg-type]

    def chunk_service_bytes(self, V: float) -> float:
        """Bytes of one copy: a chunk, or the whole streamed block for layerwise."""
        if self.mode == "layerwise":
            return self.streamed_bytes(V)
        return min(float(self.chunk_bytes or 0), self.streamed_bytes(V))
