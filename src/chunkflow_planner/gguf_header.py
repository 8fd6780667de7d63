"""A GGUF file's header, read without torch or numpy (stdlib and struct only): what the planner prices a block
by and what the runtime checks a file against before it reads a byte of tensor data.

A GGUF file (llama.cpp's gguf-py, versions 2 and 3) is: the magic b"GGUF", a uint32 version, uint64 tensor and
key-value counts, the key-value pairs (typed values; `general.alignment` sets the data alignment, 32 by default),
one record per tensor (name, dims innermost first, ggml type, offset from the data section), then the data
section, starting at the first multiple of the alignment after the records. Every tensor's bytes follow from its
type: `prod(dims) / block_size * type_size` (GGML_QUANT_SIZES). Nothing here maps or reads those bytes.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from chunkflow_planner.checkpoint import CheckpointError

__all__ = ["GGUFHeaderError", "GGUFTensor", "GGUFHeader", "read_header", "is_gguf", "GGML_TYPES",
           "GGUF_MAGIC", "type_name"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_STRING = 1 << 20  # a key, a tensor name or a string value longer than this is not a real header's
MAX_DIMS = 8  # ggml's GGML_MAX_DIMS is 4; anything past this is a damaged record
MAX_ITEMS = 1 << 28  # tensors, key-value pairs or array items: more is a damaged count, not a model

# ggml type id -> (name, elements per block, bytes per block) (gguf-py's GGML_QUANT_SIZES)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

# value type id -> struct format of a scalar (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFHeaderError(CheckpointError):
    """A file that is not a GGUF file chunkflow can read, or whose header contradicts itself or its size; the
    message names the file (and the tensor) and what to do."""


def type_name(ggml_type: int) -> str:
    """"Q8_0" for 8; "type 99" for an id this module does not know."""
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type {ggml_type}"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor record: `shape` in torch order (outermost first: gguf's dims reversed), `offset` absolute in the
    file, `nbytes` its bytes as stored."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of its bytes as a uint8 array (each row's blocks): what diffusers' GGUFParameter holds."""
        _, block, size = GGML_TYPES[self.ggml_type]
        return (*self.shape[:-1], self.shape[-1] // block * size) if self.shape else ()


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header: its version, alignment, where the data section starts, the file's size, the tensors in
    file order and the scalar metadata (strings and numbers; arrays left out)."""

    path: Path
    version: int
    alignment: int
    data_start: int
    file_size: int
    tensors: tuple[GGUFTensor, ...]
    metadata: dict[str, object]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    def types(self) -> dict[str, int]:
        """Type name -> how many tensors are stored in it."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class _Reader:
    """Reads the header's fields from a file, each read bounded by the file's size."""

    def __init__(self, f: BinaryIO, path: Path, size: int):
        self.f, self.path, self.size = f, path, size

    def fail(self, what: str) -> GGUFHeaderError:
        return GGUFHeaderError(f"{str(self.path)!r} is not a valid GGUF file: {what}; download it again")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.fail(f"its header ends before {what} (the file is {self.size} bytes: truncated?)")
        return self.f.read(n)

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str) -> int:
        n = self.scalar("<Q", what)
        if n > MAX_ITEMS:
            raise self.fail(f"{what} is {n}, not a real header's")
        return n

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        if n > MAX_STRING:
            raise self.fail(f"{what} claims {n} bytes")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            item_type = self.scalar("<I", what)
            for _ in range(self.count(f"the length of {what}")):
                self.value(item_type, what)
            return None  # arrays (tokenizer vocabularies) are skipped, not kept
        if vtype not in _SCALARS:
            raise self.fail(f"{what} has value type {vtype}, which GGUF does not define")
        return self.scalar(_SCALARS[vtype], what)


def _tensor_record(r: _Reader, i: int) -> tuple[str, int, tuple[int, ...], int]:
    name = r.string(f"the name of tensor {i}")
    n_dims = r.scalar("<I", f"the dimensions of {name!r}")
    if n_dims > MAX_DIMS:
        raise r.fail(f"tensor {name!r} claims {n_dims} dimensions")
    dims = tuple(r.scalar("<Q", f"the dimensions of {name!r}") for _ in range(n_dims))
    ggml_type = r.scalar("<I", f"the type of {name!r}")
    offset = r.scalar("<Q", f"the offset of {name!r}")
    return name, ggml_type, dims, offset


def _tensor(r: _Reader, record: tuple[str, int, tuple[int, ...], int], data_start: int) -> GGUFTensor:
    """One record checked against its type and the file's bounds."""
    name, ggml_type, dims, offset = record
    if ggml_type not in GGML_TYPES:
        raise r.fail(f"tensor {name!r} has ggml type {ggml_type}, which no GGUF version defines")
    _, block, size = GGML_TYPES[ggml_type]
    if dims and dims[0] % block:
        raise r.fail(f"tensor {name!r} ({type_name(ggml_type)}) has rows of {dims[0]} elements, not a multiple of "
                     f"its {block}-element blocks")
    nbytes = math.prod(dims) // block * size
    begin = data_start + offset
    if begin + nbytes > r.size:
        raise GGUFHeaderError(
            f"{str(r.path)!r}: tensor {name!r} ({type_name(ggml_type)}, {nbytes} bytes) lies at bytes [{begin}, "
            f"{begin + nbytes}) but the file is {r.size} bytes: it is truncated or its header is wrong; download it "
            "again")
    return GGUFTensor(name, ggml_type, tuple(reversed(dims)), begin, nbytes)


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether the file starts with GGUF's magic (False for one that cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at `path`, every tensor checked to lie within the file; GGUFHeaderError naming
    the file (and the tensor) for anything else. Reads the header only."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise GGUFHeaderError(f"{str(path)!r} cannot be read: {exc.strerror or exc}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, path, size)
        if f.read(4) != GGUF_MAGIC:
            raise GGUFHeaderError(f"{str(path)!r} is not a GGUF file (it does not start with b'GGUF')")
        version = r.scalar("<I", "the version")
        if version not in (2, 3):
            raise GGUFHeaderError(f"{str(path)!r} is GGUF version {version}; chunkflow reads versions 2 and 3: "
                                  "convert it with a current gguf-py")
        n_tensors = r.count("the tensor count")
        n_kv = r.count("the metadata count")
        metadata: dict[str, object] = {}
        for i in range(n_kv):
            key = r.string(f"metadata key {i}")
            value = r.value(r.scalar("<I", f"the type of {key!r}"), repr(key))
            if value is not None:
                metadata[key] = value
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise r.fail(f"general.alignment is {alignment!r}, not a power of two")
        records = [_tensor_record(r, i) for i in range(n_tensors)]
        data_start = -(-f.tell() // alignment) * alignment
    tensors = tuple(_tensor(r, rec, data_start) for rec in records)
    _check_disjoint(r, tensors)
    return GGUFHeader(path, version, alignment, data_start, size, tensors, metadata)


def _check_disjoint(r: _Reader, tensors: tuple[GGUFTensor, ...]) -> None:
    """No two tensors share a name or a byte."""
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise r.fail(f"tensor {t.name!r} appears twice")
        seen.add(t.name)
    spans = sorted((t.offset, t.end, t.name) for t in tensors if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise r.fail(f"tensors {a!r} and {b!r} overlap")
