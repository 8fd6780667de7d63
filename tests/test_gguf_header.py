"""chunkflow_planner.gguf_header: the header of files written by the gguf package, read without torch, against
gguf-py's own reader; damaged headers refused with one line naming the file and the tensor."""

from __future__ import annotations

import struct

import gguf
import pytest
import torch

from chunkflow_planner.gguf_header import GGUFHeaderError, is_gguf, read_header
from gguf_files import write_gguf

Q = gguf.GGMLQuantizationType


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 256, generator=g), "a.bias": torch.randn(64, generator=g),
            "b.weight": torch.randn(3, 32, 512, generator=g), "c.scale": torch.randn(7, generator=g)}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16])
def test_header_matches_gguf_reader(tmp_path, qtype):
    path = write_gguf(tmp_path / "m.gguf", _tensors(), qtype)
    h = read_header(path)
    ref = gguf.GGUFReader(path)
    assert h.version == 3 and h.file_size == path.stat().st_size and h.alignment == 32
    assert [t.name for t in h.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(h.tensors, ref.tensors):
        assert mine.ggml_type == int(theirs.tensor_type)
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert mine.offset == theirs.data_offset and mine.nbytes == theirs.n_bytes
        if theirs.data.dtype == "uint8":
            assert mine.byte_shape == tuple(theirs.data.shape)
    assert h.tensor("a.weight").type_name == qtype.name and h.tensor("a.bias").type_name == "F32"
    assert is_gguf(path)


def test_truncated_file_names_the_tensor(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", _tensors(), Q.Q8_0)
    data = path.read_bytes()
    last = read_header(path).tensors[-1]
    path.write_bytes(data[: last.offset + 3])
    with pytest.raises(GGUFHeaderError, match=f"{last.name}.*truncated"):
        read_header(path)
    path.write_bytes(data[:40])  # inside the header itself
    with pytest.raises(GGUFHeaderError, match="header ends before"):
        read_header(path)


def test_lying_offset_and_type_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", _tensors(), Q.Q8_0)
    h = read_header(path)
    data = bytearray(path.read_bytes())
    name = b"a.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # n_dims, dims, type, offset
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    lying = bytearray(data)
    struct.pack_into("<Q", lying, type_at + 4, h.file_size)  # offset past the end
    path.write_bytes(lying)
    with pytest.raises(GGUFHeaderError, match="'a.weight'.*file is"):
        read_header(path)
    lying = bytearray(data)
    struct.pack_into("<I", lying, type_at, 99)  # a type no version defines
    path.write_bytes(lying)
    with pytest.raises(GGUFHeaderError, match="'a.weight' has ggml type 99"):
        read_header(path)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    assert not is_gguf(p)
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        read_header(p)
    with pytest.raises(GGUFHeaderError, match="cannot be read"):
        read_header(tmp_path / "missing.gguf")
