"""A model entry derived from a folder (issue 37): `chunkflow plan --weights DIR` for diffusers DiT classes outside
the catalog, saved with `save_pretrained` (transformer folders, and a whole SD3 pipeline); the block count and
bytes the plan carries equal the runtime's layout of the model; the catalog's models derived from their folders
plan as their hand-written entries do; `models --describe` round-trips; hostile folders get one message."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from chunkflow_planner.catalog import ModelSpec, get_model  # noqa: E402
from chunkflow_planner.plan import load_plan, model_of  # noqa: E402
from pipelines import _cast, one_thread, save_catalog_pipeline  # noqa: E402
from tiny_uncatalogued import MODELS, build  # noqa: E402

VIDEO = {"cogvideox", "ltx_video", "mochi", "allegro", "skyreels_v2", "wan_vace"}
# what a transformer folder does not say (its pipeline's call defaults), given as `plan` flags
GIVEN = ["--height", 64, "--width", 64, "--steps", 4, "--text-len", 8]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each uncatalogued tiny class saved as a transformer folder (float32, as save_pretrained writes it)."""
    root = tmp_path_factory.mktemp("uncatalogued")
    with one_thread():
        for name in MODELS:
            m, _ = build(name)
            m.save_pretrained(root / name)
    return root


def _layout_bytes(name: str) -> list[int]:
    """Per block, the bytes the runtime's layout packs (its tensors' own bytes), of the model as chunkflow runs it
    (bfloat16, float32 where the class keeps modules so), blocks as the runtime finds them."""
    from chunkflow.models.adapters import find_blocks
    from chunkflow.runtime.layout import block_layouts
    from chunkflow.runtime.tiers.host import HostTier

    m, _ = build(name)
    _cast(m, torch.bfloat16)
    blocks = find_blocks(m)
    names = {id(b): f"b{i}" for i, b in enumerate(blocks)}
    host = HostTier()
    lay = block_layouts(m, [(names[id(b)], b) for b in blocks], None, 1.0, None, lambda b: host)
    return [b.tensor_bytes for b in lay]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_from_a_transformer_folder(cli, workdir, folders, name):
    """`plan --weights DIR` of a class chunkflow has no entry for: a valid plan carrying the derived entry, whose
    blocks are the runtime's (count and bytes of each, in the layout's order)."""
    frames = ["--frames", 25] if name in VIDEO else []
    r = cli("plan", "--weights", folders / name, *GIVEN, *frames, "--out", "p.json")
    assert r.exit_code == 0, r.output
    assert "derived from" in r.output
    plan = load_plan(workdir / "p.json")
    spec = model_of(plan)
    assert spec.derived is not None and plan.model.spec == spec
    want = _layout_bytes(name)
    assert plan.model.n_blocks == len(want)
    assert [spec.block_bytes(g) for g in spec.block_sequence()] == want
    assert plan.model.block_bytes_total == sum(want)


def test_missing_workload_names_its_flags(cli, folders):
    """A transformer folder says no height, steps or text length: the error names the flags that give them."""
    r = cli("plan", "--weights", folders / "skyreels_v2")
    assert r.exit_code == 2 and "Traceback" not in r.output
    for flag in ("--height", "--width", "--frames", "--steps", "--text-len"):
        assert flag in r.output


def test_describe_round_trips(cli, sd3_pipe):
    """`models --describe DIR` prints an entry models.yaml reads back as the derived entry (less `derived`, said in
    comments); --help says what it takes."""
    from chunkflow.models.derive import derive_model

    r = cli("models", "--describe", sd3_pipe)
    assert r.exit_code == 0, r.output
    assert "# not timed by any calibration: vae" in r.stdout
    data = yaml.safe_load(r.stdout)
    (key, entry), = data["models"].items()
    assert ModelSpec(name=key, **entry) == derive_model(str(sd3_pipe)).model_copy(update={"derived": None})
    h = cli("models", "--help")
    assert "--describe" in h.output and "model_index.json" in h.output


def _sd3_pipeline(folder):
    """A tiny StableDiffusion3Pipeline (CLIP-with-projection x2, T5, AutoencoderKL) saved whole."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from chunkflow.models.tokenizers import clip_tokenizer, t5_tokenizer

    tm, _ = build("sd3")
    tok, tok3 = clip_tokenizer(), t5_tokenizer()

    def clip():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=8, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    t5 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                 relative_attention_num_buckets=8, pad_token_id=tok3.pad_token_id,
                                 eos_token_id=tok3.eos_token_id, decoder_start_token_id=0))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32)
    pipe = StableDiffusion3Pipeline(transformer=tm, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                                    text_encoder=clip(), tokenizer=tok, text_encoder_2=clip(), tokenizer_2=clip_tokenizer(),
                                    text_encoder_3=t5, tokenizer_3=tok3)
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sd3_pipe(tmp_path_factory):
    with one_thread():
        return _sd3_pipeline(tmp_path_factory.mktemp("sd3") / "sd3-pipe")


def test_plan_from_a_whole_uncatalogued_pipeline(cli, workdir, sd3_pipe):
    """A saved SD3 pipeline: the whole pipeline planned from its folder, its defaults the pipeline's call defaults,
    its VAE (not the catalog's) said untimed; `--model DIR` is the same as `--weights DIR`."""
    folder = sd3_pipe
    r = cli("plan", "--weights", folder, "--out", "p.json")
    assert r.exit_code == 0, r.output
    assert "Not timed by any calibration" in r.output and "vae" in r.output
    plan = load_plan(workdir / "p.json")
    spec = model_of(plan)
    assert plan.pipeline is not None and {c.name for c in plan.pipeline.components} == {
        "text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"}
    assert [te.arch for te in spec.pipeline.text_encoders] == ["clip_text", "clip_text", "t5_encoder"]
    w = spec.default_workload
    assert (w.height, w.width, w.steps, spec.text_len) == (64, 64, 28, 256)  # sample_size 8 x VAE 8; __call__'s
    assert plan.prediction.load is not None and plan.prediction.load.read_bytes > 0
    r2 = cli("plan", "--model", folder, "--weights", folder, "--json")
    assert r2.exit_code == 0, r2.output
    assert json.loads(r2.stdout)["model"]["spec"] == json.loads((workdir / "p.json").read_text())["model"]["spec"]


# the catalog's models derived from folders plan within these of their hand-written entries. The derived entry
# measures the same blocks, sizes and kinds; what may differ is the arch the operator model takes its memory-bound
# passes from (the nearest catalog layout: flux_double for HunyuanVideo's and Qwen-Image's double blocks), where
# the derived FFN size rounds, and the activation model: a derived entry takes its class's from the catalog's first
# entry of that class (FLUX.1-dev's measured c_f 3, c_d 5), while tiny-flux's hand-written entry keeps the default
# (2, 4), 2.7% of its tiny peak. Step time within 5%, peak memory within 3%; the weights' bytes are exact.
STEP_TOL = 0.05
PEAK_TOL = 0.03


def _transformer_plan(cli, workdir, args):
    r = cli("plan", *args, "--transformer-only", "--hardware", "h200", "--out", "p.json")
    assert r.exit_code == 0, r.output
    return load_plan(workdir / "p.json")


def _config_folder(spec, folder):
    """A catalog pipeline as a folder of its configs only (model_index.json and each component's config, no
    weights): what derive_model reads, every module built on the meta device."""
    pipe = spec.pipeline
    index = {"_class_name": pipe.cls, "transformer": ["diffusers", spec.diffusers.cls],
             "vae": ["diffusers", pipe.vae.cls], "scheduler": ["diffusers", pipe.scheduler.cls], **pipe.config}
    parts = {"transformer": {"_class_name": spec.diffusers.cls, **spec.diffusers.config},
             "vae": {"_class_name": pipe.vae.cls, **pipe.vae.config}}
    for te in pipe.text_encoders:
        index[te.component] = ["transformers", te.cls]
        parts[te.component] = {"architectures": [te.cls], **te.config}
    for name, cfg in parts.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "config.json").write_text(json.dumps(cfg))
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": pipe.scheduler.cls,
                                                                           **pipe.scheduler.config}))
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("name", ["Wan2.1-T2V-14B", "Wan2.2-TI2V-5B", "FLUX.1-dev", "HunyuanVideo", "Qwen-Image"])
def test_full_size_catalog_models_derived_from_their_config(cli, workdir, name):
    """A full-size catalog pipeline's configs (every module built on the meta device) plan the transformer within
    STEP_TOL / PEAK_TOL of the catalog's entry at the catalog's default workload."""
    spec = get_model(name)
    folder = _config_folder(spec, workdir / name)
    w = spec.default_workload
    shape = ["--height", w.height, "--width", w.width, "--steps", w.steps, "--text-len", spec.text_len]
    shape += ["--frames", w.frames] if spec.is_video else []
    ref = _transformer_plan(cli, workdir, ["--model", name, *shape[:6], *shape[8:]])
    got = _transformer_plan(cli, workdir, ["--model", folder, *shape])
    d = model_of(got)
    assert (d.n_blocks, d.block_bytes_total, d.nbytes, d.d, d.heads) == (
        spec.n_blocks, spec.block_bytes_total, spec.nbytes, spec.d, spec.heads)
    a, b = ref.prediction, got.prediction
    assert abs(b.step_time_s / a.step_time_s - 1) <= STEP_TOL, (a.step_time_s, b.step_time_s)
    assert abs(b.peak_memory_bytes / a.peak_memory_bytes - 1) <= PEAK_TOL, (a.peak_memory_bytes, b.peak_memory_bytes)


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-flux"])
def test_tiny_catalog_pipelines_derived_from_their_folders(cli, workdir, name):
    """The catalog's tiny pipelines saved whole and derived back: the same components and bytes, and the whole
    pipeline's predictions within the tolerances above at the catalog's workload."""
    spec = get_model(name)
    folder = save_catalog_pipeline(name, workdir / name)
    w = spec.default_workload
    shape = ["--height", w.height, "--width", w.width, "--steps", w.steps]
    shape += ["--frames", w.frames] if spec.is_video else []
    r = cli("plan", "--model", name, *shape, "--hardware", "h200", "--host-mem-budget", "64GB", "--out", "ref.json")
    assert r.exit_code == 0, r.output
    r = cli("plan", "--weights", folder, *shape, "--text-len", spec.text_len, "--hardware", "h200",
            "--host-mem-budget", "64GB", "--out", "got.json")
    assert r.exit_code == 0, r.output
    ref, got = load_plan(workdir / "ref.json"), load_plan(workdir / "got.json")
    d = model_of(got)
    assert d.component_bytes() == spec.component_bytes()
    assert (d.n_blocks, d.block_bytes_total) == (spec.n_blocks, spec.block_bytes_total)
    a, b = ref.prediction, got.prediction
    assert abs(b.step_time_s / a.step_time_s - 1) <= STEP_TOL, (a.step_time_s, b.step_time_s)
    assert abs(b.peak_memory_bytes / a.peak_memory_bytes - 1) <= PEAK_TOL, (a.peak_memory_bytes, b.peak_memory_bytes)


def test_hostile_folders(cli, workdir, monkeypatch):
    """One message each, never a traceback: not a diffusers folder, a class diffusers lacks, a Hub id not cached,
    a config without its class."""
    (workdir / "empty").mkdir()
    (workdir / "nosuch").mkdir()
    (workdir / "nosuch" / "config.json").write_text(json.dumps({"_class_name": "NoSuchTransformer9DModel"}))
    (workdir / "noclass").mkdir()
    (workdir / "noclass" / "config.json").write_text(json.dumps({"num_layers": 2}))
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hub"))
    cases = [(["plan", "--weights", "empty"], "not a diffusers pipeline folder"),
             (["plan", "--model", "./nosuch"], "does not have"),
             (["models", "--describe", "nosuch/config.json"], "NoSuchTransformer9DModel"),
             (["plan", "--weights", "someorg/some-model"], "hf download someorg/some-model"),
             (["plan", "--weights", "noclass"], "_class_name"),
             (["plan"], "--weights")]
    for args, words in cases:
        r = cli(*args)
        assert r.exit_code == 2, (args, r.output)
        assert words in r.output and "Traceback" not in r.output and "internal error" not in r.output, (args, r.output)


def test_version_1_plans_still_load(tiny_plan):
    """A plan written before the schema carried model.spec reads as the catalog's model."""
    data = json.loads(tiny_plan.read_text())
    data["schema_version"] = 1
    data["model"].pop("spec", None)
    tiny_plan.write_text(json.dumps(data))
    p = load_plan(tiny_plan)
    assert model_of(p) is get_model("tiny")


# ------------------------------------------------------------------ an uncatalogued VAE from its shapes


def _catalog_vaes():
    from chunkflow_planner.catalog import load_models

    seen = {}
    for spec in load_models().values():
        v = spec.pipeline.vae if spec.pipeline is not None else None
        if v is not None and v.decode is not None and "tiny" not in v.name and v.name not in seen:
            seen[v.name] = (spec, v)
    return list(seen.values())


@pytest.mark.parametrize("spec,vae", [pytest.param(s, v, id=v.name) for s, v in _catalog_vaes()
                                      if v.name != "qwen-image-vae"])  # a 3D VAE for images: the catalog's fit
def test_a_vae_priced_from_its_shapes_bounds_the_measured_peak_and_comes_near_its_time(spec, vae):
    """The catalog's VAEs priced as an uncatalogued one is (models/vae_shapes.py, from operator shapes on the meta
    device) against their decodes measured on an H200, at the sizes measured: the peak is never under the measured
    one (LIVE_TENSORS is a bound), the time within the factor the median FLOP rate allows (1.6)."""
    import diffusers

    from chunkflow.models.vae_shapes import decode_fit

    dtype = getattr(torch, vae.dtype)
    with torch.device("meta"):
        module = getattr(diffusers, vae.cls).from_config(vae.config).to(dtype)
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    fit = decode_fit(module, channels, spec.is_video, dtype)
    for f, h, w in ((81, 480, 832), (41, 704, 1280)) if spec.is_video else ((1, 1024, 1024), (1, 512, 512)):
        def at(d):
            mem = d.get("mem_const", 0) + d.get("mem_per_px", 0) * h * w + d.get("mem_per_voxel", 0) * f * h * w
            return mem, d.get("time_const", 0) + d.get("time_per_voxel", 0) * f * h * w

        (mem, t), (measured_mem, measured_t) = at(fit), at(vae.decode)
        assert mem >= measured_mem, (vae.name, f, h, w)
        assert measured_t / 1.6 <= t <= measured_t * 1.6, (vae.name, t, measured_t)
