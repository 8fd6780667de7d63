"""GGUF files for tests, written with the gguf package as city96's and QuantStack's converters write them: the
original (non-diffusers) key names, the 2-D weights in the chosen ggml type, 1-D tensors (norms, biases) in F32.

Q8_0, Q4_0 (and F16, BF16) are quantized by gguf-py; it cannot quantize the K types, so their blocks are random
bytes with finite fp16 scale fields (valid blocks: every dequantized value finite)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# K type -> byte ranges of each block's fp16 scale fields (d, dmin): set to small finite values
_K_SCALES = {Q.Q4_K: [(0, 2), (2, 4)], Q.Q5_K: [(0, 2), (2, 4)], Q.Q6_K: [(208, 210)]}


def quantized(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """`values` (float32, 2-D) stored as `qtype`: the uint8 block bytes (K types: valid random blocks)."""
    if qtype in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.BF16, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for lo, hi in _K_SCALES[qtype]:
        scale = (rng.random((rows, cols // block)) * 1e-4 + 1e-5).astype(np.float16)
        raw[:, :, lo:hi] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path: Path, tensors: dict[str, torch.Tensor], qtype: Q, arch: str = "flux", seed: int = 0) -> Path:
    """Write `tensors` (original key names) to a GGUF file: the 2-D weights whose rows fit `qtype`'s blocks in that
    type, the rest (1-D tensors, modulation tables, convolutions, odd rows) in F32."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    for name, t in tensors.items():
        a = t.detach().float().numpy()
        if a.ndim == 2 and name.endswith(".weight") and a.shape[-1] % block == 0 and qtype != Q.F32:
            flat = a.reshape(-1, a.shape[-1])
            q = quantized(flat, qtype, rng)
            q = q.reshape(*a.shape[:-1], q.shape[-1])
            w.add_tensor(name, q, raw_dtype=qtype if q.dtype == np.uint8 else None)
        else:
            w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------ tiny real architectures

FLUX_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=128,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))  # rows of 256 (K types' blocks) in every block's linear layers
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=512, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

# diffusers' Wan names -> the original (Wan-AI / city96 GGUF) names: the inverse of diffusers'
# convert_wan_transformer_to_diffusers, applied in this order (norm2 and norm3 swap)
_WAN_BACK = [("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
             ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
             ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
             ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
             ("condition_embedder.time_proj", "time_projection.1"), ("attn2", "cross_attn"), ("attn1", "self_attn"),
             (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
             ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), (".norm2.", ".norm__x."), (".norm3.", ".norm2."),
             (".norm__x.", ".norm3."), ("proj_out", "head.head")]


def wan_original_name(key: str) -> str:
    """A diffusers WanTransformer3DModel tensor name as Wan's own checkpoints (and city96's GGUF files) spell it."""
    if key == "scale_shift_table":
        return "head.modulation"
    if key.endswith(".scale_shift_table"):
        return key.replace(".scale_shift_table", ".modulation")
    for new, old in _WAN_BACK:
        key = key.replace(new, old)
    return key


def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**FLUX_CONFIG).eval()


def tiny_wan(seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**WAN_CONFIG).eval()


def flux_inputs(dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(4, 4, 3)
    ids[..., 1] = torch.arange(4)[:, None]
    ids[..., 2] = torch.arange(4)[None]
    return dict(hidden_states=torch.randn(1, 16, 16, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(1, 6, 32, generator=g).to(dtype),
                pooled_projections=torch.randn(1, 16, generator=g).to(dtype), timestep=torch.tensor([0.5]),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(6, 3), guidance=torch.tensor([3.5]),
                return_dict=False)


def wan_inputs(dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 7, 32, generator=g).to(dtype), return_dict=False)


def save_config(model, folder: Path) -> Path:
    """The model's config.json in `folder` / transformer (what from_single_file's `config=` reads)."""
    model.save_config(folder / "transformer")
    return folder


def flux_gguf(folder: Path, qtype: Q, seed: int = 0) -> Path:
    """A tiny Flux transformer written to folder/flux-<type>.gguf (diffusers' names: see module docstring) and its
    config to folder/transformer/config.json."""
    m = tiny_flux(seed)
    save_config(m, folder)
    return write_gguf(folder / f"flux-{qtype.name}.gguf", m.state_dict(), qtype, "flux", seed)


def wan_gguf(folder: Path, qtype: Q, seed: int = 0) -> Path:
    """A tiny Wan transformer written to folder/wan-<type>.gguf in Wan's own names, config as flux_gguf."""
    m = tiny_wan(seed)
    save_config(m, folder)
    sd = {wan_original_name(k): v for k, v in m.state_dict().items()}
    return write_gguf(folder / f"wan-{qtype.name}.gguf", sd, qtype, "wan", seed)


def load_gguf(cls, path: Path, folder: Path, dtype=torch.bfloat16):
    """diffusers' own module from the file: from_single_file with GGUFQuantizationConfig."""
    from diffusers import GGUFQuantizationConfig

    return cls.from_single_file(str(path), quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
                                config=str(folder), subfolder="transformer", torch_dtype=dtype).eval()


# the two tiny architectures the GGUF tests cover: kind -> (file writer, diffusers class name, inputs)
KINDS = {"flux": (flux_gguf, "FluxTransformer2DModel", flux_inputs),
         "wan": (wan_gguf, "WanTransformer3DModel", wan_inputs)}
TYPES = [Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q4_0]  # the types users download, K and legacy


def gguf_module(folder: Path, kind: str, qtype: Q):
    """(diffusers' module loaded from a fresh `kind` file of `qtype`, its inputs, the file's path)."""
    import diffusers

    write, cls_name, inputs = KINDS[kind]
    path = write(folder, qtype)
    return load_gguf(getattr(diffusers, cls_name), path, folder), inputs(), path


def forward0(m, kw) -> torch.Tensor:
    """The module's first output, without autograd."""
    with torch.no_grad():
        return m(**kw)[0]
