"""Hostile input, round five (issue 51): a folder's own invalid config, every value of the right type, was an
"internal error ... a bug in chunkflow". Seen with Sana, PixArt-Alpha, Allegro and FLUX Fill: each here as a tiny
pipeline of the real diffusers classes, written with save_pretrained, then one config.json edited. Through the CLI
in a process of its own, `plan --weights DIR` then `run --plan --weights DIR --prompt ... --device cpu`: exit 2, one
line naming the component and its config file, what diffusers said and what to do; no traceback, no internal error.

What the load cannot see fails in the pipeline's call: a transformer's sample_size no size bin of the pipeline takes
(its own code raises), a scheduler of 0 training timesteps (the scheduler raises), Allegro heads that split the width
into parts its 3-axis rotary embedding cannot take (the transformer raises), a VAE temporal ratio of 0 (the
pipeline divides by it). What the load sees (a tensor of another shape than the config makes) is said before any
weight is read. A genuine chunkflow bug that surfaces inside diffusers code stays an internal error."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_bad_input_3 import _chunkflow  # noqa: E402

from pipelines import _clip, _seeded, _t5, one_thread

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from chunkflow.models.tokenizers import EXTRA_WORDS, clip_tokenizer, t5_tokenizer  # noqa: E402

# the size the plan and run ask for (Sana's VAE compresses 32x), and a video's frames
SIZES = {"sana": ["--height", "64", "--width", "64"], "pixart": ["--height", "32", "--width", "32"],
         "allegro": ["--height", "32", "--width", "32", "--frames", "5"],
         "flux_fill": ["--height", "32", "--width", "32"]}
OUT = {"allegro": "out.mp4"}


# ---------------------------------------------------------------------------------------- tiny folders


def _gemma_tokenizer():
    """GemmaTokenizer (the class SanaPipeline declares) over a word vocabulary: the prompts' words, whole."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for word in EXTRA_WORDS.split():
        vocab.setdefault(word, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], padding_side="right")


def _kl_vae(seed: int, **kw):
    from diffusers import AutoencoderKL

    return _seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, **kw))


def _sana():
    """Sana: Gemma2, a 32x deep-compression VAE, sample_size 16 (the pipeline's 512 px size bin)."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tok = _gemma_tokenizer()
    text = _seeded(1, lambda: Gemma2Model(Gemma2Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, pad_token_id=0)))
    transformer = _seeded(2, lambda: SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
        sample_size=16))
    blocks = ("ResBlock",) * 5 + ("EfficientViTBlock",)
    vae = _seeded(3, lambda: AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=blocks,
        decoder_block_types=blocks, encoder_block_out_channels=(8,) * 6, decoder_block_out_channels=(8,) * 6,
        encoder_qkv_multiscales=((),) * 5 + ((5,),), decoder_qkv_multiscales=((),) * 5 + ((5,),),
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6, downsample_block_type="conv",
        upsample_block_type="interpolate", scaling_factor=0.41407))
    return SanaPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=transformer,
                        scheduler=DPMSolverMultistepScheduler())


def _pixart():
    """PixArt-Alpha: T5, sample_size 64 (the pipeline's 512 px size bin)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    tok = t5_tokenizer()
    transformer = _seeded(2, lambda: PixArtTransformer2DModel(
        sample_size=64, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=2, caption_channels=16,
        in_channels=4, cross_attention_dim=16, out_channels=8))
    return PixArtAlphaPipeline(tokenizer=tok, text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"),
                               vae=_kl_vae(3), transformer=transformer, scheduler=DPMSolverMultistepScheduler())


def _allegro():
    """Allegro: T5, heads of 12 (its rotary embedding cuts each in three), the Allegro VAE."""
    from diffusers import (AllegroPipeline, AllegroTransformer3DModel, AutoencoderKLAllegro,
                           EulerAncestralDiscreteScheduler)

    tok = t5_tokenizer()
    transformer = _seeded(2, lambda: AllegroTransformer3DModel(
        num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=2,
        cross_attention_dim=24, sample_height=8, sample_width=8, sample_frames=2, caption_channels=16))
    vae = _seeded(3, lambda: AutoencoderKLAllegro(
        in_channels=3, out_channels=3, down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4, sample_size=32))
    return AllegroPipeline(tokenizer=tok, text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"), vae=vae,
                           transformer=transformer, scheduler=EulerAncestralDiscreteScheduler())


def _flux_fill():
    """FLUX Fill: in_channels 288 = packed latents (16) + packed masked-image latents (16) + packed mask (256)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxFillPipeline, FluxTransformer2DModel

    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    transformer = _seeded(2, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=16 + 16 + 256, out_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)))
    vae = _kl_vae(3, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    return FluxFillPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=_clip(tok, 1, 16),
                            tokenizer=tok, text_encoder_2=_t5(tok2, 1, d_model=32, t5_class="T5EncoderModel"),
                            tokenizer_2=tok2, transformer=transformer)


BUILDERS = {"sana": _sana, "pixart": _pixart, "allegro": _allegro, "flux_fill": _flux_fill}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Each pipeline saved once, its models in bfloat16 (PixArt's and Allegro's VAEs too: their pipelines decode the
    transformer's latents as they are)."""
    root = tmp_path_factory.mktemp("folders")
    out = {}
    with one_thread():
        for name, build in BUILDERS.items():
            pipe = build()
            for slot, c in pipe.components.items():
                if isinstance(c, torch.nn.Module) and (slot != "vae" or name in ("pixart", "allegro")):
                    c.to(torch.bfloat16)
            pipe.save_pretrained(root / name)
            out[name] = root / name
    return out


def _edited(saved: dict[str, Path], name: str, where: Path, config: str, **changes) -> Path:
    """A copy of the saved `name` pipeline in `where` with `changes` made to its `config` (component/file)."""
    folder = Path(shutil.copytree(saved[name], where / f"{name}-edited"))
    path = folder / config
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return folder


def _plan(name: str, folder: Path, workdir: Path) -> subprocess.CompletedProcess:
    return _chunkflow(["plan", "--weights", folder, "--hardware", "cpu", *SIZES[name], "--steps", "2", "--text-len",
                       "8", "--out", "plan.json"], workdir, timeout=300)


def _run(name: str, folder: Path, workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    return _chunkflow(["run", "--plan", "plan.json", "--weights", folder, "--prompt", "a cat", "--device", "cpu",
                       "--steps", "2", "--out", OUT.get(name, "out.png"), *extra], workdir, timeout=300)


def _the_folders(p: subprocess.CompletedProcess, *says: str) -> str:
    """`p` ended with exit 2 on exactly one `error:` line holding each of `says`, no traceback, no internal error,
    no word of a bug; returns the line."""
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "Traceback" not in out and "internal error" not in out and "bug" not in out, out
    errors = [line for line in out.splitlines() if line.lstrip().startswith("error:")]
    assert len(errors) == 1, out
    for say in says:
        assert say in errors[0], errors[0]
    return errors[0]


# ------------------------------------------------------------------------------------- what the call meets


@pytest.mark.slow
@pytest.mark.parametrize("name,config,changes,says", [
    ("sana", "transformer/config.json", {"sample_size": 8},
     ["transformer/config.json sample_size = 8", "SanaPipeline", "ValueError: Invalid sample size"]),
    ("pixart", "scheduler/scheduler_config.json", {"num_train_timesteps": 0},
     ["scheduler/scheduler_config.json", "DPMSolverMultistepScheduler", "ValueError"]),
    ("allegro", "transformer/config.json", {"num_attention_heads": 3, "attention_head_dim": 8},
     ["transformer/config.json", "AllegroTransformer3DModel", "RuntimeError: The size of tensor"]),
    ("allegro", "vae/config.json", {"temporal_compression_ratio": 0},
     ["vae/config.json temporal_compression_ratio = 0", "AllegroPipeline", "ZeroDivisionError"]),
], ids=["sana sample_size 8", "pixart 0 training timesteps", "allegro heads 3x8", "allegro vae temporal ratio 0"])
def test_a_value_the_call_fails_on_is_the_folders_error(workdir, saved, name, config, changes, says):
    """Each value is one its class takes (the plan is made from the folder), but the pipeline's call fails on it in
    diffusers itself: one line naming the component's config file, what diffusers said and what to do, exit 2."""
    folder = _edited(saved, name, workdir, config, **changes)
    planned = _plan(name, folder, workdir)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    line = _the_folders(_run(name, folder, workdir), *says)
    assert "without chunkflow" in line and "download the folder again" in line, line
    assert str(folder) in line, line


@pytest.mark.slow
def test_flux_fill_whose_transformer_config_is_not_its_tensors_is_said_before_the_load(workdir, saved):
    """FLUX Fill's transformer config.json edited to in_channels 384 (the full-size model's) over tensors of 288: the
    plan is made from the config, the run says which tensor and that config.json does not match it, before any
    weight is read (then, for the folder as saved, that chunkflow gives FLUX Fill no mask)."""
    folder = _edited(saved, "flux_fill", workdir, "transformer/config.json", in_channels=384)
    planned = _plan("flux_fill", folder, workdir)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    ran = _run("flux_fill", folder, workdir)
    _the_folders(ran, "transformer", "x_embedder.weight", "[32, 288]", "[32, 384]", "config.json",
                 "download or save the folder again")
    assert not any(line.startswith("load ") for line in ran.stderr.splitlines()), ran.stderr  # no load's bar
    planned = _plan("flux_fill", saved["flux_fill"], workdir)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    _the_folders(_run("flux_fill", saved["flux_fill"], workdir), "FluxFillPipeline", "mask_image",
                 "chunkflow gives no mask")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sana", "pixart", "allegro", "flux_fill"])
def test_a_vae_config_that_builds_no_vae_is_the_folders_error_in_plan_and_run(workdir, saved, name):
    """A VAE config.json whose block lists disagree in length (one entry of a list dropped: the Allegro VAE's
    block_out_channels against its down_block_types, as in the issue): `plan --weights` and `run` with the
    folder's valid plan each say the VAE's config.json does not make its class, in one line."""
    planned = _plan(name, saved[name], workdir)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    key = "encoder_block_types" if name == "sana" else "block_out_channels"
    vae = json.loads((saved[name] / "vae" / "config.json").read_text())
    folder = _edited(saved, name, workdir, "vae/config.json", **{key: vae[key][:-1]})
    _the_folders(_run(name, folder, workdir), "vae", "config.json", "download or save the pipeline again")
    Path(workdir / "plan.json").unlink()
    _the_folders(_plan(name, folder, workdir), "VAE", "config.json", "re-download or re-save it")
    assert not (workdir / "plan.json").exists()


# --------------------------------------------------------------------------------------- chunkflow's own bug


def test_a_chunkflow_bug_inside_diffusers_code_stays_an_internal_error(cli, workdir, saved, monkeypatch):
    """The PixArt folder as saved runs; with a bug put into chunkflow's block call (every streamed block given its
    input one channel short) the failure is raised in diffusers' code, but the transformer made again without
    chunkflow from the same config and the same arguments does not fail: an internal error, exit 1."""
    from chunkflow.runtime import hooks

    with one_thread():
        result = cli("plan", "--weights", saved["pixart"], "--hardware", "cpu", *SIZES["pixart"], "--steps", "2",
                     "--text-len", "8", "--out", "plan.json")
        assert result.exit_code == 0, result.output
        plan = json.loads(Path("plan.json").read_text())  # the transformer's blocks streamed, through the hooks
        for c in plan["pipeline"]["components"]:
            c["placement"] = "stream" if c["kind"] == "transformer" else c["placement"]
        plan["offload"].update(mode="chunkflow", chunk_bytes=16000, residency=0.0)
        Path("plan.json").write_text(json.dumps(plan))
        args = ["run", "--plan", "plan.json", "--weights", saved["pixart"], "--prompt", "a cat", "--device", "cpu",
                "--steps", "2"]
        result = cli(*args, "--out", "ok.png")
        assert result.exit_code == 0, result.output
        run_block = hooks._run_block

        def one_channel_short(self, base, hook, args, kwargs):
            if args:
                args = (args[0][..., :-1], *args[1:])
            else:
                kwargs = dict(kwargs, hidden_states=kwargs["hidden_states"][..., :-1])
            return run_block(self, base, hook, args, kwargs)

        monkeypatch.setattr(hooks, "_run_block", one_channel_short)
        result = cli(*args, "--out", "bug.png")
    assert result.exit_code == 1, result.output
    assert "internal error:" in result.output and "This is a bug in chunkflow" in result.output, result.output
    assert "without chunkflow" not in result.output and not Path("bug.png").exists()


def test_a_chunkflow_bug_in_the_calls_arguments_stays_an_internal_error(cli, workdir, saved, monkeypatch):
    """With a bug put into the arguments chunkflow calls the pipeline with (a height one pixel off), AllegroPipeline's
    own code refuses it in a statement that reads no config value of the folder: an internal error, exit 1, not
    the folder's."""
    import chunkflow.generate as generate

    result = cli("plan", "--weights", saved["allegro"], "--hardware", "cpu", *SIZES["allegro"], "--steps", "2",
                 "--text-len", "8", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    call_kwargs = generate.call_kwargs

    def one_pixel_off(*args, **kwargs):
        kw = call_kwargs(*args, **kwargs)
        return dict(kw, height=kw["height"] + 1)

    monkeypatch.setattr(generate, "call_kwargs", one_pixel_off)
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", saved["allegro"], "--prompt", "a cat", "--device",
                     "cpu", "--steps", "2", "--out", "bug.mp4")
    assert result.exit_code == 1, result.output
    assert "internal error: ValueError" in result.output and "divisible by 8" in result.output, result.output
    assert "without chunkflow" not in result.output and not Path("bug.mp4").exists()
