"""Exact parameter count of one transformer block, derived from the layer layout.

One function per `BlockArch`; each body lists the block's submodules in the order the diffusers 0.42.1 class
creates them (attribute names in the comments), so it can be checked line by line against
`diffusers/models/transformers/transformer_{wan,flux,hunyuan_video,qwenimage}.py`. The test suite checks every
count against the real block instantiated on the meta device.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from chunkflow_planner.catalog import ModelSpec


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    """nn.Linear(n_in, n_out, bias)."""
    return n_in * n_out + (n_out if bias else 0)


def feed_forward(d: int, f: int) -> int:
    """diffusers FeedForward(d, inner_dim=f, activation_fn="gelu-approximate"): net.0.proj then net.2."""
    return linear(d, f) + linear(f, d)


def _head_dim(spec: ModelSpec) -> int:
    if spec.d % spec.heads:
        raise ValueError(f"{spec.name}: d={spec.d} is not a multiple of heads={spec.heads}")
    return spec.d // spec.heads


def _config(spec: ModelSpec, key: str, default: Any) -> Any:
    """A constructor argument of the diffusers model, or the class default when the config leaves it out."""
    return spec.diffusers.config.get(key, default)


def _qk_norm(kind: str | None, head_dim: int) -> int:
    """One per-head q or k norm of diffusers `Attention(qk_norm=kind)` (elementwise_affine=True)."""
    if kind is None:
        return 0
    if kind == "rms_norm":  # RMSNorm(head_dim): weight
        return head_dim
    if kind == "layer_norm":  # nn.LayerNorm(head_dim): weight + bias
        return 2 * head_dim
    raise ValueError(f"qk_norm {kind!r} is not supported by chunkflow_planner.params")


def wan_dit(spec: ModelSpec) -> int:
    """WanTransformerBlock: self-attention, cross-attention to text, FFN, AdaLN table."""
    d, f = spec.d, spec.f
    added_kv = _config(spec, "added_kv_proj_dim", None)  # I2V image-context projections in attn2
    cross_attn_norm = _config(spec, "cross_attn_norm", True)
    # WanAttention always builds norm_q / norm_k as RMSNorm(d) across heads; config `qk_norm` is not used by it.
    attn_qk_norms = 2 * d  # norm_q.weight, norm_k.weight

    norm1 = 0  # FP32LayerNorm(elementwise_affine=False)
    attn1 = 3 * linear(d, d) + linear(d, d) + attn_qk_norms  # to_q, to_k, to_v; to_out.0; norm_q, norm_k
    attn2 = 3 * linear(d, d) + linear(d, d) + attn_qk_norms  # same layout, k/v read the text states
    if added_kv is not None:
        attn2 += 2 * linear(added_kv, d) + d  # add_k_proj, add_v_proj; norm_added_k (RMSNorm(d))
    norm2 = 2 * d if cross_attn_norm else 0  # FP32LayerNorm(d, elementwise_affine=True): weight + bias
    ffn = feed_forward(d, f)  # ffn.net.0.proj, ffn.net.2
    norm3 = 0  # FP32LayerNorm(elementwise_affine=False)
    scale_shift_table = 6 * d  # nn.Parameter(1, 6, d)
    return norm1 + attn1 + attn2 + norm2 + ffn + norm3 + scale_shift_table


def flux_double(spec: ModelSpec) -> int:
    """FluxTransformerBlock: joint attention over image and text streams, one FFN and AdaLN per stream."""
    d, f, hd = spec.d, spec.f, _head_dim(spec)
    norm1 = linear(d, 6 * d)  # AdaLayerNormZero.linear (its LayerNorm has no affine)
    norm1_context = linear(d, 6 * d)
    attn = (
        2 * hd  # FluxAttention.norm_q, norm_k: RMSNorm(head_dim)
        + 3 * linear(d, d)  # to_q, to_k, to_v (bias=True)
        + linear(d, d)  # to_out.0
        + 2 * hd  # norm_added_q, norm_added_k
        + 3 * linear(d, d)  # add_q_proj, add_k_proj, add_v_proj
        + linear(d, d)  # to_add_out
    )
    ff = feed_forward(d, f)  # norm2 has no affine; ff: FeedForward(d, mult=4)
    ff_context = feed_forward(d, f)  # norm2_context has no affine
    return norm1 + norm1_context + attn + ff + ff_context


def flux_single(spec: ModelSpec) -> int:
    """FluxSingleTransformerBlock: one stream, attention and MLP in parallel, fused output projection."""
    d, f, hd = spec.d, spec.f, _head_dim(spec)
    norm = linear(d, 3 * d)  # AdaLayerNormZeroSingle.linear
    proj_mlp = linear(d, f)  # mlp_hidden_dim = d * mlp_ratio
    proj_out = linear(d + f, d)  # concat(attention, mlp) -> d
    attn = 2 * hd + 3 * linear(d, d)  # norm_q, norm_k; to_q, to_k, to_v (pre_only: no to_out)
    return norm + proj_mlp + proj_out + attn


def hunyuan_double(spec: ModelSpec) -> int:
    """HunyuanVideoTransformerBlock: the Flux double-stream layout with a configurable qk norm."""
    d, f, hd = spec.d, spec.f, _head_dim(spec)
    qk = _qk_norm(_config(spec, "qk_norm", "rms_norm"), hd)
    norm1 = linear(d, 6 * d)  # AdaLayerNormZero(norm_type="layer_norm").linear
    norm1_context = linear(d, 6 * d)
    attn = (
        2 * qk  # Attention.norm_q, norm_k
        + 3 * linear(d, d)  # to_q, to_k, to_v (bias=True)
        + 2 * linear(d, d)  # add_k_proj, add_v_proj (added_kv_proj_dim=d)
        + linear(d, d)  # add_q_proj (context_pre_only is not None)
        + linear(d, d)  # to_out.0
        + linear(d, d)  # to_add_out (context_pre_only=False)
        + 2 * qk  # norm_added_q, norm_added_k
    )
    ff = feed_forward(d, f)  # norm2 no affine; FeedForward(d, mult=mlp_ratio)
    ff_context = feed_forward(d, f)
    return norm1 + norm1_context + attn + ff + ff_context


def hunyuan_single(spec: ModelSpec) -> int:
    """HunyuanVideoSingleTransformerBlock: the Flux single-stream layout with a configurable qk norm."""
    d, f, hd = spec.d, spec.f, _head_dim(spec)
    qk = _qk_norm(_config(spec, "qk_norm", "rms_norm"), hd)
    attn = 2 * qk + 3 * linear(d, d)  # norm_q, norm_k; to_q, to_k, to_v (pre_only: no to_out)
    norm = linear(d, 3 * d)  # AdaLayerNormZeroSingle.linear
    proj_mlp = linear(d, f)  # mlp_dim = d * mlp_ratio
    proj_out = linear(d + f, d)
    return attn + norm + proj_mlp + proj_out


def qwen_double(spec: ModelSpec) -> int:
    """QwenImageTransformerBlock: dual-stream MMDiT, per-stream modulation and MLP, joint attention."""
    d, f, hd = spec.d, spec.f, _head_dim(spec)
    qk = _qk_norm("rms_norm", hd)  # the block's qk_norm default; the model class does not pass one
    img_mod = linear(d, 6 * d)  # img_mod.1 (after SiLU)
    attn = (
        2 * qk  # norm_q, norm_k
        + 3 * linear(d, d)  # to_q, to_k, to_v
        + 2 * linear(d, d)  # add_k_proj, add_v_proj
        + linear(d, d)  # add_q_proj
        + linear(d, d)  # to_out.0
        + linear(d, d)  # to_add_out
        + 2 * qk  # norm_added_q, norm_added_k
    )
    img_mlp = feed_forward(d, f)  # img_norm1 / img_norm2 have no affine
    txt_mod = linear(d, 6 * d)  # txt_mod.1
    txt_mlp = feed_forward(d, f)  # txt_norm1 / txt_norm2 have no affine
    return img_mod + attn + img_mlp + txt_mod + txt_mlp


def block_fp32_params(arch: str, spec: ModelSpec) -> int:
    """Of a block's parameters, those its class keeps in float32 in a bf16 model (diffusers' _keep_in_fp32_modules
    matched inside the block): Wan's scale_shift_table and norm2; none elsewhere."""
    if arch != "wan_dit":
        return 0
    return 6 * spec.d + (2 * spec.d if _config(spec, "cross_attn_norm", True) else 0)


def fp8_kept_params(arch: str, spec: ModelSpec) -> int:
    """Of a block's parameters, those fp8 storage keeps in their own dtype: diffusers' layerwise casting (the
    runtime's runtime/storage.cast_layers) casts only linear and convolution layers, and skips every module named
    like *norm*, so the AdaLayerNorm modulation linears of FLUX and HunyuanVideo (a fifth to a third of their
    blocks), the qk norms and Wan's modulation table stay as they are."""
    d, hd = spec.d, _head_dim(spec)
    if arch == "wan_dit":
        added = d if _config(spec, "added_kv_proj_dim", None) is not None else 0
        return 4 * d + added + block_fp32_params(arch, spec)
    if arch == "flux_double":
        return 2 * linear(d, 6 * d) + 4 * hd
    if arch == "flux_single":
        return linear(d, 3 * d) + 2 * hd
    qk = _qk_norm(_config(spec, "qk_norm", "rms_norm"), hd)
    if arch == "hunyuan_double":
        return 2 * linear(d, 6 * d) + 4 * qk
    if arch == "hunyuan_single":
        return linear(d, 3 * d) + 2 * qk
    if arch == "qwen_double":
        return 4 * _qk_norm("rms_norm", hd)
    raise ValueError(f"unknown block arch {arch!r}; known: {', '.join(BLOCK_PARAMS)}")


BLOCK_PARAMS: dict[str, Callable[[ModelSpec], int]] = {
    "wan_dit": wan_dit,
    "flux_double": flux_double,
    "flux_single": flux_single,
    "hunyuan_double": hunyuan_double,
    "hunyuan_single": hunyuan_single,
    "qwen_double": qwen_double,
}


def block_params(arch: str, spec: ModelSpec) -> int:
    """Parameters of one block of layout `arch` in model `spec`."""
    try:
        fn = BLOCK_PARAMS[arch]
    except KeyError:
        raise ValueError(f"unknown block arch {arch!r}; known: {', '.join(BLOCK_PARAMS)}") from None
    return fn(spec)


# ---- the 2-D weights of a block, which stored formats quantize (chunkflow_planner/formats.py)

Shape2D = tuple[int, int]


def _linears(n: int, n_in: int, n_out: int) -> list[Shape2D]:
    """`n` nn.Linear(n_in, n_out) weights, as (out, in) shapes."""
    return [(n_out, n_in)] * n


def _wan_linears(spec: ModelSpec) -> list[Shape2D]:
    d, f = spec.d, spec.f
    added_kv = _config(spec, "added_kv_proj_dim", None)
    out = _linears(4, d, d) + _linears(4, d, d)  # attn1 to_q, to_k, to_v, to_out.0; attn2 the same
    if added_kv is not None:
        out += _linears(2, added_kv, d)  # attn2 add_k_proj, add_v_proj
    return out + [(f, d), (d, f)]  # ffn.net.0.proj, ffn.net.2


def _mmdit_double_linears(spec: ModelSpec) -> list[Shape2D]:
    """FLUX, HunyuanVideo and Qwen-Image double-stream blocks: two modulation linears (d -> 6d), eight d x d
    attention projections (q, k, v and out of each stream), two FFNs."""
    d, f = spec.d, spec.f
    return _linears(2, d, 6 * d) + _linears(8, d, d) + [(f, d), (d, f)] * 2


def _mmdit_single_linears(spec: ModelSpec) -> list[Shape2D]:
    """FLUX and HunyuanVideo single-stream blocks: modulation (d -> 3d), q, k, v, the MLP in and the fused out."""
    d, f = spec.d, spec.f
    return [(3 * d, d)] + _linears(3, d, d) + [(f, d), (d, d + f)]


LINEAR_SHAPES: dict[str, Callable[[ModelSpec], list[Shape2D]]] = {
    "wan_dit": _wan_linears,
    "flux_double": _mmdit_double_linears,
    "flux_single": _mmdit_single_linears,
    "hunyuan_double": _mmdit_double_linears,
    "hunyuan_single": _mmdit_single_linears,
    "qwen_double": _mmdit_double_linears,
}


def linear_shapes(arch: str, spec: ModelSpec) -> list[Shape2D]:
    """The (out, in) shapes of the 2-D weights of one block of layout `arch` (every nn.Linear's weight; the rest of
    block_params are 1-D biases and norms, and Wan's 3-D modulation table)."""
    try:
        fn = LINEAR_SHAPES[arch]
    except KeyError:
        raise ValueError(f"unknown block arch {arch!r}; known: {', '.join(LINEAR_SHAPES)}") from None
    return fn(spec)
