"""An offloaded transformer is still a normal model: true parameters outside the forward, writes that take effect,
dtype changes applied, device changes refused, inference_mode on either side, copies refused clearly, and
remove() keeping every change. Each check runs the same operation on a reference model without offload and
compares the outputs bit for bit (same kernels, same values)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import chunkflow  # noqa: E402
from chunkflow import OffloadError  # noqa: E402
from tiny import MODULES  # noqa: E402

CONFIGS = [dict(mode="layerwise"), dict(mode="chunkflow", chunk_size=3001, residency=0.3),
           dict(mode="chunkflow", chunk_size=50_000, residency=0.5), dict(mode="chunkflow", chunk_size=1000)]


def _run(m, kw):
    with torch.no_grad():
        return m(**kw)[0]


def _pair(kind: str = "wan", **cfg):
    """(reference module, offloaded copy, handle, inputs)."""
    ref, blocks, kw = MODULES[kind]()
    off = copy.deepcopy(ref)
    h = chunkflow.offload(off, device="cpu", **(cfg or CONFIGS[1]))
    return ref, off, h, kw


def _same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k].to(sa[k].device)) for k in sa)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("kind", ["wan", "flux", "qwen", "hunyuan"])
def test_parameters_keep_shape_dtype_and_values(kind, cfg):
    ref, off, h, kw = _pair(kind, **cfg)
    assert [(n, p.shape, p.dtype) for n, p in ref.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in off.named_parameters()]
    assert _same_state(ref, off)
    assert torch.equal(_run(off, kw), _run(ref, kw))
    assert _same_state(ref, off)  # and again after a forward: block tensors are host views between forwards
    h.remove()
    assert _same_state(ref, off) and torch.equal(_run(off, kw), _run(ref, kw))


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=str)
def test_save_pretrained_while_offloaded_round_trips(tmp_path, cfg):
    from diffusers import WanTransformer3DModel

    ref, off, h, kw = _pair(**cfg)
    off.save_pretrained(tmp_path / "off")
    ref.save_pretrained(tmp_path / "ref")
    a = WanTransformer3DModel.from_pretrained(tmp_path / "off")
    b = WanTransformer3DModel.from_pretrained(tmp_path / "ref")
    assert _same_state(a, b) and torch.equal(_run(a, kw), _run(b, kw))
    h.remove()


def _writes(m):
    """Every way a user or a library writes a parameter in place, once."""
    blk = m.blocks[1]
    with torch.no_grad():
        m.blocks[0].attn1.to_q.weight.mul_(0.5)  # the parameter itself: version counter
        blk.ffn.net[0].proj.weight.data.add_(0.01)  # through .data (peft's merges)
        blk.attn2.to_k.weight.data = blk.attn2.to_k.weight.data * 1.5  # .data = a new tensor
        m.state_dict()["blocks.2.attn1.to_v.weight"].add_(0.02)  # through state_dict()'s detached tensor
        m.blocks[2].scale_shift_table.copy_(torch.full_like(m.blocks[2].scale_shift_table, 0.1))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_writes_while_offloaded_take_effect_and_survive_remove(cfg):
    ref, off, h, kw = _pair(**cfg)
    _run(off, kw)  # a forward first, so the first block is already prefetched when the writes land
    _writes(ref)
    _writes(off)
    assert _same_state(ref, off)
    assert torch.equal(_run(off, kw), _run(ref, kw))
    sd = {k: v * 0.9 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    off.load_state_dict(sd)
    assert torch.equal(_run(off, kw), _run(ref, kw))
    assert h.stats().refreshes >= 2
    h.remove()
    assert _same_state(ref, off) and torch.equal(_run(off, kw), _run(ref, kw))


def test_a_write_that_would_change_a_parameters_shape_or_dtype_is_refused_before_anything_changes():
    ref, off, h, kw = _pair()
    w = off.blocks[0].attn1.to_q.weight
    before = w.detach().clone()
    for bad, why in ((torch.zeros(3), "remove"), (w.detach().to(torch.float64), "remove"), ("x", "a tensor")):
        with pytest.raises(OffloadError, match=why):
            w.data = bad
    assert torch.equal(w.detach(), before) and torch.equal(_run(off, kw), _run(ref, kw))
    h.remove()


def test_dtype_change_is_applied_to_the_store_and_a_move_to_meta_ends_the_offload():
    ref, off, h, kw = _pair()
    ref.to(torch.bfloat16)
    off.to(torch.bfloat16)
    assert {p.dtype for p in off.parameters()} == {torch.bfloat16} and h.stats().relayouts == 1
    kwb = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
    assert torch.equal(_run(off, kwb), _run(ref, kwb))
    off.to("cpu")  # the offload device: nothing to do
    off.float()
    ref.float()
    assert torch.equal(_run(off, kw), _run(ref, kw)) and h.stats().relayouts == 2
    off.to("meta")  # as for a module not offloaded: every tensor on the meta device, and so the offload ends
    assert h.removed and all(t.device.type == "meta" for t in [*off.parameters(), *off.buffers()])
    assert type(off) is type(ref)
    h.remove()  # nothing left to undo


@pytest.mark.parametrize("inside", [True, False])
def test_inference_mode_on_either_side(inside):
    ref, blocks, kw = MODULES["wan"]()
    want = _run(ref, kw)
    off = copy.deepcopy(ref)
    with torch.inference_mode(inside):
        h = chunkflow.offload(off, device="cpu", mode="chunkflow", chunk_size=3001, residency=0.3)
    with torch.inference_mode():
        assert torch.equal(off(**kw)[0], want)
    assert torch.equal(_run(off, kw), want)
    with torch.inference_mode(not inside):
        off.load_state_dict(ref.state_dict())
    assert torch.equal(_run(off, kw), want)
    h.remove()
    assert torch.equal(_run(off, kw), want)


def test_a_model_made_inside_inference_mode_can_be_offloaded():
    with torch.inference_mode():
        m, blocks, kw = MODULES["wan"]()
        want = m(**kw)[0]
    h = chunkflow.offload(m, device="cpu", mode="chunkflow", chunk_size=3001, residency=0.3)
    assert torch.equal(_run(m, kw), want)
    h.remove()


def test_copying_an_offloaded_module_is_refused_clearly():
    ref, off, h, kw = _pair()
    with pytest.raises(OffloadError, match=r"remove\(\)"):
        copy.deepcopy(off)
    with pytest.raises(OffloadError, match=r"remove\(\)"):
        torch.save(off, "/dev/null")
    h.remove()
    copy.deepcopy(off)


def test_quantized_or_custom_parameters_are_refused_before_anything_changes():
    class Odd(torch.nn.Parameter):
        pass

    ref, blocks, kw = MODULES["wan"]()
    w = ref.blocks[1].attn1.to_q.weight
    ref.blocks[1].attn1.to_q.weight = Odd(w.detach().clone(), requires_grad=False)
    with pytest.raises(OffloadError, match="Odd"):
        chunkflow.offload(ref, device="cpu")
    assert type(ref.blocks[0]).__name__ == "WanTransformerBlock" and "_chunkflow_hook" not in ref.blocks[0].__dict__


def _lora_lifecycle(m, kw, outs: list) -> None:
    """peft through diffusers' model API: add, fuse, unfuse, scale, hot-swap, second adapter, delete, unload."""
    from peft import LoraConfig

    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"],
                     init_lora_weights=False)
    torch.manual_seed(5)
    m.add_adapter(cfg, adapter_name="a")
    outs.append(_run(m, kw))
    m.fuse_lora()
    outs.append(_run(m, kw))
    m.unfuse_lora()
    outs.append(_run(m, kw))
    m.set_adapters(["a"], weights=[0.5])
    outs.append(_run(m, kw))
    with torch.no_grad():  # a hot-swap writes new values into the adapter's existing tensors
        for k, v in m.state_dict().items():
            if "lora_" in k:
                v.mul_(-1.0)
    outs.append(_run(m, kw))
    torch.manual_seed(6)
    m.add_adapter(cfg, adapter_name="b")
    m.set_adapters(["a", "b"], weights=[1.0, 0.7])
    outs.append(_run(m, kw))
    m.delete_adapters("b")
    outs.append(_run(m, kw))
    m.unload_lora()
    outs.append(_run(m, kw))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_lora_while_offloaded_matches_the_same_lora_without_offload(cfg):
    pytest.importorskip("peft")
    ref, off, h, kw = _pair(**cfg)
    want, got = [], []
    _lora_lifecycle(ref, kw, want)
    _lora_lifecycle(off, kw, got)
    assert len(got) == len(want) == 8
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    assert not torch.equal(want[0], want[-1])  # the adapter changed the output, and unloading it undid that
    assert h.stats().relayouts >= 3  # inject a, inject b, delete, unload: the blocks were laid out again
    h.remove()
    assert _same_state(ref, off)


def test_lora_loaded_before_offload_keeps_working():
    pytest.importorskip("peft")
    from peft import LoraConfig

    ref, blocks, kw = MODULES["wan"]()
    torch.manual_seed(5)
    ref.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_v"], init_lora_weights=False), adapter_name="a")
    off = copy.deepcopy(ref)
    h = chunkflow.offload(off, device="cpu", mode="chunkflow", chunk_size=3001, residency=0.3)
    assert torch.equal(_run(off, kw), _run(ref, kw))
    ref.fuse_lora()
    off.fuse_lora()
    assert torch.equal(_run(off, kw), _run(ref, kw)) and h.stats().relayouts == 0
    h.remove()
    assert _same_state(ref, off)


def test_a_data_tensor_kept_across_a_forward_and_written_later_is_seen():
    ref, off, h, kw = _pair()
    kept = off.blocks[0].attn1.to_q.weight.data  # taken now: the first block is prefetched in the next forward
    kept_ref = ref.blocks[0].attn1.to_q.weight.data
    assert torch.equal(_run(off, kw), _run(ref, kw))
    kept.mul_(0.5)
    kept_ref.mul_(0.5)
    assert torch.equal(_run(off, kw), _run(ref, kw))
    h.remove()
