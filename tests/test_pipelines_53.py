"""Issue 53 item 9: pipelines that failed after the load or silently, on tiny real diffusers folders saved with
save_pretrained: PixArt's steps are timed and its `run --latents` written through its older step callback; Latte's frames (`video_length`) are planned and run as --frames; Bria with DDIM (whose branch passes no
sigmas or mu to set_timesteps) is run, with diffusers' latents."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines import _seeded, _t5, one_thread, t5_tokenizer

pytest.importorskip("diffusers")


def _latte(folder: Path) -> Path:
    """A tiny Latte folder: LattePipeline counts frames as `video_length`; its 2D VAE decodes frame by frame (saved
    in bf16, as diffusers' from_pretrained(torch_dtype=bf16) runs it: Latte decodes with the latents' dtype)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, LattePipeline, LatteTransformer3DModel

    from test_run_any import _save

    tok = t5_tokenizer()
    transformer = _seeded(0, lambda: LatteTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=16, caption_channels=16, sample_size=8, patch_size=2, norm_type="ada_norm_single",
        video_length=4))
    vae = _seeded(2, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
        norm_num_groups=4, sample_size=32))
    pipe = LattePipeline(tokenizer=tok, text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"), vae=vae,
                         transformer=transformer, scheduler=DDIMScheduler())
    return _save(pipe, folder, vae=torch.bfloat16)


@pytest.mark.slow
def test_latte_frames_are_its_video_length_planned_and_run_with_diffusers_latents(cli, workdir):
    """Latte's frames: the plan prices the pipeline's default video_length (16), not 1 frame; --frames 4 is taken,
    priced as 4 frames, and run as video_length=4 with diffusers' own latents, bit for bit."""
    import json

    import torch
    from safetensors.torch import load_file

    from test_run_any import PROMPT, _diffusers

    folder = _latte(workdir / "latte")
    shape = ["--hardware", "cpu", "--height", "32", "--width", "32", "--steps", "2", "--text-len", "16"]
    r = cli("plan", "--weights", folder, *shape, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["workload"]["frames"] == 16
    r = cli("plan", "--weights", folder, *shape, "--frames", "4", "--out", "plan.json")
    assert r.exit_code == 0, r.output
    assert json.loads(Path("plan.json").read_text())["workload"]["frames"] == 4
    with one_thread():
        r = cli("run", "--plan", "plan.json", "--weights", folder, "--prompt", PROMPT, "--seed", "7", "--latents",
                "l.safetensors", "--out", "latte.mp4")
    assert r.exit_code == 0, r.output
    guidance = json.loads(Path("plan.json").read_text())["model"]["spec"]["pipeline"]["guidance"]
    loop, _ = _diffusers("LattePipeline", folder, 7, dtypes=torch.bfloat16, height=32, width=32, video_length=4,
                         guidance_scale=guidance)
    got = load_file("l.safetensors")["latents"]
    assert got.shape[2] == 4 and torch.equal(got, loop)


def _pixart(folder: Path, heads: int = 2, head_dim: int = 8) -> Path:
    """A small PixArt-Sigma pipeline saved with save_pretrained (hidden size heads x head_dim, its cross-attention
    width the same)."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    from test_run_any import _save

    tok = t5_tokenizer()
    transformer = _seeded(0, lambda: PixArtTransformer2DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=heads * head_dim, caption_channels=16, sample_size=32, patch_size=2,
        norm_type="ada_norm_single",
        use_additional_conditions=False))
    vae = _seeded(2, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
        norm_num_groups=4, sample_size=32))
    pipe = PixArtSigmaPipeline(tokenizer=tok, text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"),
                               vae=vae, transformer=transformer, scheduler=DPMSolverMultistepScheduler())
    return _save(pipe, folder)


@pytest.mark.slow
def test_pixart_steps_are_timed_and_its_latents_are_diffusers_own(cli, workdir):
    """PixArt's pipelines hand the latents to the older `callback(step, timestep, latents)`: each step is timed
    there (the report's steps were one, the whole phase, 20x a step's prediction on an H100) and `run --latents`
    writes diffusers' own latents, bit for bit."""
    import json

    import torch
    from safetensors.torch import load_file

    from diffusers import PixArtSigmaPipeline

    from test_run_any import PROMPT

    folder = _pixart(workdir / "pixart")
    r = cli("plan", "--weights", folder, "--hardware", "cpu", "--height", "32", "--width", "32", "--steps", "3",
            "--out", "plan.json")
    assert r.exit_code == 0, r.output
    with one_thread():
        r = cli("run", "--plan", "plan.json", "--weights", folder, "--prompt", PROMPT, "--seed", "7", "--out",
                "fox.png", "--latents", "l.safetensors", "--report", "report.json")
    assert r.exit_code == 0, r.output
    assert Path("fox.png").stat().st_size > 0
    assert len(json.loads(Path("report.json").read_text())["measured"]["step_times_s"]) == 3
    guidance = json.loads(Path("plan.json").read_text())["model"]["spec"]["pipeline"]["guidance"]
    pipe = PixArtSigmaPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    with one_thread(), torch.no_grad():  # output_type="latent": the denoising loop's last latents
        ref = pipe(prompt=PROMPT, num_inference_steps=3, generator=torch.Generator("cpu").manual_seed(7), height=32,
                   width=32, guidance_scale=guidance, output_type="latent").images
    assert torch.equal(load_file("l.safetensors")["latents"], ref)


def _bria(folder: Path) -> Path:
    from diffusers import AutoencoderKL, BriaPipeline, BriaTransformer2DModel, DDIMScheduler

    from test_run_any import _save

    tok = t5_tokenizer()
    transformer = _seeded(0, lambda: BriaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=[2, 2, 4]))
    vae = _seeded(2, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
        norm_num_groups=4, sample_size=32))
    pipe = BriaPipeline(tokenizer=tok, text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"), vae=vae,
                        transformer=transformer, scheduler=DDIMScheduler())
    return _save(pipe, folder)


def test_the_scheduler_check_follows_the_pipelines_isinstance_branches():
    """BriaPipeline asks set_timesteps for mu and sigmas only in branches other schedulers take: DDIM is asked for
    neither, FlowMatchEuler for both, a scheduler of its last branch for sigmas."""
    import diffusers

    from chunkflow.models.slots import scheduler_calls

    assert scheduler_calls("BriaPipeline", diffusers.DDIMScheduler)[1] == ()
    assert scheduler_calls("BriaPipeline", diffusers.FlowMatchEulerDiscreteScheduler)[1] == ("mu", "sigmas")
    assert scheduler_calls("BriaPipeline", diffusers.DPMSolverMultistepScheduler)[1] == ("sigmas",)
    assert scheduler_calls("BriaPipeline")[1] == ("mu", "sigmas")  # no class: every branch


@pytest.mark.slow
def test_a_bria_folder_with_ddim_runs_with_diffusers_latents(cli, workdir):
    import torch
    from safetensors.torch import load_file

    from test_run_any import PROMPT, _diffusers

    folder = _bria(workdir / "bria")
    r = cli("plan", "--weights", folder, "--hardware", "cpu", "--height", "32", "--width", "32", "--steps", "2",
            "--text-len", "16", "--out", "plan.json")
    assert r.exit_code == 0, r.output
    with one_thread():
        r = cli("run", "--plan", "plan.json", "--weights", folder, "--prompt", PROMPT, "--seed", "7", "--latents",
                "l.safetensors", "--out", "bria.png")
    assert r.exit_code == 0, r.output
    import json

    guidance = json.loads(Path("plan.json").read_text())["model"]["spec"]["pipeline"]["guidance"]
    loop, _ = _diffusers("BriaPipeline", folder, 7, height=32, width=32, guidance_scale=guidance,
                         max_sequence_length=16)
    assert torch.equal(load_file("l.safetensors")["latents"], loop)
