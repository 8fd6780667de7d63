"""Save a full-size pipeline chunkflow's catalog has never had, in its real architecture with random values, as a
diffusers folder: what a user downloads from the Hub (same classes, configs and layout), only the values differ.

    python3 scripts/save_uncatalogued.py ltx-video /data/ltx-video [--device cuda]
    python3 scripts/save_uncatalogued.py cogvideox-5b /data/cogvideox-5b
    python3 scripts/save_uncatalogued.py pixart-sigma /data/pixart-sigma
    python3 scripts/save_uncatalogued.py sd3-medium /data/sd3-medium
    python3 scripts/save_uncatalogued.py allegro /data/allegro
    python3 scripts/save_uncatalogued.py mochi /data/mochi --share-with /data/pixart-sigma

Every pipeline draws its T5 first from seed 0, so their T5 files are the same bytes: `--share-with DIR` hard-links
each saved file that DIR holds byte for byte under the same name (three folders of 55 GB take 36 GB of disk).

The configs are those of the public checkpoints (Lightricks/LTX-Video 0.9.0: diffusers' defaults for its classes;
THUDM/CogVideoX-5b: its transformer/config.json, the VAE's scaling factor 0.7 and its CogVideoXDPMScheduler;
PixArt-alpha/PixArt-Sigma-XL-2-1024-MS: its transformer/config.json and SDXL's VAE config;
stabilityai/stable-diffusion-3-medium-diffusers: its transformer and VAE configs, CLIP ViT-L/14 and OpenCLIP bigG/14
text towers with projections; rhymes-ai/Allegro and genmo/mochi-1-preview: diffusers' defaults for their transformer
and VAE classes), with
google/t5-v1_1-xxl as the (last) text encoder of each. CLIP's tokenizer is chunkflow's local one too. The tokenizer is chunkflow's local T5 tokenizer (a small vocabulary:
token ids stay inside the encoder's). Each component is drawn on the device in bf16, as `from_pretrained(...,
torch_dtype=torch.bfloat16)` runs it.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import time
from pathlib import Path

import torch

T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, num_decoder_layers=24, vocab_size=32128,
              feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, tie_word_embeddings=False,
              is_encoder_decoder=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)

COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, num_layers=42,
                    time_embed_dim=512, text_embed_dim=4096, sample_width=90, sample_height=60, sample_frames=49,
                    patch_size=2, max_text_seq_length=226, use_rotary_positional_embeddings=True,
                    use_learned_positional_embeddings=False)
COGVIDEOX_DPM = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                     num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                     set_alpha_to_one=True, snr_shift_scale=1.0, steps_offset=0, timestep_spacing="trailing")
PIXART_SIGMA = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                    cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
                    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                    norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=2, caption_channels=4096,
                    use_additional_conditions=False)
SDXL_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.13025, force_upcast=True)
SD3_MEDIUM = dict(attention_head_dim=64, caption_projection_dim=1536, in_channels=16, joint_attention_dim=4096,
                  num_attention_heads=24, num_layers=24, out_channels=16, patch_size=2, pooled_projection_dim=2048,
                  pos_embed_max_size=192, sample_size=128)
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
               layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False, force_upcast=True)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=768,
              hidden_act="quick_gelu", max_position_embeddings=77)
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu", max_position_embeddings=77)
ALLEGRO_SCHEDULER = dict(beta_start=0.0001, beta_end=0.02, beta_schedule="linear", num_train_timesteps=1000,
                         timestep_spacing="linspace", steps_offset=0)
LTX_SCHEDULER = dict(base_image_seq_len=1024, base_shift=0.95, max_image_seq_len=4096, max_shift=2.05,
                     shift_terminal=0.1, use_dynamic_shifting=True, num_train_timesteps=1000, shift=1.0)


def _t5(max_length: int):
    from transformers import T5Config, T5EncoderModel

    from chunkflow.models.tokenizers import t5_tokenizer

    return T5EncoderModel(T5Config(**T5_XXL)), t5_tokenizer(max_length)


NAMES = ("ltx-video", "cogvideox-5b", "pixart-sigma", "sd3-medium", "allegro", "mochi")


def _clip(cfg: dict):
    """A CLIP text tower with its projection (as SD3 takes it) and chunkflow's local CLIP tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from chunkflow.models.tokenizers import clip_tokenizer

    tok = clip_tokenizer()
    config = CLIPTextConfig(vocab_size=49408, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, **cfg)
    return CLIPTextModelWithProjection(config), tok


def build(name: str):
    """The pipeline `name` with random values (on the current default device and dtype)."""
    import diffusers

    if name == "ltx-video":
        text_encoder, tokenizer = _t5(128)
        return diffusers.LTXPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER),
            vae=diffusers.AutoencoderKLLTXVideo(), text_encoder=text_encoder, tokenizer=tokenizer,
            transformer=diffusers.LTXVideoTransformer3DModel())
    if name == "cogvideox-5b":
        text_encoder, tokenizer = _t5(226)
        return diffusers.CogVideoXPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=diffusers.AutoencoderKLCogVideoX(scaling_factor=0.7),
            transformer=diffusers.CogVideoXTransformer3DModel(**COGVIDEOX_5B),
            scheduler=diffusers.CogVideoXDPMScheduler(**COGVIDEOX_DPM))
    if name == "pixart-sigma":
        text_encoder, tokenizer = _t5(300)
        return diffusers.PixArtSigmaPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=diffusers.AutoencoderKL(**SDXL_VAE),
            transformer=diffusers.PixArtTransformer2DModel(**PIXART_SIGMA),
            scheduler=diffusers.DPMSolverMultistepScheduler())
    if name == "sd3-medium":
        (t5, tok_t5), (clip_l, tok_l), (clip_g, tok_g) = _t5(256), _clip(CLIP_L), _clip(CLIP_G)  # T5 first: shared
        return diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(**SD3_MEDIUM),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=diffusers.AutoencoderKL(**SD3_VAE),
            text_encoder=clip_l, tokenizer=tok_l, text_encoder_2=clip_g, tokenizer_2=tok_g, text_encoder_3=t5,
            tokenizer_3=tok_t5)
    if name == "mochi":
        text_encoder, tokenizer = _t5(256)
        return diffusers.MochiPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=diffusers.AutoencoderKLMochi(),
            text_encoder=text_encoder, tokenizer=tokenizer, transformer=diffusers.MochiTransformer3DModel())
    if name == "allegro":
        text_encoder, tokenizer = _t5(512)
        return diffusers.AllegroPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=diffusers.AutoencoderKLAllegro(),
            transformer=diffusers.AllegroTransformer3DModel(),
            scheduler=diffusers.EulerAncestralDiscreteScheduler(**ALLEGRO_SCHEDULER))
    raise SystemExit(f"unknown pipeline {name!r}: one of {', '.join(NAMES)}")


def share_with(folder: Path, other: Path) -> int:
    """Hard-link each file of `folder` that `other` holds byte for byte under the same name (in any of its
    subfolders: SD3's T5 is its text_encoder_3); the bytes freed."""
    twins: dict[tuple[str, int], list[Path]] = {}
    for p in other.rglob("*"):
        if p.is_file():
            twins.setdefault((p.name, p.stat().st_size), []).append(p)
    freed = 0
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        for twin in twins.get((f.name, f.stat().st_size), []):
            if not f.samefile(twin) and filecmp.cmp(f, twin, shallow=False):
                tmp = f.with_name(f.name + ".link")
                os.link(twin, tmp)
                os.replace(tmp, f)
                freed += f.stat().st_size
                break
    return freed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=NAMES)
    ap.add_argument("folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--share-with", action="append", default=[], type=Path,
                    help="a folder saved before: files it holds byte for byte are hard-linked (repeatable)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(a.device), torch.no_grad():
        pipe = build(a.name)
    torch.set_default_dtype(torch.float32)
    t1 = time.perf_counter()
    pipe.save_pretrained(a.folder, max_shard_size=a.max_shard_size)
    print(f"{a.name}: built in {t1 - t0:.1f} s, saved to {a.folder} in {time.perf_counter() - t1:.1f} s")
    for other in a.share_with:
        if other.is_dir():
            print(f"{a.name}: {share_with(Path(a.folder), other) / 1e9:.2f} GB hard-linked to {other}")


if __name__ == "__main__":
    main()
