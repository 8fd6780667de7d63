"""Builder, loader, adapter and inputs tests (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")
from diffusers import WanTransformer3DModel  # noqa: E402

from chunkflow_planner.checkpoint import CheckpointError  # noqa: E402
from chunkflow.models.adapters import find_blocks  # noqa: E402
from chunkflow.models.build import build_transformer  # noqa: E402
from chunkflow.models.inputs import make_inputs  # noqa: E402
from chunkflow_planner.catalog import Workload, get_model  # noqa: E402
from chunkflow_planner.offload import OffloadConfig  # noqa: E402
from tiny import TINY, tiny_spec  # noqa: E402
from tiny import tiny_workload as _workload  # noqa: E402

@pytest.mark.parametrize("name", list(TINY))
def test_random_build_bf16_finite_and_offload_exact(name):
    spec = tiny_spec(name)
    kw = make_inputs(spec, _workload(spec), torch.bfloat16, "cpu", seed=3)
    outs = {}
    for mode, chunk, r in [("none", 1, 0.0), ("layerwise", 1, 0.0), ("chunkflow", 3001, 0.3)]:
        m, h = build_transformer(spec, dtype=torch.bfloat16, device="cpu", config=OffloadConfig(mode, chunk, r),
                                 seed=7)
        with torch.no_grad():
            outs[mode] = [m(**kw)[0] for _ in range(2)]
        assert h.stats().n_blocks == (0 if mode == "none" else len(find_blocks(m)))
        h.remove()
    ref = outs["none"][0]
    assert torch.isfinite(ref.float()).all() and ref.float().std() > 0
    for mode, o in outs.items():
        assert all(torch.equal(x, ref) for x in o), mode


def test_build_keeps_fp32_modules_and_buffers():
    m, h = build_transformer(tiny_spec("Wan2.2-TI2V-5B"), dtype=torch.bfloat16, device="cpu",
                             config=OffloadConfig("chunkflow", 2048))
    assert {b.dtype for b in h.layouts[0].tensors} == {torch.bfloat16, torch.float32}
    ref = WanTransformer3DModel(**tiny_spec("Wan2.2-TI2V-5B").diffusers.config)
    assert torch.equal(m.rope.freqs_cos, ref.rope.freqs_cos)  # computed at construction, not left on meta
    assert not any(p.device.type == "meta" for p in m.parameters())
    h.remove()


def test_adapter_finds_catalog_blocks():
    spec = tiny_spec("FLUX.1-dev")
    m, h = build_transformer(spec, dtype=torch.float32, device="cpu", config="none")
    blocks = find_blocks(m)
    assert blocks == list(m.transformer_blocks) + list(m.single_transformer_blocks)
    with pytest.raises(LookupError):
        find_blocks(torch.nn.Linear(2, 2))
    h.remove()


def _save_tiny_wan(path):
    torch.manual_seed(0)
    spec = get_model("tiny-wan")
    ref = WanTransformer3DModel(**spec.diffusers.config).eval()
    ref.save_pretrained(path, safe_serialization=True)
    return spec, ref


@pytest.mark.parametrize("mode,chunk,r", [("none", 1, 0.0), ("layerwise", 1, 0.0), ("chunkflow", 1000, 0.5)])
def test_safetensors_loader_matches_original(tmp_path, mode, chunk, r):
    spec, ref = _save_tiny_wan(tmp_path)
    kw = make_inputs(spec, None, torch.float32, "cpu", seed=1)
    with torch.no_grad():
        want = ref(**kw)[0]
    m, h = build_transformer("tiny-wan", weights=tmp_path, dtype=torch.float32, device="cpu",
                             config=OffloadConfig(mode, chunk, r))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(m(**kw)[0], want)
    h.remove()


def test_loader_refuses_pickle_only_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(get_model("tiny-wan").diffusers.config)))
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        build_transformer("tiny-wan", weights=tmp_path, dtype=torch.float32, device="cpu")


def test_loader_names_wrong_shape_and_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_tiny_wan(tmp_path)
    f = tmp_path / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    sd["blocks.1.ffn.net.2.weight"] = torch.zeros(3, 3)
    save_file(sd, str(f))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.ffn\.net\.2\.weight"):
        build_transformer("tiny-wan", weights=tmp_path, dtype=torch.float32, device="cpu")
    del sd["blocks.1.ffn.net.2.weight"]
    save_file(sd, str(f))
    with pytest.raises(CheckpointError, match=r"lacks.*blocks\.1\.ffn\.net\.2\.weight"):
        build_transformer("tiny-wan", weights=tmp_path, dtype=torch.float32, device="cpu")


def test_loader_config_mismatch(tmp_path):
    _save_tiny_wan(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["ffn_dim"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="ffn_dim"):
        build_transformer("tiny-wan", weights=tmp_path, dtype=torch.float32, device="cpu")


def test_inputs_shapes_match_the_catalog_formulas():
    spec = get_model("Wan2.2-TI2V-5B")
    w = Workload(batch=1, frames=81, height=704, width=1280, steps=1)
    kw = make_inputs(spec, w, torch.bfloat16, "meta")
    assert tuple(kw["hidden_states"].shape) == (1, 48, 21, 44, 80)
    assert tuple(kw["encoder_hidden_states"].shape) == (1, 512, 4096)
    flux = get_model("FLUX.1-dev")
    kw = make_inputs(flux, None, torch.bfloat16, "meta")
    assert tuple(kw["hidden_states"].shape) == (1, 4096, 64) and tuple(kw["img_ids"].shape) == (4096, 3)
