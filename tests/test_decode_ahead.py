"""Decode ahead (runtime/codecs/ahead.py): a streamed block's quantized weights (GGUF types, fp8-scaled) decoded
into the compute dtype right after the block's copies, by the layer's own dequantization, and the layer's forward
using them as they are. Tiny real FLUX and Wan transformers written to GGUF files in every supported type (and to
fp8-scaled files): outputs bit-identical to diffusers' own GGUF module without offload (fp8-scaled: to the same
module without offload, itself checked against the torch reference in test_fp8_scaled.py), both ways ('ahead' and
'forward') equal, for the host and disk tiers (the shared tier: test_gguf_shared.py and test_fp8_scaled.py's
workers, which run with the default 'ahead'); what each layer's forward sees is checked by a forward pre-hook."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

import chunkflow
from chunkflow.formats.fp8_scaled import ScaledFp8Linear
from chunkflow.formats.gguf import GGUFSource
from chunkflow.runtime.codecs.gguf import DecodedGGUFParameter
from chunkflow.runtime.errors import OffloadError
from chunkflow.runtime.params import DecodedParameter
from gguf_files import KINDS, TYPES, Q, forward0, gguf_module

sys.path.insert(0, str(Path(__file__).parent))
from test_fp8_scaled import BF16, CASES, blocks_of, forward  # noqa: E402



def _block_layers(m, layer_cls) -> dict[str, torch.nn.Module]:
    """The quantized layers inside the blocks (what streams)."""
    return {f"{i}.{n}": mod for i, ml in enumerate(blocks_of(m)) for n, mod in ml.named_modules()
            if isinstance(mod, layer_cls)}


def _seen(layers: dict[str, torch.nn.Module]):
    """Forward pre-hooks recording the class of each layer's weight as its forward finds it."""
    seen: dict[str, type] = {}
    hooks = [mod.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, type(mod.weight)))
             for n, mod in layers.items()]
    return seen, hooks


def _snapshot(m) -> dict[str, tuple[type, object, torch.Tensor]]:
    return {k: (type(v), getattr(v, "quant_type", None), v.detach().clone()) for k, v in m.state_dict().items()}


def _same_state(m, before) -> None:
    sd = m.state_dict()
    assert sd.keys() == before.keys()
    for k, (cls, qt, value) in before.items():
        assert type(sd[k]) is cls and getattr(sd[k], "quant_type", None) == qt, k
        assert sd[k].dtype == value.dtype and torch.equal(sd[k].detach(), value), k


def _decoded_bytes(layers) -> list[int]:
    """Each block's quantized weights' bytes in bf16, from the modules (not the runtime's figures)."""
    per: dict[str, int] = {}
    for n, mod in layers.items():
        block = n.split(".")[0] + "." + n.split(".")[1]
        per[block] = per.get(block, 0) + mod.out_features * mod.in_features * 2
    return list(per.values())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gguf_decoded_ahead_is_bit_identical_and_the_forward_skips_its_dequantization(tmp_path, kind, qtype):
    m, kw, _ = gguf_module(tmp_path, kind, qtype)
    ref = forward0(m, kw)
    before = _snapshot(m)
    layers = _block_layers(m, GGUFLinear)
    seen, hooks = _seen(layers)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", decode="ahead")
    st = h.stats()
    assert st.decode == "ahead" and st.decoded_tensors == len(layers) > 0
    assert torch.equal(forward0(m, kw), ref) and torch.equal(forward0(m, kw), ref)
    assert set(seen) == set(layers) and all(c is DecodedGGUFParameter for c in seen.values())
    most = max(_decoded_bytes(layers))  # two decode buffers, each the largest block's weights in bf16 (aligned)
    assert st.decoded_bytes == sum(_decoded_bytes(layers))
    assert 2 * most <= st.decode_buffer_bytes < 2 * (most + 256 * len(layers))
    assert st.device_buffer_bytes >= st.decode_buffer_bytes + 2 * st.slot_bytes
    _same_state(m, before)  # outside the forward: GGUFParameters holding the file's bytes again
    h.remove()
    for hk in hooks:
        hk.remove()
    _same_state(m, before)
    assert all(type(m.get_parameter(n)) is GGUFParameter for n in before if isinstance(before[n][2], torch.Tensor)
               and before[n][0] is GGUFParameter)
    assert torch.equal(forward0(m, kw), ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_both_ways_equal_and_forward_keeps_the_old_path(tmp_path, qtype):
    m, kw, _ = gguf_module(tmp_path, "flux", qtype)
    ref = forward0(m, kw)
    layers = _block_layers(m, GGUFLinear)
    seen, _ = _seen(layers)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.3, device="cpu", decode="forward")
    st = h.stats()
    assert st.decode == "forward" and st.decoded_tensors == 0 and st.decode_buffer_bytes == 0
    assert torch.equal(forward0(m, kw), ref)
    assert all(issubclass(c, GGUFParameter) for c in seen.values())
    h.remove()
    seen.clear()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.3, device="cpu", decode="ahead")
    assert torch.equal(forward0(m, kw), ref)
    assert all(c is DecodedGGUFParameter for c in seen.values())
    h.remove()


def test_resident_blocks_keep_their_quantized_bytes(tmp_path):
    """Blocks kept whole on the device are not decoded ahead: each layer dequantizes in its forward."""
    m, kw, _ = gguf_module(tmp_path, "wan", Q.Q6_K)
    ref = forward0(m, kw)
    seen, _ = _seen(_block_layers(m, GGUFLinear))
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=1.0, device="cpu", decode="ahead")
    assert h.stats().n_streamed_blocks == 0 and h.stats().decoded_tensors == 0
    assert torch.equal(forward0(m, kw), ref)
    assert seen and all(issubclass(c, GGUFParameter) for c in seen.values())
    h.remove()


@pytest.mark.parametrize("kind,qtype", [("flux", Q.Q5_K), ("wan", Q.Q8_0), ("wan", Q.Q4_0)], ids=str)
def test_gguf_disk_blocks_decoded_ahead(tmp_path, kind, qtype):
    m, kw, path = gguf_module(tmp_path, kind, qtype)
    ref = forward0(m, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.25, device="cpu", disk_blocks=2, decode="ahead",
                          source=GGUFSource(path, m))
    assert h.stats().disk_blocks == 2 and h.stats().decoded_tensors > 0
    assert torch.equal(forward0(m, kw), ref) and torch.equal(forward0(m, kw), ref)
    h.remove()
    assert torch.equal(forward0(m, kw), ref)


def test_a_write_between_forwards_is_decoded_again(tmp_path):
    m, kw, _ = gguf_module(tmp_path, "flux", Q.Q8_0)
    (tmp_path / "p").mkdir()
    plain, _, _ = gguf_module(tmp_path / "p", "flux", Q.Q8_0)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", decode="ahead")
    forward0(m, kw)
    name = "transformer_blocks.1.ff.net.2.weight"
    src = plain.get_parameter(name).detach().clone()
    src[:, 2:34] = src[:, 2:34].flip(1)
    with torch.no_grad():
        m.get_parameter(name).copy_(src)
        plain.get_parameter(name).copy_(src)
    assert torch.equal(forward0(m, kw), forward0(plain, kw))
    h.remove()


def test_a_write_inside_the_forward_to_a_later_disk_block_is_decoded_again(tmp_path):
    """A hook on block 0 writes a quantized weight of block 1, a disk block (its bytes come from the file, so the
    written ones are copied over its slot's and decoded again before it runs)."""
    m, kw, path = gguf_module(tmp_path, "wan", Q.Q8_0)
    (tmp_path / "p").mkdir()
    plain, _, _ = gguf_module(tmp_path / "p", "wan", Q.Q8_0)
    name = "blocks.1.attn1.to_q.weight"
    src = plain.get_parameter(name).detach().clone()
    src[:, 2:34] = src[:, 2:34].flip(1)

    def write(target):
        def hook(mod, args):
            with torch.no_grad():
                target.get_parameter(name).copy_(src)
        return hook

    plain.blocks[0].register_forward_pre_hook(write(plain))
    want = forward0(plain, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", disk_blocks=2, decode="ahead",
                          source=GGUFSource(path, m))
    m.blocks[0].register_forward_pre_hook(write(m))
    assert torch.equal(forward0(m, kw), want)
    h.remove()


def test_a_write_to_a_decoded_weight_inside_its_forward_is_refused_and_the_block_released(tmp_path):
    m, kw, _ = gguf_module(tmp_path, "wan", Q.Q8_0)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", decode="ahead")
    layer = m.blocks[0].attn1.to_q
    hk = layer.register_forward_pre_hook(lambda mod, args: mod.weight.data.mul_(1))
    with pytest.raises(OffloadError, match="decoded ahead"):
        forward0(m, kw)
    hk.remove()
    assert type(layer.weight) is not DecodedGGUFParameter and isinstance(layer.weight, GGUFParameter)
    assert not h.streamer.bound
    h.remove()


def test_lora_on_a_decoded_block_as_diffusers(tmp_path):
    """peft wraps a GGUFLinear as its base layer; the blocks are laid out again and the base layer's weight is
    decoded ahead as before; the output equals the same adapter on the module without chunkflow."""
    from peft import LoraConfig

    def adapter(m):
        torch.manual_seed(5)
        m.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"], init_lora_weights=False),
                      adapter_name="a")

    m, kw, _ = gguf_module(tmp_path, "wan", Q.Q4_K)
    (tmp_path / "p").mkdir()
    plain, _, _ = gguf_module(tmp_path / "p", "wan", Q.Q4_K)
    adapter(plain)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", decode="ahead")
    n = h.stats().decoded_tensors
    adapter(m)
    base = m.blocks[1].attn1.to_q.base_layer
    seen, _ = _seen({"base": base})
    assert torch.equal(forward0(m, kw), forward0(plain, kw))
    assert h.stats().relayouts == 1 and h.stats().decoded_tensors == n and seen["base"] is DecodedGGUFParameter
    h.remove()
    assert torch.equal(forward0(m, kw), forward0(plain, kw))


def test_a_bad_decode_is_refused_in_one_line_before_anything_changes(tmp_path):
    m, kw, _ = gguf_module(tmp_path, "flux", Q.Q8_0)
    before = _snapshot(m)
    with pytest.raises(OffloadError, match=r"^decode='early': .* use 'ahead' .* or 'forward'") as e:
        chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", decode="early")
    assert "\n" not in str(e.value)
    _same_state(m, before)
    assert not hasattr(m, "_chunkflow_handle")


# ------------------------------------------------------------------------------------------- fp8-scaled


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("disk", [0, 2])
def test_fp8_scaled_decoded_ahead_is_bit_identical(tmp_path, case, disk):
    from chunkflow.formats import fp8_scaled
    from chunkflow.loading.reader import FileReader

    m, cfg, inputs, path, _ = CASES[case](tmp_path)
    want = forward(fp8_scaled.load(path, type(m), cfg, BF16), inputs)
    outs = {}
    with FileReader() as reader:
        for decode in ("ahead", "forward"):
            module, source = fp8_scaled.build(path, type(m), cfg, BF16, reader)
            layers = _block_layers(module, ScaledFp8Linear)
            seen, _ = _seen(layers)
            h = chunkflow.offload(module, mode="chunkflow", chunk_size=4096, residency=0.0, device="cpu",
                                  blocks=blocks_of(module), source=source, disk_blocks=disk, decode=decode)
            assert h.stats().disk_blocks == disk
            assert h.stats().decoded_tensors == (len(layers) if decode == "ahead" else 0) and layers
            outs[decode] = forward(module, inputs)
            assert torch.equal(forward(module, inputs), outs[decode])
            assert all((c is DecodedParameter) == (decode == "ahead") for c in seen.values()) and seen
            h.remove()
            assert all(mod.weight.dtype == torch.float8_e4m3fn and type(mod.weight) is torch.nn.Parameter
                       for mod in layers.values())
            assert torch.equal(forward(module, inputs), want)
    assert torch.equal(outs["ahead"], want) and torch.equal(outs["forward"], want)
