"""The safetensors loader picks files as diffusers' `from_pretrained` does: index, variants, shards; checks (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")
from diffusers import WanTransformer3DModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from chunkflow_planner.checkpoint import CheckpointError  # noqa: E402
from chunkflow_planner.offload import OffloadConfig  # noqa: E402
from chunkflow.models.build import build_transformer  # noqa: E402
from chunkflow.models.inputs import make_inputs  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402

WEIGHTS = "diffusion_pytorch_model.safetensors"
PROBE = "blocks.0.ffn.net.2.weight"  # a block tensor: lands in the host store when offloaded


def _tiny(seed=0):
    torch.manual_seed(seed)
    return WanTransformer3DModel(**get_model("tiny-wan").diffusers.config).eval()


def _build(path, **kw):
    kw = {"dtype": torch.float32, "device": "cpu", **kw}
    return build_transformer("tiny-wan", weights=path, **kw)


def _forward(m):
    kw = make_inputs(get_model("tiny-wan"), None, torch.float32, "cpu", seed=1)
    with torch.no_grad():
        return m(**kw)[0]


def _probe(m):
    return dict(m.named_parameters())[PROBE].detach().clone()


@pytest.mark.parametrize("mode,chunk,r", [("none", 1, 0.0), ("chunkflow", 1000, 0.5)])
def test_sharded_checkpoint_with_index_matches_original(tmp_path, mode, chunk, r):
    ref = _tiny()
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="30KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and all("-of-" in s for s in shards)
    index = json.loads((tmp_path / f"{WEIGHTS}.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    # A stray copy of a tensor in a file the index does not name is not read: the weight_map alone decides.
    save_file({PROBE: torch.full(tuple(ref.state_dict()[PROBE].shape), 7.0)}, str(tmp_path / "stray.safetensors"))
    want = _forward(ref)
    m, h = _build(tmp_path, config=OffloadConfig(mode, chunk, r))
    for _ in range(2):
        assert torch.equal(_forward(m), want)
    h.remove()


def _save_with_fp16_variant(path):
    ref, alt = _tiny(0), _tiny(1)
    ref.save_pretrained(path, safe_serialization=True)
    alt.to(torch.float16).save_pretrained(path, safe_serialization=True, variant="fp16")
    return ref, alt


def test_variant_files_ignored_unless_asked_for(tmp_path):
    ref, alt = _save_with_fp16_variant(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.fp16.safetensors").exists()
    m, h = _build(tmp_path)
    assert torch.equal(_probe(m), ref.state_dict()[PROBE])
    assert torch.equal(_forward(m), _forward(ref))
    h.remove()
    m, h = _build(tmp_path, variant="fp16", config=OffloadConfig("chunkflow", 1000))
    want = alt.state_dict()[PROBE].to(torch.float16).float()  # the fp16 values, cast up into the fp32 model
    assert torch.equal(_probe(m), want) and not torch.equal(want, ref.state_dict()[PROBE])
    h.remove()


def test_sharded_variant_with_index(tmp_path):
    ref, alt = _tiny(0), _tiny(1)
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="30KB")
    alt.save_pretrained(tmp_path, safe_serialization=True, variant="fp16", max_shard_size="30KB")
    assert (tmp_path / f"{WEIGHTS}.index.fp16.json").exists()
    assert any(p.name.startswith("diffusion_pytorch_model.fp16-0") for p in tmp_path.iterdir())
    for variant, src in [(None, ref), ("fp16", alt)]:
        m, h = _build(tmp_path, variant=variant)
        assert torch.equal(_forward(m), _forward(src)), variant
        h.remove()


def test_missing_variant_lists_those_present(tmp_path):
    _save_with_fp16_variant(tmp_path)
    with pytest.raises(CheckpointError, match=r"no 'bf16' variant.*variants present: 'fp16'"):
        _build(tmp_path, variant="bf16")
    plain = tmp_path / "plain"
    _tiny().save_pretrained(plain, safe_serialization=True)
    with pytest.raises(CheckpointError, match=r"no 'fp16' variant.*no variants"):
        _build(plain, variant="fp16")


def test_only_variant_files_needs_variant(tmp_path):
    _save_with_fp16_variant(tmp_path)
    (tmp_path / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=r"only variant files.*variant=.*'fp16'"):
        _build(tmp_path)
    m, h = _build(tmp_path, variant="fp16")
    h.remove()


def test_missing_shard_named_by_the_index(tmp_path):
    _tiny().save_pretrained(tmp_path, safe_serialization=True, max_shard_size="30KB")
    gone = sorted(tmp_path.glob("diffusion_pytorch_model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=rf"index {WEIGHTS}\.index\.json.*{gone.name}.*not in the directory"):
        _build(tmp_path)


def test_shards_without_index(tmp_path):
    _tiny().save_pretrained(tmp_path, safe_serialization=True, max_shard_size="30KB")
    (tmp_path / f"{WEIGHTS}.index.json").unlink()
    with pytest.raises(CheckpointError, match=r"sharded.*index .*is missing"):
        _build(tmp_path)


def test_one_arbitrarily_named_file_still_loads(tmp_path):
    ref = _tiny()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / WEIGHTS).rename(tmp_path / "model.safetensors")
    m, h = _build(tmp_path)
    assert torch.equal(_forward(m), _forward(ref))
    h.remove()
    save_file(load_file(str(tmp_path / "model.safetensors")), str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match=r"several files \(model\.safetensors, other\.safetensors\)"):
        _build(tmp_path)


def test_int_tensor_for_float_parameter(tmp_path):
    _tiny().save_pretrained(tmp_path, safe_serialization=True)
    f = tmp_path / WEIGHTS
    sd = load_file(str(f))
    sd[PROBE] = sd[PROBE].to(torch.int8)
    save_file(sd, str(f))
    with pytest.raises(CheckpointError, match=rf"{PROBE}.*int8 \(integer\).*parameter is bfloat16 \(floating\)"):
        _build(tmp_path, dtype=torch.bfloat16)
    sd[PROBE] = sd[PROBE].to(torch.float16)  # floating to floating is a cast, as before
    save_file(sd, str(f))
    m, h = _build(tmp_path, dtype=torch.bfloat16)
    h.remove()


def test_unexpected_tensors(tmp_path):
    _tiny().save_pretrained(tmp_path, safe_serialization=True)
    f = tmp_path / WEIGHTS
    sd = load_file(str(f))
    save_file({**sd, "extra.weight": torch.zeros(2)}, str(f))
    with pytest.raises(CheckpointError, match=r"does not have: extra\.weight;"):
        _build(tmp_path)
    save_file({**sd, **{f"extra{i}": torch.zeros(1) for i in range(8)}}, str(f))
    with pytest.raises(CheckpointError, match=r"extra0, extra1, extra2, extra3, extra4 and 3 more"):
        _build(tmp_path)
    # Keys the class declares harmless (Wan's _keys_to_ignore_on_load_unexpected) are skipped, as diffusers does.
    save_file({**sd, "blocks.0.attn2.norm_added_q.weight": torch.ones(8)}, str(f))
    m, h = _build(tmp_path)
    h.remove()


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    _tiny().save_pretrained(tmp_path, safe_serialization=True, max_shard_size="30KB")
    idx = tmp_path / f"{WEIGHTS}.index.json"
    data = json.loads(idx.read_text())
    owner = data["weight_map"][PROBE]
    other = next(s for s in sorted(set(data["weight_map"].values())) if s != owner)
    data["weight_map"][PROBE] = other
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"{PROBE}.*{other}.*does not match its shards"):
        _build(tmp_path)
    data["weight_map"][PROBE] = "../elsewhere.safetensors"
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"outside the directory"):
        _build(tmp_path)


def test_pickle_only_and_config_checks_still_apply(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(get_model("tiny-wan").diffusers.config)))
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        _build(tmp_path, variant="fp16")
    d = tmp_path / "sharded"
    _tiny().save_pretrained(d, safe_serialization=True, max_shard_size="30KB")
    cfg = json.loads((d / "config.json").read_text())
    cfg["ffn_dim"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="ffn_dim"):
        _build(d)


def test_damaged_files_are_named(tmp_path):
    from chunkflow.models.build import build_transformer

    d = tmp_path / "w"
    WanTransformer3DModel(**get_model("tiny-wan").diffusers.config).save_pretrained(d, safe_serialization=True)
    f = d / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])  # truncated
    with pytest.raises(CheckpointError, match="truncated"):
        build_transformer("tiny-wan", weights=d, dtype=torch.float32, device="cpu")
    for text in ("{not json", "[1, 2]"):
        (d / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match="config.json"):
            build_transformer("tiny-wan", weights=d, dtype=torch.float32, device="cpu")
