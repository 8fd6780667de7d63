"""Whole tiny diffusers pipelines (Wan, FLUX, Qwen-Image, HunyuanVideo; tests/pipelines.py) with the transformer
offloaded, against the same pipeline without offload: every output bit-identical, through the users' own calls:
`pipe(prompt)`, LoRA loading, fusing, hot-swapping and unloading (peft), `save_pretrained`, `pipe.to(dtype)`,
inference_mode."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import torch  # noqa: E402

import chunkflow  # noqa: E402
from chunkflow import OffloadError  # noqa: E402
from pipelines import KINDS, call_kwargs, one_thread, tiny_pipeline  # noqa: E402

# several modes, chunk sizes and residencies across the pipelines
OFFLOAD = {"wan": dict(mode="chunkflow", chunk_size=3001, residency=0.3), "flux": dict(mode="layerwise"),
           "qwen": dict(mode="chunkflow", chunk_size=50_000, residency=0.5),
           "hunyuan": dict(mode="chunkflow", chunk_size=1000, residency=0.0)}
CONFIGS = [dict(mode="layerwise"), dict(mode="chunkflow", chunk_size=2000), dict(mode="chunkflow", chunk_size=3001,
           residency=0.3), dict(mode="chunkflow", chunk_size=10_000, residency=0.77)]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():  # the same thread count for reference and offload: same kernels
        yield


def _out(pipe, kind, **kw):
    return pipe(**call_kwargs(kind, **kw))[0]


def _offloaded(kind, **cfg):
    pipe = tiny_pipeline(kind)
    return pipe, chunkflow.offload(pipe.transformer, device="cpu", **(cfg or OFFLOAD[kind]))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_output_is_bit_identical_with_offload(kind, cfg):
    want = _out(tiny_pipeline(kind), kind)
    pipe, h = _offloaded(kind, **cfg)
    for _ in range(2):
        assert torch.equal(_out(pipe, kind), want)
    h.remove()
    assert torch.equal(_out(pipe, kind), want)


def _lora_state_dict(pipe, seed: int, rank: int = 4) -> dict:
    """A LoRA for the pipeline's transformer in diffusers' format ("transformer." keys), random values."""
    import copy

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    t = copy.deepcopy(pipe.transformer)
    torch.manual_seed(seed)
    t.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                             init_lora_weights=False))
    return {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(t).items()}


def _clone(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items()}


def _lora_lifecycle(pipe, kind, sd1, sd2) -> list:
    """The same LoRA calls on a pipeline. State dicts are cloned for each load: diffusers pops keys from the dict it
    gets, and the loaded adapter may keep the very tensors (a later hot-swap writes into them)."""
    outs = []
    pipe.load_lora_weights(_clone(sd1), adapter_name="a")
    outs.append(_out(pipe, kind))
    pipe.fuse_lora(components=["transformer"])
    outs.append(_out(pipe, kind))
    pipe.unfuse_lora(components=["transformer"])
    outs.append(_out(pipe, kind))
    pipe.set_adapters(["a"], adapter_weights=[0.5])
    outs.append(_out(pipe, kind))
    pipe.load_lora_weights(_clone(sd2), adapter_name="a", hotswap=True)
    outs.append(_out(pipe, kind))
    pipe.load_lora_weights(_clone(sd1), adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[1.0, 0.6])
    outs.append(_out(pipe, kind))
    pipe.unload_lora_weights()
    outs.append(_out(pipe, kind))
    return outs


@pytest.mark.parametrize("kind", KINDS)
def test_lora_load_fuse_hotswap_and_unload_while_offloaded(kind):
    pytest.importorskip("peft")
    ref = tiny_pipeline(kind)
    sd1, sd2 = _lora_state_dict(ref, 5), _lora_state_dict(ref, 6)
    want = _lora_lifecycle(ref, kind, sd1, sd2)
    pipe, h = _offloaded(kind)
    got = _lora_lifecycle(pipe, kind, sd1, sd2)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    assert not torch.equal(want[0], want[-1])  # the LoRA did change the output
    h.remove()
    assert torch.equal(_out(pipe, kind), want[-1])


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_lora_loaded_before_offload(kind):
    pytest.importorskip("peft")
    ref = tiny_pipeline(kind)
    sd = _lora_state_dict(ref, 5)
    ref.load_lora_weights(_clone(sd), adapter_name="a")
    pipe = tiny_pipeline(kind)
    pipe.load_lora_weights(_clone(sd), adapter_name="a")
    h = chunkflow.offload(pipe.transformer, device="cpu", **OFFLOAD[kind])
    assert torch.equal(_out(pipe, kind), _out(ref, kind))
    ref.fuse_lora(components=["transformer"])
    pipe.fuse_lora(components=["transformer"])
    assert torch.equal(_out(pipe, kind), _out(ref, kind))
    h.remove()


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_while_offloaded_round_trips(kind, tmp_path):
    from safetensors.torch import load_file

    ref = tiny_pipeline(kind)
    pipe, h = _offloaded(kind)
    _out(pipe, kind)
    pipe.save_pretrained(tmp_path / "off")
    ref.save_pretrained(tmp_path / "ref")
    files = sorted(p.name for p in (tmp_path / "ref" / "transformer").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "off" / "transformer").glob("*.safetensors"))
    for name in files:
        a, b = load_file(tmp_path / "off" / "transformer" / name), load_file(tmp_path / "ref" / "transformer" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    back = type(ref).from_pretrained(tmp_path / "off")  # the saved pipeline loads and generates the same
    assert torch.equal(_out(back, kind), _out(type(ref).from_pretrained(tmp_path / "ref"), kind))
    h.remove()


@pytest.mark.parametrize("kind", ["wan", "qwen"])
def test_pipe_to_dtype_is_applied_and_a_part_moved_alone_is_refused(kind):
    ref = tiny_pipeline(kind)
    pipe, h = _offloaded(kind)
    first = next(m for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(OffloadError, match=r"remove\(\)"):
        first.to("meta")
    pipe.to("cpu")  # the offload device: nothing to do
    ref.to(torch.bfloat16)
    pipe.to(torch.bfloat16)
    assert {p.dtype for p in pipe.transformer.parameters()} == {p.dtype for p in ref.transformer.parameters()}
    assert torch.equal(_out(pipe, kind), _out(ref, kind))
    h.remove()
    assert torch.equal(_out(pipe, kind), _out(ref, kind))


@pytest.mark.parametrize("inside", [True, False])
def test_inference_mode_on_either_side_of_offload(inside):
    want = _out(tiny_pipeline("wan"), "wan")
    pipe = tiny_pipeline("wan")
    with torch.inference_mode(inside):
        h = chunkflow.offload(pipe.transformer, device="cpu", **OFFLOAD["wan"])
    with torch.inference_mode(not inside):
        assert torch.equal(_out(pipe, "wan"), want)
    assert torch.equal(_out(pipe, "wan"), want)
    h.remove()
