"""What a derived model entry (models/derive.py) cannot read from a folder's configs, per transformer family.

One small adapter per family, looked up by the diffusers transformer class; a class without one gets the generic
defaults (the folder's configs say everything else). The catalog is an adapter too: a class the catalog knows
takes its input builder, pipeline adapter and attention masking from the catalog's entry (`catalog_family`).
Nothing else in chunkflow switches on these class names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Family:
    """Per-family facts a folder's configs do not state."""

    packed: bool = False  # the pipeline packs 2x2 latent patches into tokens (FLUX, Chroma, Qwen-Image): token patch
    # 2, latent channels = in_channels / 4
    vae_spatial: int | None = None  # the VAE's factors, for a transformer-only folder (a pipeline folder's VAE says)
    vae_temporal: int | None = None  # None: an image model
    sample_size: int | None = None  # latent height and width the pipeline defaults to where its config has none
    sample_frames_out: bool = False  # config.json's sample_frames counts output frames (CogVideoX's pipeline
    # defaults num_frames to it), not latent frames
    inputs: str = "generic"  # catalog.DiffusersSpec.inputs
    adapter: str = "generic"  # components.PipelineAdapter
    masked_attention: bool = False
    cp_plan: str | None = None
    activation: dict | None = None  # catalog.ActivationModel's fields (None: the planner's default)


_FAMILIES: dict[str, Family] = {
    "FluxTransformer2DModel": Family(packed=True, vae_spatial=8, sample_size=128),
    "ChromaTransformer2DModel": Family(packed=True, vae_spatial=8, sample_size=128),
    "QwenImageTransformer2DModel": Family(packed=True, vae_spatial=8, sample_size=128),
    "SD3Transformer2DModel": Family(vae_spatial=8),
    "CogView4Transformer2DModel": Family(vae_spatial=8),
    "Lumina2Transformer2DModel": Family(vae_spatial=8),
    "SanaTransformer2DModel": Family(vae_spatial=32),
    "CogVideoXTransformer3DModel": Family(vae_spatial=8, vae_temporal=4, sample_frames_out=True),
    "LTXVideoTransformer3DModel": Family(vae_spatial=32, vae_temporal=8),
    "MochiTransformer3DModel": Family(vae_spatial=8, vae_temporal=6),
    "AllegroTransformer3DModel": Family(vae_spatial=8, vae_temporal=4),
    "WanTransformer3DModel": Family(vae_spatial=8, vae_temporal=4),
    "WanVACETransformer3DModel": Family(vae_spatial=8, vae_temporal=4),
    "SkyReelsV2Transformer3DModel": Family(vae_spatial=8, vae_temporal=4),
    "HunyuanVideoTransformer3DModel": Family(vae_spatial=8, vae_temporal=4),
}

# text encoder classes priced as a catalog architecture: the catalog's own classes, and these with its layers
TEXT_ARCH_ALIASES = {"CLIPTextModelWithProjection": "clip_text"}


def catalog_family(cls: str):
    """The catalog entry whose transformer is `cls` (the first), or None."""
    try:
        from chunkflow_planner.catalog import load_models

        return next((s for s in load_models().values() if s.diffusers.cls == cls), None)
    except Exception:  # an unreadable catalog: no catalog knowledge
        return None


def family(cls: str) -> Family:
    """The family adapter of transformer class `cls`: its own, with the catalog's input builder, pipeline adapter,
    masking and activation model (measured for the class) where the catalog knows the class."""
    fam = _FAMILIES.get(cls, Family())
    spec = catalog_family(cls)
    if spec is None:
        return fam
    return replace(fam, inputs=spec.diffusers.inputs, masked_attention=spec.diffusers.masked_attention,
                   cp_plan=spec.diffusers.cp_plan, activation=spec.activation.model_dump(),
                   adapter=spec.pipeline.adapter if spec.pipeline is not None else fam.adapter)


def text_encoder_template(cls: str):
    """(arch, the catalog's TextEncoderSpec of that class or None) for a transformers text encoder class; arch
    `other` for a class the catalog does not price."""
    try:
        from chunkflow_planner.catalog import load_models

        for spec in load_models().values():
            for te in (spec.pipeline.text_encoders if spec.pipeline is not None else []):
                if te.cls == cls:
                    return te.arch, te
    except Exception:
        pass
    return TEXT_ARCH_ALIASES.get(cls, "other"), None
