"""Tiny, complete diffusers pipelines built on the CPU from configs alone (no Hub access): what tests that run a
whole `pipe(...)` call use.

    pipe = tiny_pipeline("wan")                 # WanPipeline, FluxPipeline, QwenImagePipeline, HunyuanVideoPipeline
    out = pipe(**call_kwargs("wan"))            # 2 steps, tiny sizes, seeded generator, output_type="latent"

Every component is the real diffusers/transformers class the full-size checkpoint uses (the transformers are the
catalog's classes, with 2 blocks in each block list, 12k-38k parameters a block), shrunk; the weights are drawn with
`torch.manual_seed(seed)` before each component, so two builds with the same seed are bit-identical.

The tokenizers (chunkflow.models.tokenizers) are built locally, never downloaded: each is the transformers class the pipeline declares (T5TokenizerFast,
CLIPTokenizer, Qwen2Tokenizer, LlamaTokenizerFast) with the real tokenizer's normalizer and pre-tokenizer (T5's
metaspace Unigram; CLIP's, Qwen2's and Llama-3's regexes with byte-level BPE) and a small vocabulary: byte-level
BPE merges learned here, deterministically, on the words of the pipelines' prompt templates and of PROMPTS /
EXTRA_WORDS, so those words are single tokens and any other text still encodes (in smaller pieces). This matters
where a pipeline crops its prompt template by a fixed token count: QwenImagePipeline drops the first 34 tokens and
HunyuanVideoPipeline's default template crops 95; both counts hold for these tokenizers, as for the real ones
(checked at build time), so the pipelines run with their default templates.

CPU threads: these models are so small that torch's intra-op thread pool only costs time, a lot of it when the
cores are busy (a 2-thread linear of a few hundred FLOPs took 16 ms here under load, 3 us single-threaded):
run the calls under `torch.set_num_threads(1)` (see `one_thread`).
"""

from __future__ import annotations

import contextlib

import torch

# the tokenizers live in the package: random-weight pipelines use them too
from chunkflow.models.tokenizers import (
    EXTRA_WORDS,  # noqa: F401
    PROMPTS,
    QWEN_SPECIALS,
    QWEN_TEMPLATE,
    clip_tokenizer,
    llama_tokenizer,
    qwen_tokenizer,
    t5_tokenizer,
)

KINDS = ("wan", "flux", "qwen", "hunyuan")


# -------------------------------------------------------------------------------------- text encoders


def _seeded(seed: int, build):
    torch.manual_seed(seed)
    return build().eval().requires_grad_(False)


def _t5(tok, seed: int, d_model: int = 32, t5_class: str = "UMT5EncoderModel"):
    import transformers

    cfg_cls = transformers.UMT5Config if t5_class.startswith("UMT5") else transformers.T5Config
    cfg = cfg_cls(vocab_size=len(tok), d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                  feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  decoder_start_token_id=tok.pad_token_id, is_encoder_decoder=False, use_cache=False)
    return _seeded(seed, lambda: getattr(transformers, t5_class)(cfg))


def _clip(tok, seed: int, hidden: int = 16):
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden,
                         hidden_act="quick_gelu", bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, attention_dropout=0.0, dropout=0.0)
    return _seeded(seed, lambda: CLIPTextModel(cfg))


# ------------------------------------------------------------------------------------------- builders


def _wan(seed: int):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = t5_tokenizer()
    text_encoder = _t5(tokenizer, seed, d_model=32)
    transformer = _seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024))
    vae = _seeded(seed, lambda: AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                                 temperal_downsample=[False, True, True]))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer)


def _flux(seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = _clip(tokenizer, seed, hidden=16)
    text_encoder_2 = _t5(tokenizer_2, seed, d_model=32, t5_class="T5EncoderModel")
    transformer = _seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6)))
    vae = _seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.1159, scaling_factor=0.3611))
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, use_dynamic_shifting=True)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def _qwen(seed: int):
    import math

    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer(QWEN_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    eos = ids["<|endoftext|>"]
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 1e6},
                         bos_token_id=eos, eos_token_id=ids["<|im_end|>"], pad_token_id=eos, attention_dropout=0.0),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
        vocab_size=len(tokenizer), image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|vision_pad|>"])
    text_encoder = _seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config))
    transformer = _seeded(seed, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)))
    vae = _seeded(seed, lambda: AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1],
                                                       num_res_blocks=1, temperal_downsample=[False, True, True]))
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=math.log(3), max_image_seq_len=8192, max_shift=math.log(3), shift=1.0,
        shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True, num_train_timesteps=1000)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    n_prefix = len(tokenizer(template.split("{}")[0]).input_ids)
    assert n_prefix == drop, f"Qwen template prefix is {n_prefix} tokens here, the pipeline drops {drop}"
    return pipe


def _hunyuan(seed: int):
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import LlamaConfig, LlamaModel

    template, crop = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    tokenizer = llama_tokenizer(template)
    n_prefix = len(tokenizer(template.split("{}")[0]).input_ids)
    assert n_prefix == crop, f"HunyuanVideo template prefix is {n_prefix} tokens here, the pipeline crops {crop}"
    tokenizer_2 = clip_tokenizer()
    llama = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, attention_dropout=0.0, hidden_act="silu")
    text_encoder = _seeded(seed, lambda: LlamaModel(llama))
    text_encoder_2 = _clip(tokenizer_2, seed, hidden=16)
    transformer = _seeded(seed, lambda: HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=16,
        rope_axes_dim=(4, 6, 6)))
    vae = _seeded(seed, lambda: AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    return HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                scheduler=scheduler, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


BUILDERS = {"wan": _wan, "flux": _flux, "qwen": _qwen, "hunyuan": _hunyuan}


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """`dtype` for every floating parameter and buffer, except float32 for the modules the class keeps in fp32
    (diffusers' `_keep_in_fp32_modules` rule, as `from_pretrained(torch_dtype=...)` applies it)."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)


def tiny_pipeline(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A complete tiny diffusers pipeline on the CPU: kind in KINDS ("wan", "flux", "qwen", "hunyuan").

    Weights are drawn in float32 with torch.manual_seed(seed) before each component (the global RNG is left
    seeded), then cast: dtype != float32 casts the diffusers models (transformer, VAE) keeping their
    `_keep_in_fp32_modules` in float32 (as `from_pretrained(torch_dtype=...)` does; only Wan's transformer has
    any) and the transformers text encoders whole. The progress bar is disabled.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    pipe = BUILDERS[kind](seed)
    if dtype != torch.float32:
        from diffusers import ModelMixin

        for component in pipe.components.values():
            if isinstance(component, ModelMixin):  # transformer, VAE
                _cast(component, dtype)
            elif isinstance(component, torch.nn.Module):  # transformers text encoders: cast whole
                component.to(dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(kind: str, **overrides) -> dict:
    """kwargs for a tiny, deterministic `pipe(**kwargs)`: 2 steps, a fresh `Generator("cpu").manual_seed(0)`,
    output_type="latent" (Wan/Hunyuan: (1, C, T', H', W') latents; Flux/Qwen: packed (1, tokens, 4*C) latents).
    CFG runs two transformer passes per step for Wan (guidance_scale 5) and Qwen (true_cfg_scale 4 with a negative
    prompt); Flux and HunyuanVideo use embedded guidance (one pass). `overrides` replace/add entries."""
    prompt, negative = PROMPTS[kind]
    kw: dict = dict(prompt=prompt, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(0),
                    output_type="latent", height=32, width=32)
    if kind == "wan":
        kw.update(negative_prompt=negative, num_frames=5, guidance_scale=5.0, max_sequence_length=16)
    elif kind == "flux":
        kw.update(guidance_scale=3.5, max_sequence_length=16)
    elif kind == "qwen":
        kw.update(negative_prompt=negative, true_cfg_scale=4.0, max_sequence_length=16)
    elif kind == "hunyuan":
        kw.update(num_frames=5, guidance_scale=6.0, max_sequence_length=16)
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    kw.update(overrides)
    return kw


@contextlib.contextmanager
def one_thread():
    """Within: torch.set_num_threads(1) (restored on exit); the tiny pipelines run ~100x faster on a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def block_lists(pipe) -> dict[str, torch.nn.ModuleList]:
    """The transformer's block lists by attribute name, as the catalog names them."""
    names = {"WanTransformer3DModel": ["blocks"], "QwenImageTransformer2DModel": ["transformer_blocks"],
             "FluxTransformer2DModel": ["transformer_blocks", "single_transformer_blocks"],
             "HunyuanVideoTransformer3DModel": ["transformer_blocks", "single_transformer_blocks"]}
    t = pipe.transformer
    return {n: getattr(t, n) for n in names[type(t).__name__]}


# ------------------------------------------------------------------------------ saved catalog pipelines


def save_catalog_pipeline(name: str, folder, seed: int = 3, dtype: torch.dtype = torch.bfloat16, **save_kwargs):
    """The catalog pipeline `name` with random weights (chunkflow's random build, every component in its run dtype),
    saved as a diffusers pipeline folder with `pipe.save_pretrained(folder, **save_kwargs)` (e.g. max_shard_size,
    variant). Returns the folder."""
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig

    spec = get_model(name)
    everything = {n: "gpu" for n in ("text_encoder", "text_encoder_2", "transformer", "vae")}
    with one_thread():
        built = build_pipeline(spec, everything, OffloadConfig("none"), torch.device("cpu"), seed=seed, dtype=dtype)
    pipe = built.pipe
    built.remove()
    pipe.save_pretrained(folder, **save_kwargs)
    return folder


def as_hub_cache(folder, cache, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """`folder` laid out as the Hugging Face hub cache lays out a download of `repo_id`: every file a blob named by
    its sha256 in blobs/, and snapshots/<commit>/ of relative symlinks to them, refs/main naming the commit.
    Returns the snapshot folder."""
    import hashlib
    import os
    import shutil
    from pathlib import Path

    folder, cache = Path(folder), Path(cache)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snap / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap
