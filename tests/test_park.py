"""Parking: an offloaded module gives its device memory back between uses and takes it back at its next forward,
with outputs unchanged; `take_turns` keeps one of several modules on the device (Wan2.2-A14B's two experts)."""

from __future__ import annotations

import pytest
import torch

import chunkflow
from tiny import wan


def _forward(m, kw):
    with torch.no_grad():
        return m(**kw)[0]


@pytest.mark.parametrize("mode,residency", [("chunkflow", 0.0), ("chunkflow", 0.5), ("layerwise", 0.0), ("none", 0.0)])
def test_park_frees_device_buffers_and_next_forward_is_identical(mode, residency):
    m, blocks, kw = wan()
    ref = _forward(m, kw)
    h = chunkflow.offload(m, mode=mode, chunk_size="64KB", residency=residency, device="cpu", blocks=blocks)
    before = h.stats()
    assert torch.equal(_forward(m, kw), ref)
    h.park()
    assert h.parked
    parked = h.stats()
    assert parked.device_buffer_bytes == 0 and parked.slot_bytes == 0
    assert parked.non_block_bytes == before.non_block_bytes  # the tensors are still there, in host memory
    assert torch.equal(_forward(m, kw), ref)  # the forward took everything back first
    assert not h.parked
    assert h.stats().device_buffer_bytes == before.device_buffer_bytes
    h.remove()
    assert torch.equal(_forward(m, kw), ref)


def test_writes_while_parked_reach_the_next_forward():
    m, blocks, kw = wan()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.5, device="cpu", blocks=blocks)
    _forward(m, kw)
    h.park()
    with torch.no_grad():
        m.blocks[0].ffn.net[0].proj.weight.mul_(2.0)  # a block tensor (host store)
        m.proj_out.weight.mul_(0.5)  # a non-block tensor (in host memory while parked)
    got = _forward(m, kw)
    h.remove()
    assert torch.equal(got, _forward(m, kw))  # the same module without chunkflow, with the writes


def test_remove_while_parked_restores_the_module():
    m, blocks, kw = wan()
    ref = _forward(m, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", device="cpu", blocks=blocks)
    h.park()
    h.remove()
    assert not h.parked
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert torch.equal(_forward(m, kw), ref)
    assert not m._forward_pre_hooks  # the resume hook went with it


def test_take_turns_keeps_one_module_on_the_device():
    a, blocks_a, kw = wan()
    b, blocks_b, _ = wan()
    ref = _forward(a, kw)
    ha = chunkflow.offload(a, mode="chunkflow", chunk_size="64KB", residency=0.5, device="cpu", blocks=blocks_a)
    hb = chunkflow.offload(b, mode="chunkflow", chunk_size="64KB", residency=0.5, device="cpu", blocks=blocks_b)
    turns = chunkflow.take_turns(ha, hb)
    assert torch.equal(_forward(a, kw), ref)
    assert hb.parked and not ha.parked
    assert torch.equal(_forward(b, kw), ref)
    assert ha.parked and not hb.parked
    assert torch.equal(_forward(a, kw), ref)
    assert hb.parked and not ha.parked
    turns.remove()
    _forward(b, kw)
    assert not ha.parked  # no turn-taking any more: b's forward leaves a alone
    ha.remove()
    hb.remove()


def test_discard_frees_without_copying_back_and_leaves_the_module_unusable():
    from chunkflow.runtime.handle import discard

    m, blocks, kw = wan()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.5, device="cpu", blocks=blocks)
    _forward(m, kw)
    h.park()
    discard(h)
    assert h.removed and h.store is None
    assert all(p.device.type == "meta" for p in m.parameters())
    assert type(m).__name__ == "WanTransformer3DModel" and not m._forward_pre_hooks
    with pytest.raises((NotImplementedError, RuntimeError)):
        _forward(m, kw)


def test_a_parked_module_tells_diffusers_where_its_inputs_go():
    from diffusers.utils.torch_utils import get_module_execution_device

    m, blocks, kw = wan()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", device="cpu", blocks=blocks)
    h.park()
    # the weights sit in host memory while parked; inputs must still go to the offload device (diffusers moves
    # token ids there before the forward that unparks)
    assert m._hf_hook.execution_device == h.device
    assert get_module_execution_device(m) == h.device
    _forward(m, kw)
    assert "_hf_hook" not in m.__dict__
    h.park()
    h.remove()
    assert "_hf_hook" not in m.__dict__
