"""chunkflow.formats: a GGUF transformer file told by its magic, checked from its header against the model before
anything is read (truncated, lying, another model's, an unsupported type: one line naming the file and the tensor),
loaded as diffusers loads it; and the disk tier streaming a GGUF module's blocks from the file's own bytes."""

from __future__ import annotations

import struct

import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel

import chunkflow
from chunkflow import formats
from chunkflow.formats.gguf import GGUFSource
from chunkflow_planner.checkpoint import CheckpointError
from chunkflow_planner.gguf_header import read_header
from gguf_files import (Q, flux_gguf, flux_inputs, load_gguf, tiny_wan, wan_gguf, wan_inputs, wan_original_name,
                        write_gguf)


@pytest.fixture
def no_load(monkeypatch):
    """from_single_file replaced by a tripwire: a refused file must be refused before diffusers reads it."""
    def tripwire(*a, **k):
        raise AssertionError("from_single_file was called: the file was read before the check refused it")
    for cls in (FluxTransformer2DModel, WanTransformer3DModel):
        monkeypatch.setattr(cls, "from_single_file", classmethod(tripwire))


def _run(m, kw):
    with torch.no_grad():
        return m(**kw)[0]


def test_detect_by_magic_not_name(tmp_path):
    path = flux_gguf(tmp_path, Q.Q8_0)
    renamed = path.rename(tmp_path / "transformer.safetensors")
    assert formats.detect(renamed) == "gguf"
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(formats.FormatError, match="neither a GGUF file"):
        formats.detect(bad)


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_load_is_diffusers_own_module(tmp_path, kind):
    write, cls, inputs = (flux_gguf, FluxTransformer2DModel, flux_inputs) if kind == "flux" else (
        wan_gguf, WanTransformer3DModel, wan_inputs)
    path = write(tmp_path, Q.Q4_K)
    mine = formats.load(path, cls, tmp_path / "transformer", torch.bfloat16)
    theirs = load_gguf(cls, path, tmp_path)
    assert torch.equal(_run(mine, inputs()), _run(theirs, inputs()))


def test_truncated_file_refused_before_load(tmp_path, no_load):
    path = wan_gguf(tmp_path, Q.Q8_0)
    last = read_header(path).tensors[-1]
    path.write_bytes(path.read_bytes()[: last.end - 1])
    with pytest.raises(CheckpointError, match=f"{last.name}.*truncated"):
        formats.load(path, WanTransformer3DModel, tmp_path / "transformer", torch.bfloat16)


def test_lying_shape_refused_before_load(tmp_path, no_load):
    """A header whose dims say another shape (same bytes) than the model's: refused naming the tensor."""
    path = wan_gguf(tmp_path, Q.Q8_0)
    data = bytearray(path.read_bytes())
    name = b"blocks.0.ffn.0.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<IQQ", data, at)
    struct.pack_into("<IQQ", data, at, 2, dims[1] * 2, dims[2] // 2)  # 256 x 512 -> 512 x 256: same bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blocks.0.ffn.net.0.proj.weight has shape \[256, 512\]"):
        formats.load(path, WanTransformer3DModel, tmp_path / "transformer", torch.bfloat16)


def test_other_config_and_missing_tensor_refused(tmp_path, no_load):
    path = wan_gguf(tmp_path, Q.Q8_0)
    m = tiny_wan()
    sd = {wan_original_name(k): v for k, v in m.state_dict().items() if not k.startswith("blocks.1.")}
    short = write_gguf(tmp_path / "short.gguf", sd, Q.Q8_0, "wan")
    with pytest.raises(CheckpointError, match=r"short.gguf' lacks tensor\(s\) blocks.1"):
        formats.load(short, WanTransformer3DModel, tmp_path / "transformer", torch.bfloat16)
    flux_dir = tmp_path / "flux"
    flux_dir.mkdir()
    flux_gguf(flux_dir, Q.Q8_0)
    with pytest.raises(CheckpointError, match="wan-Q8_0.gguf"):  # a Wan file for a Flux folder
        formats.load(path, FluxTransformer2DModel, flux_dir / "transformer", torch.bfloat16)


def test_unsupported_type_refused(tmp_path, no_load):
    m = tiny_wan()
    path = write_gguf(tmp_path / "q5_1.gguf", {wan_original_name(k): v for k, v in m.state_dict().items()}, Q.Q5_1)
    m.save_config(tmp_path / "transformer")
    with pytest.raises(CheckpointError, match="is stored as Q5_1; chunkflow streams GGUF Q8_0, Q6_K, Q5_K, Q4_K, "
                                              "Q4_0"):
        formats.load(path, WanTransformer3DModel, tmp_path / "transformer", torch.bfloat16)


@pytest.mark.parametrize("kind,qtype", [("flux", Q.Q8_0), ("flux", Q.Q5_K), ("wan", Q.Q4_K), ("wan", Q.Q6_K),
                                        ("wan", Q.Q4_0)], ids=str)
def test_disk_tier_reads_the_file_bytes(tmp_path, kind, qtype):
    """disk_blocks with a GGUF module: the blocks' quantized bytes read from the .gguf file each forward (a split
    tensor's rows are a contiguous range of the stored one), outputs bit-identical, the file never written."""
    write, cls, inputs = (flux_gguf, FluxTransformer2DModel, flux_inputs) if kind == "flux" else (
        wan_gguf, WanTransformer3DModel, wan_inputs)
    path = write(tmp_path, qtype)
    before = path.read_bytes()
    m = load_gguf(cls, path, tmp_path)
    kw = inputs()
    ref = _run(m, kw)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    n = 4 if kind == "flux" else 2
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.25, device="cpu", disk_blocks=n,
                          source=GGUFSource(path, m))
    assert h.stats().disk_blocks == n
    assert torch.equal(_run(m, kw), ref) and torch.equal(_run(m, kw), ref)
    assert h.stats().disk_bytes_read >= 2 * h.stats().disk_bytes_per_step > 0
    now = m.state_dict()
    assert all(torch.equal(now[k], v) for k, v in sd.items())
    h.remove()
    assert torch.equal(_run(m, kw), ref)
    assert path.read_bytes() == before
