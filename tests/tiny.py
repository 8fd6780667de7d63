"""Tiny versions of the catalog's real diffusers classes, and their inputs: what the CPU tests run.

Importable from every test module and from the torchrun worker scripts (their directory is on sys.path).
"""

from __future__ import annotations

TINY = {  # shrunken configs of the catalog's real classes
    "FLUX.1-dev": dict(attention_head_dim=16, num_attention_heads=2, num_layers=2, num_single_layers=3,
                       joint_attention_dim=32, pooled_projection_dim=16, in_channels=16, axes_dims_rope=(4, 6, 6)),
    "HunyuanVideo": dict(attention_head_dim=16, num_attention_heads=2, num_layers=2, num_single_layers=3,
                         num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=16, in_channels=4,
                         out_channels=4, rope_axes_dim=(4, 6, 6)),
    "Qwen-Image": dict(attention_head_dim=16, num_attention_heads=2, num_layers=3, joint_attention_dim=32,
                       in_channels=16, out_channels=4, axes_dims_rope=(4, 6, 6)),
    "Wan2.2-TI2V-5B": dict(attention_head_dim=16, num_attention_heads=2, num_layers=3, ffn_dim=64, freq_dim=32,
                           text_dim=32, in_channels=8, out_channels=8),
}


def tiny_spec(name: str):
    """The catalog entry `name` with a shrunken diffusers config (and an 8-token text context)."""
    from chunkflow_planner.catalog import get_model

    s = get_model(name)
    cfg = dict(s.diffusers.config)
    cfg.update(TINY[name])
    return s.model_copy(update={"diffusers": s.diffusers.model_copy(update={"config": cfg}), "text_len": 8})


def tiny_workload(spec):
    from chunkflow_planner.catalog import Workload

    return Workload(batch=1, frames=5 if spec.is_video else 1, height=64, width=64, steps=1)


# ------------------------------------------------------------------------- diffusers modules built directly


def wan(mixed: bool = False):
    """(module, block lists, forward kwargs); mixed: bf16 with Wan's fp32 modules kept in fp32."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=8,
                              out_channels=8, text_dim=128, freq_dim=128, ffn_dim=256, num_layers=3,
                              rope_max_seq_len=64).eval()
    if mixed:
        keep = m._keep_in_fp32_modules
        for n, p in m.named_parameters():
            if not any(k in n.split(".") for k in keep):
                p.data = p.data.to(torch.bfloat16)
    dt = torch.bfloat16 if mixed else torch.float32
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 8, 3, 8, 8, generator=g).to(dt), timestep=torch.tensor([500.0]),
              encoder_hidden_states=torch.randn(1, 7, 128, generator=g).to(dt), return_dict=False)
    return m, [m.blocks], kw


def flux():
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                               guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(4, 4, 3)
    ids[..., 1] = torch.arange(4)[:, None]
    ids[..., 2] = torch.arange(4)[None]
    kw = dict(hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
              pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
              img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(6, 3), guidance=torch.tensor([3.5]), return_dict=False)
    return m, [m.transformer_blocks, m.single_transformer_blocks], kw


def hunyuan():
    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    m = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                       num_layers=2, num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0,
                                       patch_size=2, patch_size_t=1, text_embed_dim=32, pooled_projection_dim=16,
                                       rope_axes_dim=(4, 6, 6), guidance_embeds=True).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
              encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
              encoder_attention_mask=torch.ones(1, 6, dtype=torch.int64),
              pooled_projections=torch.randn(1, 16, generator=g), guidance=torch.tensor([6000.0]), return_dict=False)
    return m, [m.transformer_blocks, m.single_transformer_blocks], kw


def qwen():
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
              encoder_hidden_states_mask=torch.ones(1, 6, dtype=torch.int64), timestep=torch.tensor([0.5]),
              img_shapes=[[(1, 4, 4)]], return_dict=False)
    return m, [m.transformer_blocks], kw


MODULES = {"wan": wan, "wan_mixed": lambda: wan(mixed=True), "flux": flux, "hunyuan": hunyuan, "qwen": qwen}


# ------------------------------------------------------------------------------------- sequence parallel


def padded_inputs(spec, seed: int = 3) -> dict:
    """fp32 CPU inputs for a tiny spec; HunyuanVideo's last 5 text tokens padded, so its mask crosses the shards."""
    import torch

    from chunkflow.models.inputs import make_inputs

    kw = make_inputs(spec, tiny_workload(spec), torch.float32, "cpu", seed=seed)
    if "encoder_attention_mask" in kw:
        kw["encoder_attention_mask"][:, -5:] = 0
    return kw


def single_and_sp(spec, kw: dict, world: int):
    """(single-process output, Ulysses SP output) of one fp32 build of `spec` (seed 1), no offload."""
    import torch

    from chunkflow.models.build import build_transformer
    from chunkflow.parallel import enable_sequence_parallel

    m, h = build_transformer(spec, dtype=torch.float32, device="cpu", config="none", seed=1)
    with torch.no_grad():
        ref = m(**kw)[0]
    enable_sequence_parallel(m, spec, world)
    with torch.no_grad():
        sp = m(**kw)[0]
    h.remove()
    return ref, sp
