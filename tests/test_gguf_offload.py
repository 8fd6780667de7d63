"""chunkflow.offload on the module diffusers builds from a GGUF file (from_single_file + GGUFQuantizationConfig):
its GGUFParameters' bytes are streamed as stored and GGUFLinear dequantizes them in its forward, so every output
equals the same module's without chunkflow, bit for bit (CPU). Files written with the gguf package from tiny real
Flux and Wan transformers in each supported type (tests/gguf_files.py)."""

from __future__ import annotations

import gguf
import pytest
import torch
from diffusers.quantizers.gguf.utils import GGUFParameter

import chunkflow
from chunkflow.runtime.errors import OffloadError
from gguf_files import KINDS, TYPES, Q, forward0, gguf_module



def _snapshot(m) -> dict[str, tuple[type, object, torch.Tensor]]:
    return {k: (type(v), getattr(v, "quant_type", None), v.detach().clone()) for k, v in m.state_dict().items()}


def _same_state(m, before) -> None:
    sd = m.state_dict()
    assert sd.keys() == before.keys()
    for k, (cls, qt, value) in before.items():
        v = sd[k]
        assert type(v) is cls and getattr(v, "quant_type", None) == qt, k
        assert v.dtype == value.dtype and torch.equal(v.detach(), value), k


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_offload_gguf_module_bit_identical(tmp_path, kind, qtype):
    m, kw, _ = gguf_module(tmp_path, kind, qtype)
    quantized = [n for n, p in m.named_parameters() if isinstance(p, GGUFParameter)]
    assert quantized and all(m.get_parameter(n).dtype == torch.uint8 for n in quantized)
    ref = forward0(m, kw)
    before = _snapshot(m)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.3, device="cpu")
    assert h.stats().n_streamed_blocks > 0
    assert torch.equal(forward0(m, kw), ref) and torch.equal(forward0(m, kw), ref)
    _same_state(m, before)  # outside the forward: GGUFParameters holding the file's bytes
    for n in quantized:
        p = m.get_parameter(n)
        assert isinstance(p, GGUFParameter) and p.quant_type == before[n][1]
    h.remove()
    assert all(type(m.get_parameter(n)) is GGUFParameter for n in quantized)
    _same_state(m, before)
    assert torch.equal(forward0(m, kw), ref)


@pytest.mark.parametrize("setting", [dict(mode="chunkflow", chunk_size="16KB", residency=0.0),
                                     dict(mode="chunkflow", chunk_size="128KB", residency=0.5),
                                     dict(mode="chunkflow", chunk_size="4097", residency=0.9),
                                     dict(mode="layerwise"), dict(mode="none")], ids=str)
def test_settings(tmp_path, setting):
    m, kw, _ = gguf_module(tmp_path, "wan", Q.Q4_K)
    ref = forward0(m, kw)
    h = chunkflow.offload(m, device="cpu", **setting)
    assert torch.equal(forward0(m, kw), ref)
    h.remove()
    assert torch.equal(forward0(m, kw), ref)


@pytest.mark.parametrize("kw,match", [(dict(weight_dtype="fp8_e4m3"), "quantized already"),
                                      (dict(codec="exponent-pack"), "gain nothing")])
def test_refused_before_anything_changes(tmp_path, kw, match):
    m, inputs, _ = gguf_module(tmp_path, "flux", Q.Q8_0)
    ref = forward0(m, inputs)
    before = _snapshot(m)
    with pytest.raises(OffloadError, match=match):
        chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", **kw)
    _same_state(m, before)
    assert torch.equal(forward0(m, inputs), ref)


def test_in_place_write_reaches_the_forward(tmp_path):
    """A write to a quantized weight's bytes while offloaded (as to any parameter) is used by the next forward."""
    m, kw, _ = gguf_module(tmp_path, "flux", Q.Q8_0)
    (tmp_path / "p").mkdir()
    plain, _, _ = gguf_module(tmp_path / "p", "flux", Q.Q8_0)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu")
    forward0(m, kw)
    name = "single_transformer_blocks.1.proj_out.weight"
    src = plain.get_parameter(name).detach().clone()
    src[:, 2:34] = src[:, 2:34].flip(1)  # the first Q8_0 block's int8 values of every row, reversed
    with torch.no_grad():
        m.get_parameter(name).copy_(src)
        plain.get_parameter(name).copy_(src)
    assert torch.equal(forward0(m, kw), forward0(plain, kw))
    h.remove()


def test_lora_on_gguf_blocks_as_diffusers(tmp_path):
    """peft wraps a GGUFLinear as its base layer (diffusers' add_adapter on a GGUF module): injected while offloaded
    (the blocks laid out again with the new tensors) the output equals the same adapter on the module without
    chunkflow. Fusing into quantized bytes fails in diffusers itself (peft adds a dense delta to the bytes); it is
    not a chunkflow case."""
    from peft import LoraConfig

    def adapter(m):
        torch.manual_seed(5)
        m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"], init_lora_weights=False),
                      adapter_name="a")

    m, kw, _ = gguf_module(tmp_path, "wan", Q.Q8_0)
    (tmp_path / "p").mkdir()
    plain, _, _ = gguf_module(tmp_path / "p", "wan", Q.Q8_0)
    adapter(plain)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.3, device="cpu")
    adapter(m)
    assert type(m.blocks[0].attn1.to_q.base_layer).__name__ == "GGUFLinear"
    assert torch.equal(forward0(m, kw), forward0(plain, kw))
    assert h.stats().relayouts == 1
    h.remove()
    assert torch.equal(forward0(m, kw), forward0(plain, kw))
