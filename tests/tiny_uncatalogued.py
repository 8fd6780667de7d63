"""Tiny diffusers DiT classes outside the catalog, random weights, and their inputs: (module, forward kwargs).

Each a few hundred KB: the smallest constructor arguments the class accepts, with two or more blocks per list."""

from __future__ import annotations

import torch


def _g():
    return torch.Generator().manual_seed(1)


def _randn(g):
    return lambda *shape: torch.randn(*shape, generator=g)


def sd3():
    from diffusers import SD3Transformer2DModel

    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                              num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                              pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 5, 16),
                   pooled_projections=r(1, 8), timestep=torch.tensor([500]), return_dict=False)


def cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    m = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                    time_embed_dim=8, text_embed_dim=16, num_layers=3, sample_width=8, sample_height=8,
                                    sample_frames=5, patch_size=2, max_text_seq_length=5)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 2, 4, 8, 8), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([500]), return_dict=False)


def ltx_video():
    from diffusers import LTXVideoTransformer3DModel

    m = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
                                   cross_attention_dim=16, num_layers=3, caption_channels=16)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 2 * 4 * 4, 8), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 5), num_frames=2, height=4,
                   width=4, return_dict=False)


def sana():
    from diffusers import SanaTransformer2DModel

    m = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                               num_layers=3, num_cross_attention_heads=2, cross_attention_head_dim=8,
                               cross_attention_dim=16, caption_channels=16, sample_size=8)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([500]), return_dict=False)


def lumina2():
    from diffusers import Lumina2Transformer2DModel

    m = Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=16, num_layers=3,
                                  num_refiner_layers=2, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                                  axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=16)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 4, 8, 8), timestep=torch.tensor([0.5]),
                   encoder_hidden_states=r(1, 5, 16), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool),
                   return_dict=False)


def mochi():
    from diffusers import MochiTransformer3DModel

    m = MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=3,
                                pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=8,
                                max_sequence_length=8)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 4, 2, 8, 8), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool),
                   return_dict=False)


def allegro():
    from diffusers import AllegroTransformer3DModel

    m = AllegroTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                  num_layers=3, cross_attention_dim=16, sample_height=8, sample_width=8,
                                  sample_frames=2, caption_channels=16)
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 4, 2, 8, 8), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([500]), return_dict=False)


def _wan_kw(channels: int = 4):
    r = _randn(_g())
    return dict(hidden_states=r(1, channels, 2, 8, 8), timestep=torch.tensor([500]),
                encoder_hidden_states=r(1, 5, 16), return_dict=False)


def skyreels_v2():
    from diffusers import SkyReelsV2Transformer3DModel

    m = SkyReelsV2Transformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                     text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)
    return m, _wan_kw()


def wan_vace():
    from diffusers import WanVACETransformer3DModel

    m = WanVACETransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=4, rope_max_seq_len=32,
                                  vace_layers=[0, 2], vace_in_channels=8)
    kw = _wan_kw()
    kw["control_hidden_states"] = torch.randn(1, 8, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    return m, kw


def cogview4():
    from diffusers import CogView4Transformer2DModel

    m = CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8,
                                   num_attention_heads=2, text_embed_dim=16, time_embed_dim=8, condition_dim=4,
                                   pos_embed_max_size=8, sample_size=8, rope_axes_dim=(4, 4))
    r = _randn(_g())
    return m, dict(hidden_states=r(1, 4, 8, 8), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([500]), original_size=torch.tensor([[64, 64]]),
                   target_size=torch.tensor([[64, 64]]), crop_coords=torch.tensor([[0, 0]]), return_dict=False)


def chroma():
    from diffusers import ChromaTransformer2DModel

    m = ChromaTransformer2DModel(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
                                 approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=2)
    r = _randn(_g())
    ids = torch.zeros(4, 4, 3)
    ids[..., 1] = torch.arange(4)[:, None]
    ids[..., 2] = torch.arange(4)[None]
    return m, dict(hidden_states=r(1, 16, 16), encoder_hidden_states=r(1, 5, 16),
                   timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(5, 3),
                   return_dict=False)


def build(name: str):
    """(module in eval mode with seeded random weights, forward kwargs)."""
    torch.manual_seed(0)
    m, kw = MODELS[name]()
    return m.eval(), kw


MODELS = {"sd3": sd3, "cogvideox": cogvideox, "ltx_video": ltx_video, "sana": sana, "lumina2": lumina2,
          "mochi": mochi, "allegro": allegro, "skyreels_v2": skyreels_v2, "wan_vace": wan_vace, "cogview4": cogview4,
          "chroma": chroma}
