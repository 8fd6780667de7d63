"""Run what was planned, for pipelines beyond the catalog's six and with an image (issue 37): real diffusers
pipelines with tiny random weights saved with save_pretrained, run through chunkflow (the CLI's `run --image` and
the API's build_pipeline + generate), their latents bit-identical to diffusers' own pipeline loaded from the same
folder, called with the same seed (and image). Hostile images and folders of another model are refused before the
load, with one message.

The uncatalogued pipelines (SD3, CogVideoX, LTX-Video, Wan2.1-style image-to-video) run from the model entry
chunkflow derives from their folder (chunkflow.models.derive), as `chunkflow plan --weights DIR` does."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

from pipelines import _cast, _seeded, _t5, one_thread, save_catalog_pipeline

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from chunkflow.models.tokenizers import clip_tokenizer, t5_tokenizer  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.offload import OffloadConfig  # noqa: E402

PROMPT, NEGATIVE = "a cat walks on the grass", "blurry, low quality"
DTYPES = {"default": torch.bfloat16, "vae": torch.float32}  # what chunkflow runs them in (the VAEs: float32)
STREAM = OffloadConfig("chunkflow", 16 * 1024, 0.0)


def derived(folder: Path, **workload):
    """The model entry chunkflow derives from `folder` (what `plan --weights DIR` plans), at a tiny workload."""
    from chunkflow.models.derive import derive_model

    return derive_model(str(folder), workload)


# ---------------------------------------------------------------------------------------- tiny folders


def _save(pipe, folder: Path, vae: torch.dtype = torch.float32) -> Path:
    """`pipe` saved in the dtypes chunkflow runs it in (bf16, the VAE in `vae`)."""
    from diffusers import ModelMixin

    for name, c in pipe.components.items():
        if isinstance(c, ModelMixin):
            _cast(c, vae if name == "vae" else torch.bfloat16)
        elif isinstance(c, torch.nn.Module):
            c.to(torch.bfloat16)
    pipe.save_pretrained(folder)
    return folder


def _clip_projection(tok, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=4, hidden_act="gelu",
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return _seeded(seed, lambda: CLIPTextModelWithProjection(cfg))


def _sd3(folder: Path):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from tiny_uncatalogued import build

    transformer, _ = build("sd3")  # joint attention 16 (T5's width), pooled 8 (two CLIP projections of 4)
    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    vae = _seeded(3, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=_clip_projection(tok, 0), tokenizer=tok, text_encoder_2=_clip_projection(tok2, 1),
        tokenizer_2=tok2, text_encoder_3=_t5(tok3, 2, d_model=16, t5_class="T5EncoderModel"), tokenizer_3=tok3)
    _save(pipe, folder, vae=torch.bfloat16)  # SD3 decodes the transformer's bf16 latents: its VAE runs in bf16
    spec = derived(folder, height=32, width=32, steps=2, text_len=16)
    call = dict(height=32, width=32, guidance_scale=spec.pipeline.guidance, negative_prompt=NEGATIVE,
                max_sequence_length=16, dtypes=torch.bfloat16)
    return spec, call


def _cogvideox(folder: Path):
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline

    from tiny_uncatalogued import build

    transformer, _ = build("cogvideox")  # text 16 wide, 5 tokens; 8 x 8 latents, 2 latent frames
    tok = t5_tokenizer()
    vae = _seeded(2, lambda: AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4))
    pipe = CogVideoXPipeline(tokenizer=tok, text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"), vae=vae,
                             transformer=transformer, scheduler=CogVideoXDDIMScheduler())
    _save(pipe, folder, vae=torch.bfloat16)  # it decodes the transformer's bf16 latents: its VAE runs in bf16
    spec = derived(folder, height=64, width=64, frames=5, steps=2)
    call = dict(height=64, width=64, num_frames=5, guidance_scale=spec.pipeline.guidance, negative_prompt=NEGATIVE,
                max_sequence_length=5, dtypes=torch.bfloat16)
    return spec, call


def _ltx(folder: Path):
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline

    from tiny_uncatalogued import build

    transformer, _ = build("ltx_video")  # 8 latent channels, captions 16 wide
    tok = t5_tokenizer()
    vae = _seeded(2, lambda: AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False))
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, tokenizer=tok, transformer=transformer,
                       text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"))
    _save(pipe, folder)
    spec = derived(folder, height=32, width=32, frames=9, steps=2, text_len=16)
    call = dict(height=32, width=32, num_frames=9, guidance_scale=spec.pipeline.guidance, negative_prompt=NEGATIVE,
                max_sequence_length=16)
    return spec, call


def _needs_ftfy():
    """Wan's image-to-video pipeline cleans prompts with ftfy (the diffusers and test extras install it)."""
    pytest.importorskip("ftfy", reason="Wan image-to-video needs ftfy: pip install -e .[test]")


def _wan_i2v(folder: Path, base: Path):
    """Wan2.1-style image-to-video: tiny's UMT5, VAE and scheduler (from its saved folder `base`), a transformer of
    2 z + 4 input channels with image cross-attention, a CLIP vision encoder and its image processor."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    t2v = WanPipeline.from_pretrained(base)
    transformer = _seeded(5, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, image_dim=16, added_kv_proj_dim=32, rope_max_seq_len=1024))
    encoder = _seeded(6, lambda: CLIPVisionModel(CLIPVisionConfig(
        hidden_size=16, projection_dim=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=32, patch_size=8)))
    pipe = WanImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                   scheduler=t2v.scheduler, image_processor=CLIPImageProcessor(crop_size=32, size=32),
                                   image_encoder=encoder, transformer=transformer)
    _save(pipe, folder)
    return derived(folder, height=32, width=32, frames=5, steps=2, text_len=8)


def _image(path: Path, size=(40, 48), seed: int = 0) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return path


# ------------------------------------------------------------------------------------------ diffusers


def _diffusers(cls_name: str, folder: Path, seed: int, dtypes=DTYPES, **call) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers alone: `cls_name`.from_pretrained(folder) in chunkflow's dtypes, called with `call` and the seeded
    CPU generator, 2 steps; (the denoising loop's last latents, the output with output_type="latent")."""
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, torch_dtype=dtypes)
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def keep(p, i, t, kw):
        seen["latents"] = kw["latents"].detach().clone()
        return kw

    with one_thread(), torch.no_grad():
        out = pipe(prompt=PROMPT, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type="latent", callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"],
                   **call)
    result = out.frames if hasattr(out, "frames") else out.images
    return seen["latents"], result


def _chunkflow(spec, folder: Path, seed: int, image=None, negative=NEGATIVE, **placed):
    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline

    placements = {"transformer": "stream", **placed}  # the rest placed for its phase
    with one_thread():
        built = build_pipeline(spec, placements, STREAM, torch.device("cpu"), weights=folder, image=image is not None)
        try:
            gen = generate(built, spec.default_workload, PROMPT, negative=negative, steps=2, seed=seed, image=image)
        finally:
            built.discard()
    return built, gen


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-any")
    return {"sd3": _sd3(root / "sd3"), "cogvideox": _cogvideox(root / "cogvideox"), "ltx": _ltx(root / "ltx"),
            "root": root}


# ------------------------------------------------------------------------------- uncatalogued pipelines


@pytest.mark.parametrize("name", ["sd3", "cogvideox", "ltx"])
def test_an_uncatalogued_pipeline_runs_through_chunkflow_with_diffusers_latents(saved, name):
    """SD3, CogVideoX and LTX-Video: the class from model_index.json, every component from the folder, the call
    filtered by the class's signature; the latents are diffusers' own, bit for bit."""
    spec, call = saved[name]
    folder = saved["root"] / name
    built, gen = _chunkflow(spec, folder, seed=7)
    loop, out = _diffusers(spec.pipeline.cls, folder, 7, **call)
    assert type(built.pipe).__name__ == spec.pipeline.cls
    assert gen.latents is not None and torch.equal(gen.latents, loop) and torch.equal(gen.latents, out)
    assert set(gen.phases) == {"encode", "denoise", "decode"} and len(gen.step_times_s) == 2


def test_a_generic_call_takes_only_what_the_class_takes(saved):
    """SD3's call gets no num_frames (an image model), CogVideoX's no true_cfg_scale; each kwarg is a parameter."""
    import inspect

    import diffusers

    from chunkflow.models.adapters import call_kwargs

    for name in ("sd3", "cogvideox", "ltx"):
        spec, _ = saved[name]
        cls = getattr(diffusers, spec.pipeline.cls)
        kw = call_kwargs(spec, cls, spec.default_workload, PROMPT, None, None, 2, None)
        assert set(kw) <= set(inspect.signature(cls.__call__).parameters)
        assert ("num_frames" in kw) == spec.is_video and kw["output_type"] == "np"


# ------------------------------------------------------------------------------------- image to video


@pytest.mark.parametrize("where", ["phase", "cpu"])
def test_wan_image_to_video_through_the_api_gives_diffusers_latents(saved, tmp_path, where):
    """A Wan2.1-style image-to-video folder (image encoder and image processor): built with image=True, generated
    from an image file; the latents are WanImageToVideoPipeline's own from the same folder, image and seed, with
    the image encoder placed for its phase (the default) or on the CPU."""
    _needs_ftfy()
    from PIL import Image

    base = save_catalog_pipeline("tiny", tmp_path / "t2v")
    folder = tmp_path / "i2v"
    spec = _wan_i2v(folder, base)
    picture = _image(tmp_path / "in.png")
    placed = {} if where == "phase" else {"image_encoder": where}
    built, gen = _chunkflow(spec, folder, seed=3, image=picture, **placed)
    assert built.extra_models == ["image_encoder"] and built.placements["image_encoder"] == where
    w = spec.default_workload
    loop, out = _diffusers("WanImageToVideoPipeline", folder, 3, image=Image.open(picture).convert("RGB"),
                           negative_prompt=NEGATIVE, height=w.height, width=w.width, num_frames=w.frames,
                           guidance_scale=5.0, max_sequence_length=8)
    assert torch.equal(gen.latents, loop) and torch.equal(gen.latents, out)
    assert "image_encoder" in gen.phases["encode"].parts_s  # its forward timed in the encode phase


def _ti2v(cli, workdir) -> tuple[Path, Path]:
    folder = save_catalog_pipeline("tiny-ti2v", workdir / "ti2v")
    result = cli("plan", "--model", "tiny-ti2v", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json", folder


def test_run_image_animates_a_wan_ti2v_folder_with_diffusers_latents(cli, workdir):
    """`run --image` with a Wan2.2-TI2V-style folder (a WanPipeline with expand_timesteps, as the Hub ships
    Wan2.2-TI2V-5B): the run makes WanImageToVideoPipeline of it; the latents are that pipeline's own from the
    same folder, image and seed (the loop's last: expand_timesteps mixes the image's latents in after it)."""
    _needs_ftfy()
    from PIL import Image

    plan, folder = _ti2v(cli, workdir)
    picture = _image(workdir / "cat.png", size=(72, 56))
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", folder, "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                     "--image", picture, "--seed", "5", "--latents", "l.safetensors", "--out", "v.mp4")
    assert result.exit_code == 0, result.output
    assert "does not price the image's encode" in " ".join(result.output.split())  # what the plan cannot promise
    w = get_model("tiny-ti2v").default_workload
    loop, _ = _diffusers("WanImageToVideoPipeline", folder, 5, image=Image.open(picture).convert("RGB"),
                         negative_prompt=NEGATIVE, height=w.height, width=w.width, num_frames=w.frames,
                         guidance_scale=5.0, max_sequence_length=8)
    assert torch.equal(load_file("l.safetensors")["latents"], loop)
    assert Path("v.mp4").stat().st_size > 0
    with one_thread():  # the same image through the API (random-weight-free: the folder's)
        _, gen = _chunkflow(get_model("tiny-ti2v"), folder, seed=5, image=picture)
    assert torch.equal(gen.latents, loop)


# ------------------------------------------------------------------------- refused before the load


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares width x height pixels, with one tiny (wrong) data chunk: what a decompression
    bomb looks like before it is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
                     + chunk(b"IEND", b""))
    return path


def _truncated(path: Path) -> Path:
    """A PNG cut short in its pixel data."""
    _image(path, size=(64, 64))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


HOSTILE = {
    "missing": (lambda d: d / "nowhere.png", "does not exist"),
    "not an image": (lambda d: (d / "notes.png").write_text("hello, not a picture") and d / "notes.png",
                     "not an image PIL can read"),
    "zero bytes": (lambda d: (d / "empty.png").write_bytes(b"") or d / "empty.png", "is empty (0 bytes)"),
    "huge dimensions": (lambda d: _png_header(d / "bomb.png", 100_000, 100_000),
                        "declares 10,000,000,000 pixels, beyond what an input image may be"),
    "large dimensions": (lambda d: _png_header(d / "large.png", 20_000, 100), "20000 x 100 pixels, beyond"),
    "a directory": (lambda d: (d / "dir.png").mkdir() or d / "dir.png", "is a directory"),
    "truncated": (lambda d: _truncated(d / "cut.png"), "cannot be decoded"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_image_is_refused_before_the_load_with_one_message(cli, workdir, case):
    make, said = HOSTILE[case]
    result = cli("plan", "--model", "tiny-ti2v", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    path = make(workdir)
    result = cli("run", "--plan", "plan.json", "--prompt", PROMPT, "--image", path)
    assert result.exit_code != 0 and said in result.output, result.output
    assert "Traceback" not in result.output and "load" not in result.output
    assert "--image" in result.output


def test_image_and_pipeline_that_do_not_fit_are_refused_before_the_load(cli, workdir):
    """--image for a pipeline of no image (FLUX: several image pipelines, none chosen), --image for a text-to-video
    Wan (its transformer takes the latents' channels only), and a folder of an image pipeline without --image."""
    picture = _image(workdir / "in.png")
    for model, said in (("tiny-flux", "FluxPipeline takes no image"), ("tiny", "it is a text-to-video model")):
        result = cli("plan", "--model", model, "--hardware", "cpu", "--out", f"{model}.json")
        assert result.exit_code == 0, result.output
        result = cli("run", "--plan", f"{model}.json", "--prompt", PROMPT, "--image", picture)
        assert result.exit_code != 0 and said in result.output, result.output
        assert "Traceback" not in result.output and "load" not in result.output
    plan, folder = _ti2v(cli, workdir)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "WanImageToVideoPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    result = cli("run", "--plan", plan, "--weights", folder, "--prompt", PROMPT)
    assert result.exit_code != 0 and "give it with --image PATH" in result.output, result.output
    assert "Traceback" not in result.output and "load" not in result.output


def test_a_folder_of_another_model_is_refused_before_the_load(cli, workdir, saved):
    """A FLUX plan given an SD3 folder, and the tiny Wan plan given a Wan folder whose UMT5 is smaller: refused
    before the load and its progress bar, naming both."""
    result = cli("plan", "--model", "tiny-flux", "--hardware", "cpu", "--out", "flux.json")
    assert result.exit_code == 0, result.output
    result = cli("run", "--plan", "flux.json", "--weights", saved["root"] / "sd3", "--prompt", PROMPT)
    assert result.exit_code != 0, result.output
    assert "StableDiffusion3Pipeline" in result.output and "FluxPipeline" in result.output
    assert "Traceback" not in result.output and "load" not in result.output
    folder = save_catalog_pipeline("tiny", workdir / "wan")
    cfg = json.loads((folder / "text_encoder" / "config.json").read_text())
    cfg["num_layers"] = 1
    (folder / "text_encoder" / "config.json").write_text(json.dumps(cfg))
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "wan.json")
    assert result.exit_code == 0, result.output
    result = cli("run", "--plan", "wan.json", "--weights", folder, "--prompt", PROMPT)
    assert result.exit_code != 0 and "UMT5EncoderModel" in result.output and "28,896" in result.output, result.output
    assert "Traceback" not in result.output and "load" not in result.output


def test_run_image_edits_with_a_flux_kontext_folder_for_a_flux_plan(cli, workdir):
    """An edit pipeline: a FluxKontextPipeline folder (tiny-flux's components) run for a tiny-flux plan with
    --image; the latents are FluxKontextPipeline's own from the same folder, image and seed."""
    import diffusers
    from PIL import Image

    flux = save_catalog_pipeline("tiny-flux", workdir / "flux")
    parts = diffusers.FluxPipeline.from_pretrained(flux, torch_dtype=torch.bfloat16).components
    diffusers.FluxKontextPipeline(**parts).save_pretrained(workdir / "kontext")
    result = cli("plan", "--model", "tiny-flux", "--hardware", "cpu", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    picture = _image(workdir / "in.png", size=(64, 48))
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", workdir / "kontext", "--prompt", PROMPT, "--image",
                     picture, "--seed", "2", "--latents", "l.safetensors")
    assert result.exit_code == 0, result.output
    w = get_model("tiny-flux").default_workload
    loop, out = _diffusers("FluxKontextPipeline", workdir / "kontext", 2, dtypes=torch.bfloat16,
                           image=Image.open(picture).convert("RGB"), height=w.height, width=w.width,
                           guidance_scale=3.5, max_sequence_length=8)
    assert torch.equal(load_file("l.safetensors")["latents"], loop) and torch.equal(loop, out)


def test_the_api_refuses_an_image_the_built_pipeline_cannot_take_and_checks_a_path(workdir):
    """generate(image=...) on a text-to-video build, and none on an image build, are refused before the call; a path
    is checked as run --image checks it."""
    _needs_ftfy()
    from chunkflow.generate import GenerationError, generate
    from chunkflow.media import MediaError
    from chunkflow.models.pipeline_build import build_pipeline

    spec = get_model("tiny-ti2v")
    picture = _image(workdir / "in.png")
    (workdir / "empty.png").write_bytes(b"")
    with one_thread():
        for image, cls in ((True, "WanImageToVideoPipeline"), (False, "WanPipeline")):
            built = build_pipeline(spec, {}, STREAM, torch.device("cpu"), image=image)
            try:
                assert type(built.pipe).__name__ == cls
                with pytest.raises(GenerationError, match="give it" if image else "takes no image"):
                    generate(built, spec.default_workload, PROMPT, image=None if image else picture)
                if image:
                    with pytest.raises(MediaError, match="is empty"):
                        generate(built, spec.default_workload, PROMPT, image=workdir / "empty.png")
            finally:
                built.discard()


# ------------------------------------------------------------------------------------ plan then run


@pytest.mark.parametrize("name", ["sd3", "cogvideox", "ltx"])
def test_a_folder_chunkflow_never_saw_is_planned_from_its_configs_and_run_with_diffusers_latents(cli, workdir,
                                                                                               saved, name):
    """What a user does with a pipeline the catalog lacks: `plan --weights DIR` (the model derived from its
    folder, embedded in the plan), then `run --plan plan.json --weights DIR --prompt ...`: the latents are diffusers'
    own pipeline's from the same folder and seed, bit for bit."""
    spec, call = saved[name]
    folder = saved["root"] / name
    w = spec.default_workload
    shape = ["--height", str(w.height), "--width", str(w.width), "--steps", "2", "--text-len",
             str(spec.pipeline.text_encoders[-1].tokens)] + (["--frames", str(w.frames)] if spec.is_video else [])
    result = cli("plan", "--weights", str(folder), "--hardware", "cpu", "--out", "plan.json", *shape)
    assert result.exit_code == 0, result.output
    assert "derived" in result.output
    assert json.loads(Path("plan.json").read_text())["model"]["spec"]["pipeline"]["cls"] == spec.pipeline.cls
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", str(folder), "--prompt", PROMPT, "--negative-prompt",
                     NEGATIVE, "--seed", "7", "--latents", "l.safetensors")
    assert result.exit_code == 0, result.output
    loop, _ = _diffusers(spec.pipeline.cls, folder, 7, **call)
    assert torch.equal(load_file("l.safetensors")["latents"], loop)


def test_an_image_to_video_folder_chunkflow_never_saw_is_planned_and_run_with_an_image(cli, workdir):
    """A Wan2.1-style image-to-video folder (image encoder, image processor): planned from its folder and run with
    `--image`; the latents are WanImageToVideoPipeline's own from the same folder, image and seed."""
    _needs_ftfy()
    from PIL import Image

    folder = workdir / "i2v"
    spec = _wan_i2v(folder, save_catalog_pipeline("tiny", workdir / "t2v"))
    w = spec.default_workload
    result = cli("plan", "--weights", str(folder), "--hardware", "cpu", "--out", "plan.json", "--height",
                 str(w.height), "--width", str(w.width), "--frames", str(w.frames), "--steps", "2", "--text-len", "8")
    assert result.exit_code == 0, result.output
    picture = _image(workdir / "in.png")
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", str(folder), "--prompt", PROMPT, "--negative-prompt",
                     NEGATIVE, "--image", str(picture), "--seed", "3", "--latents", "l.safetensors")
    assert result.exit_code == 0, result.output
    loop, _ = _diffusers("WanImageToVideoPipeline", folder, 3, image=Image.open(picture).convert("RGB"),
                         negative_prompt=NEGATIVE, height=w.height, width=w.width, num_frames=w.frames,
                         guidance_scale=5.0, max_sequence_length=8)
    assert torch.equal(load_file("l.safetensors")["latents"], loop)


def test_a_tiled_decode_leaves_the_images_encode_untiled(workdir):
    """A plan that tiles the VAE's decode (vae_tiling) encodes the image as diffusers does, untiled: the latents are
    WanImageToVideoPipeline's own at a size past the VAE's tile (tiling the encode too changed them on an H200)."""
    _needs_ftfy()
    from PIL import Image

    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.workload import make_workload

    spec = get_model("tiny-ti2v")
    folder = save_catalog_pipeline("tiny-ti2v", workdir / "ti2v")
    picture = _image(workdir / "big.png", size=(320, 288))
    w = make_workload(spec, height=288, width=320, frames=5, steps=2)
    with one_thread():
        built = build_pipeline(spec, {}, STREAM, torch.device("cpu"), weights=folder, image=True, vae_tiling=True)
        assert built.pipe.vae.use_tiling and built.pipe.vae.tile_sample_min_height < 288  # the image spans tiles
        try:
            gen = generate(built, w, PROMPT, negative=NEGATIVE, steps=2, seed=4, image=picture)
        finally:
            built.discard()
    loop, _ = _diffusers("WanImageToVideoPipeline", folder, 4, image=Image.open(picture).convert("RGB"),
                         negative_prompt=NEGATIVE, height=288, width=320, num_frames=5, guidance_scale=5.0,
                         max_sequence_length=8)
    assert torch.equal(gen.latents, loop)


def test_sd3_with_its_clip_towers_streamed_from_its_folder_gives_diffusers_latents(saved):
    """A 6 GB SD3 plan streams CLIP-L, whose layers sit at text_model.encoder.layers, three levels down: found there
    (an H100 run from a saved folder failed at load with 'found no block list'), streamed from the folder saved with
    save_pretrained, and the latents are diffusers' own, bit for bit."""
    spec, call = saved["sd3"]
    folder = saved["root"] / "sd3"
    built, gen = _chunkflow(spec, folder, seed=7, text_encoder="stream", text_encoder_2="stream")
    assert built.placements["text_encoder"] == built.placements["text_encoder_2"] == "stream"
    loop, _ = _diffusers(spec.pipeline.cls, folder, 7, **call)
    assert torch.equal(gen.latents, loop)
