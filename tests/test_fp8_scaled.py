"""fp8-scaled transformer files (formats/fp8_scaled.py): tiny real FLUX and Wan models written as ComfyUI's
"fp8_scaled" repackages are (original key layout, e4m3 weights, a float32 `scale_weight` per linear), loaded, and
compared bit for bit with a plain torch reference built independently: the diffusers model whose linears hold
`e4m3.to(dt) * scale.to(dt)`; then under chunkflow.offload (host, disk and shared tiers) against no offload.

The files are written here, from the diffusers state dict, by a hand-written map to the original names (the
inverse of what diffusers' single-file converters do); the loader maps them back with diffusers' own converter.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import chunkflow
from chunkflow.formats import fp8_scaled
from chunkflow.formats.fp8_scaled import Fp8ScaledError, ScaledFp8Linear
from chunkflow_planner.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
import tiny  # noqa: E402

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16


# ------------------------------------------------------------------- the original layouts (written by hand)


def flux_groups(m) -> list[tuple[str, list[str], bool]]:
    """(BFL layer, the diffusers layers joined into it along dim 0, whether BFL swaps its halves)."""
    g = [("img_in", ["x_embedder"], False), ("txt_in", ["context_embedder"], False),
         ("time_in.in_layer", ["time_text_embed.timestep_embedder.linear_1"], False),
         ("time_in.out_layer", ["time_text_embed.timestep_embedder.linear_2"], False),
         ("vector_in.in_layer", ["time_text_embed.text_embedder.linear_1"], False),
         ("vector_in.out_layer", ["time_text_embed.text_embedder.linear_2"], False),
         ("guidance_in.in_layer", ["time_text_embed.guidance_embedder.linear_1"], False),
         ("guidance_in.out_layer", ["time_text_embed.guidance_embedder.linear_2"], False),
         ("final_layer.linear", ["proj_out"], False), ("final_layer.adaLN_modulation.1", ["norm_out.linear"], True)]
    for i in range(len(m.transformer_blocks)):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        g += [(b + "img_mod.lin", [d + "norm1.linear"], False), (b + "txt_mod.lin", [d + "norm1_context.linear"], False),
              (b + "img_attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], False),
              (b + "txt_attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], False),
              (b + "img_attn.proj", [d + "attn.to_out.0"], False), (b + "txt_attn.proj", [d + "attn.to_add_out"], False),
              (b + "img_mlp.0", [d + "ff.net.0.proj"], False), (b + "img_mlp.2", [d + "ff.net.2"], False),
              (b + "txt_mlp.0", [d + "ff_context.net.0.proj"], False), (b + "txt_mlp.2", [d + "ff_context.net.2"], False)]
    for i in range(len(m.single_transformer_blocks)):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        g += [(b + "modulation.lin", [d + "norm.linear"], False), (b + "linear2", [d + "proj_out"], False),
              (b + "linear1", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"], False)]
    return g


def flux_norms(m) -> dict[str, str]:
    """diffusers norm weight -> BFL name."""
    out = {}
    for i in range(len(m.transformer_blocks)):
        d, b = f"transformer_blocks.{i}.attn.", f"double_blocks.{i}."
        out.update({d + "norm_q.weight": b + "img_attn.norm.query_norm.scale",
                    d + "norm_k.weight": b + "img_attn.norm.key_norm.scale",
                    d + "norm_added_q.weight": b + "txt_attn.norm.query_norm.scale",
                    d + "norm_added_k.weight": b + "txt_attn.norm.key_norm.scale"})
    for i in range(len(m.single_transformer_blocks)):
        d, b = f"single_transformer_blocks.{i}.attn.", f"single_blocks.{i}.norm."
        out.update({d + "norm_q.weight": b + "query_norm.scale", d + "norm_k.weight": b + "key_norm.scale"})
    return out


WAN_RENAMES = [("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
               ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
               ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
               ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
               ("condition_embedder.time_proj", "time_projection.1"), (".attn1.", ".self_attn."),
               (".attn2.", ".cross_attn."), (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."),
               (".to_v.", ".v."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), (".norm2.", ".norm__x."),
               (".norm3.", ".norm2."), (".norm__x.", ".norm3.")]


def wan_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("proj_out."):
        return "head.head." + name.removeprefix("proj_out.")
    for new, old in WAN_RENAMES:
        name = name.replace(new, old)
    return name.replace("scale_shift_table", "modulation")


def wan_groups(m) -> list[tuple[str, list[str], bool]]:
    layers = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    return [(wan_name(n + ".weight").removesuffix(".weight"), [n], False) for n in layers]


# --------------------------------------------------------------------------------- writing a ComfyUI file


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 with scale = amax / 448, as ComfyUI's converters make it."""
    scale = (w.float().abs().amax() / 448.0).reshape(())
    return (w.float() / scale).to(E4M3), scale


def _join(vals: list[torch.Tensor], swap: bool) -> torch.Tensor:
    if swap:  # diffusers [scale, shift] -> BFL [shift, scale]
        scale, shift = vals[0].chunk(2)
        return torch.cat([shift, scale])
    return torch.cat(vals)


def _split(t: torch.Tensor, sizes: list[int], swap: bool) -> list[torch.Tensor]:
    if swap:
        shift, scale = t.chunk(2)
        return [torch.cat([scale, shift])]
    return list(t.split(sizes))


def write_file(path: Path, m, groups, other: dict[str, str], fp8: bool = True, prefix: str = "",
               marker: bool = True) -> dict[str, torch.Tensor]:
    """Write `m` (a diffusers model) in the original layout to `path`, every linear fp8-scaled where `fp8`;
    returns the reference weights: diffusers name -> e4m3.to(dt) * scale.to(dt) for each quantized weight."""
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    out, ref = {}, {}
    for layer, parts, swap in groups:
        for suffix in ("weight", "bias"):
            names = [f"{p}.{suffix}" for p in parts]
            if names[0] not in sd:
                continue
            joined = _join([sd[n] for n in names], swap)
            if suffix == "weight" and fp8:
                q, scale = quantize(joined)
                out[f"{layer}.weight"], out[f"{layer}.scale_weight"] = q, scale
                dt = sd[names[0]].dtype
                deq = q.to(dt) * scale.to(dt)
                ref.update(zip(names, _split(deq, [sd[n].shape[0] for n in names], swap)))
            else:
                out[f"{layer}.{suffix}"] = joined.contiguous()
    for name, orig in other.items():
        out[orig] = sd[name]
    if fp8 and marker:
        out["scaled_fp8"] = torch.empty(0, dtype=E4M3)
    save_file({prefix + k: v.contiguous() for k, v in out.items()}, str(path))
    return ref


def reference(m, ref: dict[str, torch.Tensor]):
    """The plain torch reference: a copy of `m` whose quantized linears hold the dequantized weights."""
    r = copy.deepcopy(m)
    r.load_state_dict(ref, strict=False)
    return r


# ------------------------------------------------------------------------------------------------ models


def flux_case(tmp_path: Path, **kw):
    m, blocks, inputs = tiny.flux()
    m = m.to(BF16)
    inputs = {k: (v.to(BF16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in inputs.items()}
    path = tmp_path / "flux1-tiny-fp8_scaled.safetensors"
    other = {k: v for k, v in flux_norms(m).items()}
    ref = write_file(path, m, flux_groups(m), other, **kw)
    return m, dict(m.config), inputs, path, ref


def wan_case(tmp_path: Path, **kw):
    m, blocks, inputs = tiny.wan(mixed=True)
    linear = {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    other = {k: wan_name(k) for k in m.state_dict() if k.rsplit(".", 1)[0] not in linear}
    path = tmp_path / "wan-tiny-fp8_scaled.safetensors"
    ref = write_file(path, m, wan_groups(m), other, **kw)
    return m, dict(m.config), inputs, path, ref


CASES = {"flux": flux_case, "wan": wan_case}


def forward(m, inputs):
    with torch.no_grad():
        return m(**inputs)[0]


def blocks_of(m):
    return [m.transformer_blocks, m.single_transformer_blocks] if hasattr(m, "single_transformer_blocks") else [m.blocks]
