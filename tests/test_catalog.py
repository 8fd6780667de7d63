"""The model and hardware catalogs: loading, lookup, and parameter counts checked against real diffusers blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from importlib import resources
from pathlib import Path

import pytest
import yaml

from chunkflow_planner.catalog import (
    CATALOG_SCHEMA_VERSION,
    CatalogError,
    ModelSpec,
    get_hardware,
    get_model,
    load_hardware,
    load_models,
    load_profile,
)
from chunkflow_planner.params import block_params

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAMES = list(load_models())

# shared/reference/facts.md: parameter counts from meta-device instantiation (per block, then total).
FACTS_BLOCK_PARAMS = {
    ("Wan2.2-TI2V-5B", "wan_dit"): 163.7e6,
    ("Wan2.1-T2V-14B", "wan_dit"): 351.4e6,
    ("FLUX.1-dev", "flux_double"): 339.8e6,
    ("FLUX.1-dev", "flux_single"): 141.6e6,
}
FACTS_TOTAL_PARAMS = {
    "Wan2.2-TI2V-5B": 5.000e9,
    "Wan2.1-T2V-14B": 14.288e9,
    "FLUX.1-dev": 11.901e9,
    "HunyuanVideo": 12.821e9,
    "Qwen-Image": 20.430e9,
}


def _n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _build(cls_name: str, config: dict, device: str = "meta"):
    import diffusers
    import torch

    cls = getattr(diffusers, cls_name)
    with torch.device(device):
        return cls.from_config(dict(config))


@lru_cache(maxsize=None)
def _meta_model(name: str):
    spec = load_models()[name]
    return _build(spec.diffusers.cls, spec.diffusers.config)


def _with_config(spec: ModelSpec, **changes) -> ModelSpec:
    """`spec` with some diffusers constructor arguments changed."""
    diffusers_spec = spec.diffusers.model_copy(update={"config": {**spec.diffusers.config, **changes}})
    return spec.model_copy(update={"diffusers": diffusers_spec})


# ---- models: loading and lookup ----


def test_every_model_entry_loads():
    models = load_models()
    assert {"Wan2.2-TI2V-5B", "Wan2.1-T2V-14B", "FLUX.1-dev", "HunyuanVideo", "Qwen-Image", "tiny-wan"} <= set(models)
    for name, spec in models.items():
        assert spec.name == name
        assert spec.description
        assert spec.n_blocks == sum(g.count for g in spec.blocks)
        assert spec.non_block_bytes > 0, name


@pytest.mark.parametrize(
    "alias, name",
    [
        ("wan2.2", "Wan2.2-TI2V-5B"),
        ("wan2.2-5b", "Wan2.2-TI2V-5B"),
        ("wan2.1-14b", "Wan2.1-T2V-14B"),
        ("wan14b", "Wan2.1-T2V-14B"),
        ("flux", "FLUX.1-dev"),
        ("flux-dev", "FLUX.1-dev"),
        ("hunyuan", "HunyuanVideo"),
        ("qwen", "Qwen-Image"),
        ("tiny", "tiny-wan"),
        ("FLUX.1-DEV", "FLUX.1-dev"),
    ],
)
def test_aliases_resolve(alias, name):
    assert get_model(alias).name == name


def test_aliases_are_unique():
    keys = [k.lower() for s in load_models().values() for k in [s.name, *s.aliases]]
    assert len(keys) == len(set(keys))


def test_unknown_model_raises_with_suggestion():
    with pytest.raises(CatalogError, match="wan2.2") as exc:
        get_model("wan2.3")
    assert "Did you mean" in str(exc.value)


def test_video_models_declare_temporal_vae_and_image_models_do_not():
    for spec in load_models().values():
        if not spec.is_video:
            assert spec.patch[0] == 1
            assert spec.default_workload.frames == 1
        else:
            assert (spec.default_workload.frames - 1) % spec.vae_temporal == 0


# ---- parameter counts ----


@pytest.mark.parametrize("key", list(FACTS_BLOCK_PARAMS))
def test_block_params_agree_with_facts(key):
    name, arch = key
    spec = get_model(name)
    assert block_params(arch, spec) == pytest.approx(FACTS_BLOCK_PARAMS[key], rel=0.01)


@pytest.mark.parametrize("name", list(FACTS_TOTAL_PARAMS))
def test_total_params_agree_with_facts(name):
    assert get_model(name).total_params == pytest.approx(FACTS_TOTAL_PARAMS[name], rel=0.01)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_block_params_equal_real_diffusers_blocks(name):
    spec = load_models()[name]
    model = _meta_model(name)
    for group in spec.blocks:
        blocks = getattr(model, group.diffusers_list, None)
        assert blocks is not None, f"{spec.diffusers.cls} has no attribute {group.diffusers_list!r}"
        assert len(blocks) == group.count
        assert spec.block_params(group) == _n_params(blocks[0]), (name, group.arch)
        assert {_n_params(b) for b in blocks} == {_n_params(blocks[0])}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_total_params_equal_meta_model(name):
    spec = load_models()[name]
    assert spec.total_params == _n_params(_meta_model(name))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_catalog_counts_the_bytes_the_built_model_holds(name):
    """fp32_params: the parameters the class keeps in float32 in a bf16 model, so spec.nbytes is what the
    transformer built for a plan holds (chunkflow.models.build.transformer_module), parameter by parameter."""
    import torch

    from chunkflow.models.build import transformer_module

    spec = load_models()[name]
    m = transformer_module(spec, torch.bfloat16)
    params = {id(p): p for p in m.parameters()}.values()
    assert spec.fp32_params == sum(p.numel() for p in params if p.dtype == torch.float32)
    assert spec.nbytes == sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_block_lists_cover_every_block_list_of_the_model(name):
    """Every nn.ModuleList of blocks in the model is declared, and in the declared config's numbers."""
    import torch

    spec = load_models()[name]
    model = _meta_model(name)
    block_lists = {
        n for n, m in model.named_children() if isinstance(m, torch.nn.ModuleList) and "blocks" in n
    }
    assert block_lists == {g.diffusers_list for g in spec.blocks}


@pytest.mark.parametrize(
    "name, changes",
    [
        ("tiny-wan", {"added_kv_proj_dim": 24}),
        ("tiny-wan", {"cross_attn_norm": False}),
        ("HunyuanVideo", {"qk_norm": "layer_norm", "num_layers": 1, "num_single_layers": 1}),
        ("HunyuanVideo", {"qk_norm": None, "num_layers": 1, "num_single_layers": 1}),
    ],
)
def test_block_params_follow_config_options(name, changes):
    spec = _with_config(load_models()[name], **changes)
    model = _build(spec.diffusers.cls, spec.diffusers.config)
    for group in spec.blocks:
        assert block_params(group.arch, spec) == _n_params(getattr(model, group.diffusers_list)[0]), changes


def test_block_params_rejects_unknown_arch():
    with pytest.raises(ValueError, match="unknown block arch"):
        block_params("unet", get_model("tiny"))


@pytest.mark.slow
def test_planner_modules_do_not_import_torch():
    code = (
        "import sys, chunkflow_planner.catalog as c, chunkflow_planner.params;"
        "[s.block_bytes_total for s in c.load_models().values()];"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---- the tiny model runs ----


def test_tiny_model_forward_on_cpu():
    import torch

    spec = get_model("tiny")
    cfg = spec.diffusers.config
    torch.manual_seed(0)
    model = _build(spec.diffusers.cls, cfg, device="cpu").eval()
    assert _n_params(model) == spec.total_params

    w = spec.default_workload
    frames = (w.frames - 1) // spec.vae_temporal + 1
    latents = torch.randn(w.batch, spec.latent_channels, frames, w.height // spec.vae_spatial, w.width // spec.vae_spatial)
    text = torch.randn(w.batch, spec.text_len, cfg["text_dim"])
    timestep = torch.tensor([500.0] * w.batch)
    with torch.no_grad():
        out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    assert out.shape == latents.shape
    assert torch.isfinite(out).all()


# ---- packaged data ----


@pytest.mark.parametrize("filename", ["models.yaml", "hardware.yaml"])
def test_packaged_data_matches_top_level_file(filename):
    packaged = resources.files("chunkflow_planner").joinpath("data", filename).read_bytes()
    assert packaged == (ROOT / filename).read_bytes()


@pytest.mark.parametrize("filename", ["models.yaml", "hardware.yaml"])
def test_shipped_catalogs_parse_alike_with_libyaml_and_pure_python(filename):
    """The shipped catalogs are read with libyaml's parser where PyYAML has it (plan's start-up): the same values,
    types included, as the pure-Python parser gives (a float stays a float, a date-like string a string)."""
    text = resources.files("chunkflow_planner").joinpath("data", filename).read_text()
    fast = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    plain = yaml.load(text, Loader=yaml.SafeLoader)
    assert fast == plain and repr(fast) == repr(plain)


# ---- hardware ----


def test_every_hardware_entry_loads():
    hw = load_hardware()
    expected = {
        "h100-pcie-x2-paper", "h100-sxm", "h200", "h200-x2", "h200-x2-pcie",
        "a100-80gb", "l40s", "l40", "rtx-a6000", "rtx-4090", "rtx-5090",
    }
    assert expected <= set(hw)
    for name, spec in hw.items():
        assert spec.name == name
        assert spec.source, name
        if spec.peer_link == "none":
            assert spec.gpus == 1, name


def test_paper_platform_h2d_is_shared_between_two_gpus():
    assert get_hardware("h100-pcie-x2-paper").h2d_gbps == pytest.approx(31.5)


def test_hardware_lookup_is_case_insensitive_and_suggests():
    assert get_hardware("H200").name == "h200"
    with pytest.raises(CatalogError, match="Did you mean"):
        get_hardware("h2000")


def test_profile_file_round_trips(tmp_path):
    spec = get_hardware("h200")
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump()))
    assert load_profile(path) == spec
    assert get_hardware(str(path)) == spec


def test_a_version_1_profile_is_migrated_on_load(tmp_path):
    """A profile of schema version 1 (calibrate's per-operator host model: text_host, host_op_us, cpu_op_us) loads
    as version 2, from a file or embedded in a plan or report: each architecture calibrate counted and timed keeps
    its measured host time, as a layer's (its operators a layer plus its share of those once per forward, at its
    cost each); the per-operator costs go. A version this chunkflow does not know is refused."""
    committed = ROOT / "docs/data/h200-pipeline-7/validate/profile.yaml"  # calibrate on an H200, 2026-12-01
    data = yaml.safe_load(committed.read_text())
    assert data["schema_version"] == 1 and data["host_op_us"] > 0 and "text_host" in data
    hw = load_profile(committed)
    assert hw.schema_version == CATALOG_SCHEMA_VERSION and hw.pipeline.host_margin == 1.0
    from chunkflow.commands.calibrate.host import text_encoder_archs  # the encoder calibrate measured of each

    assert set(hw.pipeline.text_layer_host_us) == set(data["text_host"]) == set(text_encoder_archs())
    for arch, te in text_encoder_archs().items():  # the forward's host time calibrate measured is kept
        cost, layers = data["text_host"][arch], te.shape()["layers"]
        ops = layers * cost["ops_per_layer"] + cost["ops_once"]
        assert layers * hw.pipeline.text_layer_host_us[arch] == pytest.approx(ops * cost["gpu_op_us"])
    dumped = hw.model_dump()
    assert not {"text_host", "host_op_us", "cpu_op_us"} & set(dumped)
    assert type(hw).model_validate(data) == hw  # embedded (plan.hardware.spec): the same migration
    assert load_profile(_write(tmp_path / "v5.yaml", dumped)) == hw  # written back as version 5, read as is
    for old in (2, 3, 4, 5, 6, 7, 8, 9):  # no field changed since: read as they are
        assert load_profile(_write(tmp_path / f"v{old}.yaml", {**dumped, "schema_version": old})) == hw
    with pytest.raises(CatalogError, match="schema_version 11"):  # a version this chunkflow does not know
        load_profile(_write(tmp_path / "v11.yaml", {**dumped, "schema_version": 11}))


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_malformed_profile_names_the_missing_field(tmp_path):
    data = get_hardware("h200").model_dump()
    del data["peak_tflops"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogError, match="peak_tflops"):
        get_hardware(str(path))


def test_a_profile_keeps_its_pipeline_figures_flat_and_round_trips(tmp_path):
    """HardwareSpec holds what the transformer's model reads; the figures only the whole-pipeline extension reads are
    its `pipeline` (PipelineProfile), lifted from the flat keys of the file and written back flat, so profiles on
    disk, the wheel's catalog and the specs embedded in plans read as before and `calibrate --save` round-trips."""
    from chunkflow_planner.catalog import PIPELINE_FIELDS, HardwareSpec, PipelineProfile

    hw = get_hardware("h200")
    assert not PIPELINE_FIELDS & set(HardwareSpec.model_fields) and "pipeline" in HardwareSpec.model_fields
    assert hw.pipeline.host_margin == 0.96 and hw.pipeline.startup_s["encode"] > 0
    assert (hw.figure("host_margin"), hw.figure("eta_comp")) == (0.96, hw.eta_comp)  # by its key in the file
    data = hw.model_dump(mode="json")
    assert "pipeline" not in data and set(PipelineProfile.model_fields) <= set(data)  # flat, as the files hold it
    assert list(data)[-3:] == ["source", "fits", "model_errors"]
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_profile(path) == hw == HardwareSpec(**data)
    # a flat key in an update goes to the sub-model, as it does in a constructor
    moved = hw.model_copy(update={"host_margin": 1.5, "eta_comp": 0.4})
    assert (moved.pipeline.host_margin, moved.eta_comp, hw.pipeline.host_margin) == (1.5, 0.4, 0.96)
    assert HardwareSpec(**{**data, "process_host_bytes": 7}).pipeline.process_host_bytes == 7
    # an error names the key as the file spells it
    path.write_text(yaml.safe_dump({**data, "host_margin": -1.0}, sort_keys=False))
    with pytest.raises(CatalogError, match=r"malformed: host_margin: Input should be greater than 0"):
        load_profile(path)
