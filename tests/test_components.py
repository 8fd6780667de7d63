"""The catalog's pipelines: every text encoder's and VAE's parameter count, derived from its config, equals the real
class instantiated on the meta device; block lists resolve; local tokenizers fit the encoders' vocabularies."""

from __future__ import annotations

import warnings

import pytest
import torch

from chunkflow_planner.catalog import load_models
from chunkflow_planner.components import encoder_params

PIPELINES = [(s.name, s) for s in load_models().values() if s.pipeline is not None]
TEXT_ENCODERS = [(f"{n}:{te.component}", s, te) for n, s in PIPELINES for te in s.pipeline.text_encoders]


def _meta_text_encoder(te):
    import transformers

    cls = getattr(transformers, te.cls)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return cls(cls.config_class(**te.config))


def _attr(module, dotted):
    from chunkflow.models.adapters import _attr as find

    found = find(module, dotted)
    assert found is not None, f"no {dotted} in {type(module).__name__}"
    return found


def test_every_catalog_model_has_a_pipeline():
    assert {n for n, _ in PIPELINES} == set(load_models())


@pytest.mark.parametrize("key, spec, te", TEXT_ENCODERS, ids=[k for k, _, _ in TEXT_ENCODERS])
def test_text_encoder_parameters_derived_from_config_match_the_class(key, spec, te):
    m = _meta_text_encoder(te)
    real = sum(p.numel() for p in m.parameters())
    derived, layer = encoder_params(te.arch, te.config)
    assert derived == real == te.total_params
    layers = _attr(m, te.block_list)
    assert isinstance(layers, torch.nn.ModuleList) and len(layers) == te.shape()["layers"]
    assert sum(p.numel() for p in layers[-1].parameters()) == layer  # T5's first layer also holds the position bias


@pytest.mark.parametrize("name, spec", PIPELINES, ids=[n for n, _ in PIPELINES])
def test_vae_parameters_match_the_class(name, spec):
    import diffusers

    vae = spec.pipeline.vae
    with torch.device("meta"):
        m = getattr(diffusers, vae.cls)(**vae.config)
    assert sum(p.numel() for p in m.parameters()) == vae.total_params
    post = getattr(m, "post_quant_conv", None)
    dec = sum(p.numel() for p in m.decoder.parameters()) + (sum(p.numel() for p in post.parameters()) if post else 0)
    assert dec == vae.decoder_params
    latent = m.config.get("z_dim", m.config.get("latent_channels"))
    packed = spec.diffusers.inputs in ("flux", "qwen_image")  # 2x2 latent patches packed into channels
    assert latent * (4 if packed else 1) == spec.diffusers.config["in_channels"]


@pytest.mark.parametrize("key, spec, te", TEXT_ENCODERS, ids=[k for k, _, _ in TEXT_ENCODERS])
def test_local_tokenizer_fits_the_encoder(key, spec, te):
    from chunkflow.models.tokenizers import build_tokenizer

    tok = build_tokenizer(te.tokenizer_kind, te.tokens)
    vocab = (te.config.get("text_config") or te.config)["vocab_size"]
    assert len(tok) <= vocab


def test_wan22_ti2v_tokens_have_their_own_timestep():
    from chunkflow.models.inputs import make_inputs
    from chunkflow_planner.catalog import Workload, get_model
    from chunkflow_planner.memory import activation_bytes
    from chunkflow_planner.workload import tokens

    ti2v, wan21 = get_model("wan2.2"), get_model("wan2.1-14b")
    assert ti2v.per_token_timestep and not wan21.per_token_timestep
    w = Workload(frames=5, height=64, width=64, steps=1)
    kw = make_inputs(ti2v.model_copy(update={"text_len": 4}), w, torch.float32, "meta")
    assert tuple(kw["timestep"].shape) == (1, tokens(ti2v, w))
    plain = ti2v.model_copy(update={"pipeline": None})
    extra = activation_bytes(ti2v, w) - activation_bytes(plain, w)
    assert extra == tokens(ti2v, w) * ti2v.d * 38


def _class_tiling(m, spatial: int) -> dict:
    """The tiling an instance of a diffusers VAE class uses after `enable_tiling()` (its own defaults)."""
    if hasattr(m, "tile_sample_min_size"):  # AutoencoderKL: square tiles, an overlap factor in latent units
        latent = m.tile_latent_min_size
        return dict(tile_px=latent * spatial, stride_px=int(latent * (1 - m.tile_overlap_factor)) * spatial,
                    frames="none")
    out = dict(tile_px=m.tile_sample_min_height, stride_px=m.tile_sample_stride_height)
    assert (m.tile_sample_min_width, m.tile_sample_stride_width) == (out["tile_px"], out["stride_px"])
    if hasattr(m, "tile_sample_min_num_frames"):
        return dict(out, frames="chunks", tile_frames=m.tile_sample_min_num_frames,
                    stride_frames=m.tile_sample_stride_num_frames)
    return dict(out, frames="per_frame")


@pytest.mark.parametrize("name, spec", PIPELINES, ids=[n for n, _ in PIPELINES])
def test_vae_tiling_is_the_class_default(name, spec):
    """models.yaml's tiling of each VAE is what its diffusers class tiles by, so the planner counts its calls."""
    import diffusers

    vae = spec.pipeline.vae
    with torch.device("meta"):
        m = getattr(diffusers, vae.cls)(**vae.config)
    assert vae.tiling is not None
    assert vae.tiling.model_dump(exclude_none=True) == _class_tiling(m, spec.vae_spatial)


_TINY_VAES = {
    "AutoencoderKLWan": dict(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                             temperal_downsample=[False, True, True]),
    "AutoencoderKLQwenImage": dict(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                   latents_std=[1.0] * 4),
    "AutoencoderKLHunyuanVideo": dict(block_out_channels=[8, 8, 8, 8], layers_per_block=1, norm_num_groups=4,
                                      latent_channels=4),
    "AutoencoderKL": dict(block_out_channels=[8, 8, 8, 8], layers_per_block=1, norm_num_groups=4, latent_channels=4,
                          sample_size=32, down_block_types=["DownEncoderBlock2D"] * 4,
                          up_block_types=["UpDecoderBlock2D"] * 4),
}
_SIZES = {  # (frames, height, width): inside one tile, across tiles with edge tiles, chunked in time or not
    "AutoencoderKLWan": [(5, 128, 128), (5, 320, 576), (9, 264, 200)],
    "AutoencoderKLQwenImage": [(1, 320, 576), (1, 128, 264)],
    "AutoencoderKLHunyuanVideo": [(9, 320, 448), (21, 264, 264), (21, 128, 128)],
    "AutoencoderKL": [(1, 32, 32), (1, 64, 96), (1, 88, 40)],
}


@pytest.mark.parametrize("cls", sorted(_TINY_VAES))
def test_tiled_decode_calls_counted_as_diffusers_makes_them(cls):
    """The planner's count of decoder calls in a tiled decode (VaeTiling.decoder_calls) equals the calls diffusers'
    tiled decode makes, counted with a hook on tiny VAEs of each class at sizes with edge tiles and time chunks."""
    import diffusers

    from chunkflow_planner.components import VaeTiling

    torch.manual_seed(0)
    m = getattr(diffusers, cls)(**_TINY_VAES[cls]).eval()
    m.enable_tiling()
    image = cls in ("AutoencoderKL", "AutoencoderKLQwenImage")
    spatial, temporal = 8, (None if image else 4)
    tiling = VaeTiling(**_class_tiling(m, spatial))
    calls = []
    hook = m.decoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        for frames, h, w in _SIZES[cls]:
            lf = 1 if image else (frames - 1) // 4 + 1
            shape = (1, 4, h // 8, w // 8) if cls == "AutoencoderKL" else (1, 4, lf, h // 8, w // 8)
            calls.clear()
            with torch.no_grad():
                m.decode(torch.randn(shape), return_dict=False)
            assert len(calls) == tiling.decoder_calls(h, w, lf, spatial, temporal), (frames, h, w)
    finally:
        hook.remove()


def _archs() -> list:
    from chunkflow.commands.calibrate.host import text_encoder_archs

    return sorted(text_encoder_archs().items())  # what calibrate measures: each architecture's first catalog encoder


ARCHS = _archs()


def test_one_architecture_is_called_one_way():
    """calibrate times an architecture's layer once, called as the first catalog pipeline using it calls it
    (TextEncoderSpec.mask; what it dispatches depends on the mask), and prices every encoder of that architecture
    with it: the catalog's encoders of one architecture take one mask."""
    masks: dict[str, set] = {}
    for _, spec in PIPELINES:
        for te in spec.pipeline.text_encoders:
            masks.setdefault(te.arch, set()).add(te.mask)
    assert all(len(m) == 1 for m in masks.values()), masks


def test_small_text_encoders_keep_what_decides_the_operators():
    """The small-width stand-ins calibrate times (their host dispatch is the real forward's) change only sizes:
    every flag, activation, bias and attention setting of the checkpoint's config is kept, the layers are those
    asked for, and grouped-query attention stays grouped."""
    from chunkflow.commands.calibrate.host import small_config

    sizes = {"d_model", "d_ff", "num_heads", "vocab_size", "num_layers", "hidden_size", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers"}
    for arch, te in ARCHS:
        small = small_config(te.arch, te.config, 3)
        text, real = small.get("text_config", small), te.config.get("text_config", te.config)
        assert text.get("num_layers", text.get("num_hidden_layers")) == 3, arch
        assert {k: v for k, v in text.items() if k not in sizes} == {k: v for k, v in real.items() if k not in sizes}
        assert {k for k in small if k != "text_config" and small[k] != te.config.get(k)} <= sizes | {"vision_config"}
        kv, heads = real.get("num_key_value_heads"), real.get("num_attention_heads")
        if kv is not None and kv < heads:
            assert text["num_key_value_heads"] < text["num_attention_heads"], arch
