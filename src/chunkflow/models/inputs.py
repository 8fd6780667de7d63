"""Transformer forward kwargs for a workload, keyed by the catalog's `diffusers.inputs`.

Random latents and text states of the shapes each diffusers class expects (read from the classes' forward
signatures in diffusers 0.42.1); timesteps and guidance in the units the matching pipeline passes.
"""

from __future__ import annotations

from typing import Callable

import torch


def _latent_frames(spec, frames: int) -> int:
    vt = spec.vae_temporal
    if vt is None:
        return 1
    if (frames - 1) % vt:
        raise ValueError(f"{spec.name} needs frames = 1 mod {vt} (e.g. {((frames - 1) // vt) * vt + 1}); got {frames}")
    return (frames - 1) // vt + 1


def _randn(shape, dtype, device, g):
    return torch.randn(shape, generator=g, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)


def _wan(spec, w, dtype, device, g):
    cfg = spec.diffusers.config
    s = spec.vae_spatial
    frames = _latent_frames(spec, w.frames)
    _, ph, pw = spec.patch
    # Wan2.2-TI2V's pipeline gives every token its own timestep (expand_timesteps): (B, tokens) as WanPipeline does
    t_shape = (w.batch, frames * (w.height // s // ph) * (w.width // s // pw)) if spec.per_token_timestep else (w.batch,)
    return dict(
        hidden_states=_randn((w.batch, cfg["in_channels"], frames, w.height // s, w.width // s), dtype, device, g),
        timestep=torch.full(t_shape, 500.0, device=device),
        encoder_hidden_states=_randn((w.batch, spec.text_len, cfg["text_dim"]), dtype, device, g),
        return_dict=False,
    )


def _packed_hw(spec, w) -> tuple[int, int]:
    p = 2  # 2x2 latent packing of Flux and Qwen-Image
    return w.height // (spec.vae_spatial * p), w.width // (spec.vae_spatial * p)


def _flux(spec, w, dtype, device, g):
    cfg = spec.diffusers.config
    h, wd = _packed_hw(spec, w)
    ids = torch.zeros(h, wd, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(wd)[None, :]
    out = dict(
        hidden_states=_randn((w.batch, h * wd, cfg.get("in_channels", 64)), dtype, device, g),
        encoder_hidden_states=_randn((w.batch, spec.text_len, cfg.get("joint_attention_dim", 4096)), dtype, device, g),
        pooled_projections=_randn((w.batch, cfg.get("pooled_projection_dim", 768)), dtype, device, g),
        timestep=torch.full((w.batch,), 0.5, device=device, dtype=dtype),  # the model multiplies by 1000
        img_ids=ids.reshape(-1, 3).to(device=device, dtype=dtype),
        txt_ids=torch.zeros(spec.text_len, 3, device=device, dtype=dtype),
        return_dict=False,
    )
    if cfg.get("guidance_embeds", False):
        out["guidance"] = torch.full((w.batch,), 3.5, device=device, dtype=dtype)
    return out


def _hunyuan_video(spec, w, dtype, device, g):
    cfg = spec.diffusers.config
    s = spec.vae_spatial
    out = dict(
        hidden_states=_randn((w.batch, cfg.get("in_channels", 16), _latent_frames(spec, w.frames), w.height // s,
                              w.width // s), dtype, device, g),
        timestep=torch.full((w.batch,), 500.0, device=device, dtype=dtype),
        encoder_hidden_states=_randn((w.batch, spec.text_len, cfg.get("text_embed_dim", 4096)), dtype, device, g),
        encoder_attention_mask=torch.ones(w.batch, spec.text_len, device=device, dtype=torch.int64),
        pooled_projections=_randn((w.batch, cfg.get("pooled_projection_dim", 768)), dtype, device, g),
        return_dict=False,
    )
    if cfg.get("guidance_embeds", True):
        out["guidance"] = torch.full((w.batch,), 6000.0, device=device, dtype=dtype)  # the pipeline passes g*1000
    return out


def _qwen_image(spec, w, dtype, device, g):
    cfg = spec.diffusers.config
    h, wd = _packed_hw(spec, w)
    return dict(
        hidden_states=_randn((w.batch, h * wd, cfg.get("in_channels", 64)), dtype, device, g),
        encoder_hidden_states=_randn((w.batch, spec.text_len, cfg.get("joint_attention_dim", 3584)), dtype, device, g),
        # no mask, as QwenImagePipeline passes for an unpadded prompt (it drops an all-ones mask): a mask would put
        # every joint attention on SDPA's masked kernel, which the pipeline's forward does not run
        encoder_hidden_states_mask=None,
        timestep=torch.full((w.batch,), 0.5, device=device, dtype=dtype),  # the pipeline passes t / 1000
        img_shapes=[[(1, h, wd)]] * w.batch,
        return_dict=False,
    )


# the transformer's timestep units: Flux and Qwen-Image take t / 1000 (their pipelines divide), Wan and Hunyuan take t
TIMESTEP_SCALE: dict[str, float] = {"wan": 1.0, "flux": 1e-3, "hunyuan_video": 1.0, "qwen_image": 1e-3}

BUILDERS: dict[str, Callable] = {"wan": _wan, "flux": _flux, "hunyuan_video": _hunyuan_video, "qwen_image": _qwen_image}


def make_inputs(spec, workload=None, dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """Forward kwargs for `spec` (a catalog ModelSpec) at `workload` (default: the spec's default workload)."""
    w = workload or spec.default_workload
    g = torch.Generator().manual_seed(seed)
    return BUILDERS[spec.diffusers.inputs](spec, w, dtype, torch.device(device), g)
