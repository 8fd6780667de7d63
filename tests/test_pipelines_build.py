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
