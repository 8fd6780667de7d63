"""exponent-pack as a codec (runtime/codecs/base.py): lossless, encoded at load chunk by chunk (exponent_pack.py),
decoded on a GPU by a Triton kernel (exponent_pack_gpu.py), by the torch reference elsewhere. Its chunk record
(exponent_pack_gpu.Chunk) keeps the chunk's index bits (k) and escape count; nothing outside this codec reads them."""

from __future__ import annotations

import torch

from chunkflow.runtime.codecs import exponent_pack, exponent_pack_gpu
from chunkflow.runtime.codecs.base import Codec


class ExponentPack(Codec):
    name = exponent_pack.NAME
    Chunk = exponent_pack_gpu.Chunk

    def gpu_ready(self) -> bool:
        return exponent_pack_gpu.available()

    def encode(self, raw: torch.Tensor, src: int, dst: int) -> tuple[torch.Tensor, exponent_pack_gpu.Chunk]:
        enc = exponent_pack.encode(raw)
        return enc.data, exponent_pack_gpu.Chunk(src, dst, enc.nbytes, enc.k, enc.n_escapes)

    def decode(self, data: torch.Tensor, out: torch.Tensor, chunk: exponent_pack_gpu.Chunk) -> None:
        exponent_pack.decode(data, out, nbytes=chunk.nbytes, k=chunk.k, n_escapes=chunk.n_escapes)

    def group(self, chunks: list[exponent_pack_gpu.Chunk], device: torch.device) -> exponent_pack_gpu.Decode:
        return exponent_pack_gpu.Decode(chunks, device)

    def any_bytes(self, chunk: exponent_pack_gpu.Chunk) -> exponent_pack_gpu.Chunk:
        return chunk._replace(k=0)  # kept raw: every word read as it is
