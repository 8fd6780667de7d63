"""tests/pipelines.py: each tiny pipeline builds from configs alone, is deterministic, and has the catalog's block
lists."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import torch  # noqa: E402

from pipelines import KINDS, block_lists, call_kwargs, one_thread, tiny_pipeline  # noqa: E402

PIPELINE = {"wan": "WanPipeline", "flux": "FluxPipeline", "qwen": "QwenImagePipeline",
            "hunyuan": "HunyuanVideoPipeline"}
BLOCKS = {"wan": ["blocks"], "flux": ["transformer_blocks", "single_transformer_blocks"],
          "qwen": ["transformer_blocks"], "hunyuan": ["transformer_blocks", "single_transformer_blocks"]}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_deterministic(kind):
    outs = []
    for _ in range(2):
        pipe = tiny_pipeline(kind)
        assert type(pipe).__name__ == PIPELINE[kind]
        outs.append(pipe(**call_kwargs(kind))[0])
    a, b = outs
    assert isinstance(a, torch.Tensor) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert torch.isfinite(a).all()
    assert a.abs().sum() > 0

    lists = block_lists(pipe)
    assert sorted(lists) == sorted(BLOCKS[kind])
    for name in BLOCKS[kind]:
        blocks = getattr(pipe.transformer, name)
        assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) >= 2
        n = sum(p.numel() for p in blocks[0].parameters())
        assert 1_000 <= n <= 500_000, (name, n)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_uses_the_prompt(kind):
    """The locally built tokenizers and text encoders reach the transformer: another prompt, another output."""
    pipe = tiny_pipeline(kind)
    a = pipe(**call_kwargs(kind))[0]
    b = pipe(**call_kwargs(kind, prompt="a green cup in the snow"))[0]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_attention_flag_is_what_the_transformer_does(kind):
    """The catalog says which transformers hand their attention a key-padding mask (SDPA then cannot run its flash
    kernel, and the operator model prices that with the masked table): the pipeline's own transformer calls,
    watched through scaled_dot_product_attention, agree for every catalog model of the class."""
    import torch.nn.functional as F

    from chunkflow_planner.catalog import load_models

    pipe = tiny_pipeline(kind)
    inside, masks = [False], []
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        if inside[0]:
            masks.append(kwargs.get("attn_mask") is not None or (len(args) > 3 and args[3] is not None))
        return real(*args, **kwargs)

    pre = pipe.transformer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    post = pipe.transformer.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    F.scaled_dot_product_attention = sdpa
    try:
        pipe(**call_kwargs(kind))
    finally:
        F.scaled_dot_product_attention = real
        pre.remove()
        post.remove()
    assert masks, "the transformer's attention did not go through scaled_dot_product_attention"
    cls = type(pipe.transformer).__name__
    flags = {s.diffusers.masked_attention for s in load_models().values() if s.diffusers.cls == cls}
    assert flags == {any(masks)}, (cls, masks)
