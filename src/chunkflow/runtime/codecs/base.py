"""What a codec is to the rest of the runtime (two kinds: `Codec`, bytes encoded at load and decoded into the slot
chunk by chunk; `FormatCodec`, a stored format's quantized weights, encoded in the file, decoded per tensor into the
compute dtype ahead of the forward by runtime/codecs/ahead.py). For a `Codec`: how a block's bytes travel between
the tier that holds them and the slot on the device. The streaming side (runtime/codecs/stream.py) and the codec
layer over the tiers (runtime/codecs/layer.py) talk to a codec through this interface only; what a codec keeps per chunk to decode it
is its own (`Chunk`'s fields after the first three).

- `encode(raw, src, dst)`: one chunk's raw bytes encoded, where its tier must encode them at load, with the record
  of the chunk (its bytes at `src` of the block's encoded bytes, decoded to `dst` of the slot). A stored format
  whose bytes are already encoded in the file would give its bytes as they are.
- `decode(data, out, chunk)`: the exact reference decoder (any device: the path without CUDA).
- `group(chunks, device)`: many chunks decoded by one launch on the device: `run(source, out, config)` on the
  current stream, `tune(source, out)` its fastest launch shape here.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import torch


class ChunkRecord(Protocol):
    """A codec's record of one encoded chunk: a NamedTuple whose first fields are these; the rest are the codec's."""

    src: int  # where its encoded bytes start (in the block's encoded bytes, or a decode group's)
    dst: int  # where its decoded bytes go in the slot
    nbytes: int  # its decoded bytes

    def _replace(self, **kw) -> ChunkRecord: ...


class GroupDecode(Protocol):
    def run(self, source: torch.Tensor, out: torch.Tensor, config=None) -> None: ...

    def tune(self, source: torch.Tensor, out: torch.Tensor): ...


class Codec:
    """One way bytes travel (module docstring). Subclasses set `name` and `Chunk` (their ChunkRecord type)."""

    name: ClassVar[str] = ""
    Chunk: ClassVar[type[NamedTuple]]

    def gpu_ready(self) -> bool:
        """Whether its decoder can run on a GPU here."""
        raise NotImplementedError

    def encode(self, raw: torch.Tensor, src: int, dst: int) -> tuple[torch.Tensor, ChunkRecord]:
        """A chunk's raw bytes (flat uint8, any device) encoded: its encoded bytes (on the same device) and its
        record, placed at `src` of the block's encoded bytes and `dst` of the slot."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, out: torch.Tensor, chunk: ChunkRecord) -> None:
        """The reference: `chunk`'s encoded bytes `data` decoded into `out` (flat uint8, `chunk.nbytes`), exactly."""
        raise NotImplementedError

    def group(self, chunks: list[ChunkRecord], device: torch.device) -> GroupDecode:
        """Chunks decoded together by one launch on `device` (their `src` relative to the group's first byte)."""
        raise NotImplementedError

    def any_bytes(self, chunk: ChunkRecord) -> ChunkRecord:
        """A record of the same size whose decode reads any bytes (zeros): what times a launch shape where the
        encoded bytes are not in memory."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ stored formats


class Decoding(NamedTuple):
    """How a stored format decodes one block tensor (`FormatCodec.decoding`): into `shape` of `dtype` (its layer's
    compute dtype), reading besides its own bytes the block tensors `reads` (TensorEntries: fp8-scaled's scale);
    `how` is the codec's own (GGUF: the quant type)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    reads: tuple = ()
    how: object = None

    @property
    def nbytes(self) -> int:
        """Its decoded bytes."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class FormatCodec:
    """A stored format (a GGUF type, fp8-scaled): a codec whose bytes are already encoded in the file. Its tiers hold
    and copy them as they are (nothing encodes); a layer of the format dequantizes its weight in its forward, and a
    streamed block's quantized weights may instead be decoded ahead (runtime/codecs/ahead.py), right after the
    block's copies, by the very function the layer runs, into the layer's compute dtype: the same values, bit for
    bit. What a block takes stored against decoded is `Decoding.nbytes` against its tensors' own bytes.

    - `decoding(t, block)`: how block tensor `t` decodes (None: not one of this format's, or not one its layer can
      take decoded, e.g. diffusers' CUDA GGUF kernels, which read the quantized bytes themselves).
    - `source(stored, d)`: what the decode reads, made once per device view of the stored bytes.
    - `decode(source, reads, out, d)`: exactly the layer's dequantization into `out` (`d.shape`, `d.dtype`) on the
      current stream, on any device: the CPU runs the same call (the reference), synchronously.
    - `decoded_class`: the class the parameter has while bound to its decoded values: the layer's forward then
      finds nothing to dequantize (runtime/params.py DecodedParameter).
    """

    name: ClassVar[str] = ""
    decoded_class: ClassVar[type]

    def decoding(self, t, block: list) -> Decoding | None:
        raise NotImplementedError

    def source(self, stored: torch.Tensor, d: Decoding):
        return stored

    def decode(self, source, reads: list[torch.Tensor], out: torch.Tensor, d: Decoding) -> None:
        raise NotImplementedError
