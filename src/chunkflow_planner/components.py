"""The rest of a diffusion pipeline, as the planner needs it: text encoders, the VAE, the scheduler and the
pipeline's own defaults (models.yaml, `pipeline:` of each model).

A text encoder's parameters are derived from its config (`encoder_params`, one function per architecture, listed in
the order the transformers classes build their submodules) and checked by the tests against the class instantiated
on the meta device, as the transformer blocks are (params.py). Pure Python: no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# "other": a class none of these describes, in an entry derived from a folder: priced from its measured shape
TextEncoderArch = Literal["t5_encoder", "umt5_encoder", "clip_text", "llama", "qwen2_5_vl", "other"]
TextMask = Literal["padded", "full", "none"]
TokenizerKind = Literal["t5", "clip", "llama3", "qwen2", "folder"]  # folder: the pipeline folder's own tokenizer
PipelineAdapter = Literal["wan", "flux", "hunyuan_video", "qwen_image", "generic"]  # generic: a derived entry's


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _c(config: dict, *keys: str, default: Any = None) -> Any:
    """The first of `keys` present in `config` (transformers renamed a few between versions)."""
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    if default is None:
        raise KeyError(f"config lacks {' / '.join(keys)}")
    return default


# ---------------------------------------------------------------------------------------- parameters


def t5_encoder_params(c: dict, per_layer_bias: bool) -> tuple[int, int]:
    """(total, one layer) of T5EncoderModel / UMT5EncoderModel: shared embedding, layers of self-attention
    (q, k, v, o without bias; UMT5: a relative-position bias in every layer, T5: in the first), a gated or plain
    FFN, two RMS norms; a final norm."""
    d, ff, H, dkv, n = c["d_model"], c["d_ff"], c["num_heads"], c["d_kv"], c["num_layers"]
    gated = str(c.get("feed_forward_proj", "relu")).startswith("gated")
    bias = c.get("relative_attention_num_buckets", 32) * H
    layer = 4 * d * H * dkv + (3 if gated else 2) * d * ff + 2 * d + (bias if per_layer_bias else 0)
    return c["vocab_size"] * d + n * layer + (0 if per_layer_bias else bias) + d, layer


def clip_text_params(c: dict) -> tuple[int, int]:
    """(total, one layer) of CLIPTextModel: token and position embeddings, layers of attention (q, k, v, out with
    bias), two layer norms and an MLP (fc1, fc2); a final layer norm."""
    h, ff, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    layer = 4 * (h * h + h) + 2 * 2 * h + (h * ff + ff) + (ff * h + h)
    return c["vocab_size"] * h + c.get("max_position_embeddings", 77) * h + n * layer + 2 * h, layer


def _decoder_layer(h: int, ff: int, heads: int, kv: int, hd: int, qkv_bias: bool) -> int:
    """One Llama / Qwen2 decoder layer: q, k, v (bias for Qwen2), o; gated MLP; two RMS norms."""
    return (h * heads * hd + 2 * h * kv * hd + (heads * hd + 2 * kv * hd if qkv_bias else 0) + heads * hd * h
            + 3 * h * ff + 2 * h)


def llama_params(c: dict) -> tuple[int, int]:
    """(total, one layer) of LlamaModel (no LM head): embeddings, decoder layers, final norm."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    layer = _decoder_layer(h, c["intermediate_size"], heads, kv, hd, bool(c.get("attention_bias", False)))
    return c["vocab_size"] * h + c["num_hidden_layers"] * layer + h, layer


def qwen2_5_vl_params(c: dict) -> tuple[int, int]:
    """(total, one text layer) of Qwen2_5_VLForConditionalGeneration: the language model (embeddings, decoder
    layers with q/k/v bias, final norm), the LM head (unless tied) and the vision tower (patch embedding, blocks of
    attention and gated MLP with biases, the patch merger)."""
    t = c.get("text_config") or c
    h, heads = t["hidden_size"], t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    hd = h // heads
    vocab = t.get("vocab_size") or c["vocab_size"]
    layer = _decoder_layer(h, t["intermediate_size"], heads, kv, hd, True)
    text = vocab * h + t["num_hidden_layers"] * layer + h
    tied = c.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    head = 0 if tied else vocab * h
    v = c["vision_config"]
    vh, vff, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    patch = v.get("in_channels", v.get("in_chans", 3)) * v.get("temporal_patch_size", 2) * v["patch_size"] ** 2 * vh
    block = 2 * vh + (vh * 3 * vh + 3 * vh) + (vh * vh + vh) + 2 * (vh * vff + vff) + (vff * vh + vh)
    merged = vh * v.get("spatial_merge_size", 2) ** 2
    merger = vh + (merged * merged + merged) + (merged * v["out_hidden_size"] + v["out_hidden_size"])
    return text + head + patch + depth * block + merger, layer


def encoder_params(arch: str, config: dict) -> tuple[int, int]:
    """(total parameters, parameters of one repeated layer) of a text encoder of `arch` with `config`."""
    if arch == "t5_encoder":
        return t5_encoder_params(config, per_layer_bias=False)
    if arch == "umt5_encoder":
        return t5_encoder_params(config, per_layer_bias=True)
    if arch == "clip_text":
        return clip_text_params(config)
    if arch == "llama":
        return llama_params(config)
    if arch == "qwen2_5_vl":
        return qwen2_5_vl_params(config)
    raise ValueError(f"unknown text encoder arch {arch!r}")


# ------------------------------------------------------------------------------------------------ specs


class TextEncoderSpec(_Strict):
    """One text encoder of a pipeline and the tokenizer that feeds it."""

    component: str = Field(description="the pipeline's attribute, e.g. text_encoder or text_encoder_2")
    tokenizer: str = Field(description="the pipeline's tokenizer attribute, e.g. tokenizer")
    cls: str = Field(description="transformers class, e.g. UMT5EncoderModel")
    arch: TextEncoderArch
    tokenizer_kind: TokenizerKind = Field(description="which local tokenizer a random-weight pipeline builds")
    config: dict[str, Any] = Field(description="the checkpoint's config.json (keys starting with _ dropped)")
    total_params: int = Field(gt=0, description="every parameter, as the meta-device instantiation counts them")
    tokens: int = Field(gt=0, description="tokens per prompt the pipeline feeds it (padded length, or template + prompt)")
    block_list: str = Field(description="dotted attribute path of its repeated layers (what chunkflow can stream)")
    mask: TextMask = Field("padded", description="the attention mask the pipeline passes: `padded` (the prompt's "
                           "tokens, then padding), `full` (every token real) or `none` (no mask); transformers "
                           "dispatches different operators for each")
    dtype_bytes: int = Field(2, gt=0)
    measured: dict[str, Any] | None = Field(None, description="arch `other` (a derived entry): its shape as shape() "
                                            "gives it, measured on the meta device, and `layer_params`")
    margin: float = Field(1.0, ge=1.0, le=4.0, description="factor on its modelled time and activations: above 1 "
                          "for a class no calibration has timed, priced from its shapes")

    @model_validator(mode="after")
    def _other_measured(self) -> "TextEncoderSpec":
        if self.arch == "other" and self.measured is None:
            raise ValueError("a text encoder of arch `other` needs its measured shape")
        return self

    @property
    def nbytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        if self.measured is not None:
            return int(self.measured["layer_params"])
        return encoder_params(self.arch, self.config)[1]

    def shape(self) -> dict[str, Any]:
        """d, ff, heads, head_dim, kv_heads, layers, gated, eager_attention: what the operator model needs."""
        if self.measured is not None:
            return {k: v for k, v in self.measured.items() if k != "layer_params"}
        c = self.config
        if self.arch in ("t5_encoder", "umt5_encoder"):
            return dict(d=c["d_model"], ff=c["d_ff"], heads=c["num_heads"], head_dim=c["d_kv"], kv_heads=c["num_heads"],
                        layers=c["num_layers"], gated=str(c.get("feed_forward_proj", "")).startswith("gated"),
                        eager_attention=True)  # T5's relative-position bias: attention scores are materialised
        t = c.get("text_config") or c
        heads = t["num_attention_heads"]
        return dict(d=t["hidden_size"], ff=t["intermediate_size"], heads=heads,
                    head_dim=t.get("head_dim") or t["hidden_size"] // heads,
                    kv_heads=t.get("num_key_value_heads") or heads,
                    layers=t["num_hidden_layers"], gated=self.arch != "clip_text", eager_attention=False)


class VaeTiling(_Strict):
    """How diffusers' tiled decode of this VAE splits the latents (the class's `enable_tiling()` defaults, checked
    against the class by the tests): square spatial tiles of `tile_px` output pixels every `stride_px`, and along
    time one decoder call per latent frame (`per_frame`: Wan, Qwen-Image), per chunk of `tile_frames` output frames
    every `stride_frames` (`chunks`: HunyuanVideo), or none (`none`: images). A tiled decode costs about the same
    per decoder call whatever the tile's share of the image (edge tiles are not cheaper; measured on an H200), so
    its time is fitted per call (catalog.VaeDecodeFit.time_per_call)."""

    tile_px: int = Field(gt=0)
    stride_px: int = Field(gt=0)
    frames: Literal["per_frame", "chunks", "none"] = "none"
    tile_frames: int | None = Field(None, gt=0)
    stride_frames: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _complete(self) -> "VaeTiling":
        if self.stride_px > self.tile_px:
            raise ValueError(f"stride_px {self.stride_px} exceeds tile_px {self.tile_px}: tiles would leave gaps")
        if self.frames == "chunks" and (self.tile_frames is None or self.stride_frames is None):
            raise ValueError("frames: chunks needs tile_frames and stride_frames")
        return self

    def decoder_calls(self, height: int, width: int, latent_frames: int, spatial: int, temporal: int | None) -> int:
        """Decoder calls of one tiled decode of a (latent_frames x height/spatial x width/spatial) latent, as
        diffusers' tiled_decode loops (a size within one tile is not tiled: one call per frame or chunk)."""
        lh, lw, lmin, lstride = height // spatial, width // spatial, self.tile_px // spatial, self.stride_px // spatial
        if lstride < 1:
            raise ValueError(f"a tile stride of {self.stride_px} px is under one latent pixel ({spatial} px)")
        tiles = -(-lh // lstride) * -(-lw // lstride) if (lh > lmin or lw > lmin) else 1
        if self.frames == "per_frame":
            return tiles * latent_frames
        if self.frames == "chunks":
            vt = temporal or 1
            tmin, tstride = self.tile_frames // vt, max(1, self.stride_frames // vt)  # both set (the validator)
            return tiles * (-(-latent_frames // tstride) if latent_frames > tmin else 1)
        return tiles


def derived_vae_name(cls_name: str, config: dict[str, Any], dtype: str) -> str:
    """The name of a VAE no catalog entry has (models/derive.py): its class and a digest of its config and dtype, so
    a profile's decode fit (measured by `calibrate --weights`, kept by name) and a refit's samples belong to that VAE
    alone, not to every VAE of its class."""
    import hashlib
    import json

    blob = json.dumps({"cls": cls_name, "config": config, "dtype": dtype}, sort_keys=True, default=str)
    return f"{cls_name}:derived-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


class VaeSpec(_Strict):
    """The pipeline's VAE: its diffusers class and config, and how its decode was measured."""

    @model_validator(mode="before")
    @classmethod
    def _named_by_config(cls, data: Any) -> Any:
        """A derived VAE of a plan or report written before its name held its config's digest ("CLS:derived") is
        read under the name it has now, so a profile's fit of that VAE prices it."""
        if isinstance(data, dict) and data.get("name") == f"{data.get('cls')}:derived" and "config" in data:
            data = {**data, "name": derived_vae_name(data["cls"], data["config"], data.get("dtype", "bfloat16"))}
        return data

    name: str = Field(description="the VAE's name, shared by models that use the same one (e.g. wan2.1-vae); "
                      "measured decode fits are kept by it")
    component: str = "vae"
    cls: str = Field(description="diffusers class, e.g. AutoencoderKLWan")
    config: dict[str, Any]
    total_params: int = Field(gt=0)
    decoder_params: int = Field(gt=0, description="parameters decode runs (post-quant conv and decoder)")
    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="the dtype the pipeline runs it in")
    decode: dict[str, Any] | None = Field(None, description="a VaeDecodeFit measured on a GPU (catalog.VaeDecodeFit)")
    tiling: VaeTiling | None = Field(None, description="how its tiled decode splits the latents")
    tiled_only: bool = Field(False, description="its class decodes only with tiling on (diffusers raises "
                             "NotImplementedError without enable_tiling(), as AutoencoderKLAllegro does): every plan "
                             "decodes it tiled")

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def nbytes(self) -> int:
        return self.total_params * self.dtype_bytes


class SchedulerSpec(_Strict):
    cls: str
    config: dict[str, Any] = {}


class PipelineSpec(_Strict):
    """A whole diffusers pipeline around the catalog transformer."""

    cls: str = Field(description="diffusers pipeline class, e.g. WanPipeline")
    adapter: PipelineAdapter = Field(description="how chunkflow calls its phases (models/pipeline_adapters.py)")
    text_encoders: list[TextEncoderSpec] = Field(min_length=1)
    vae: VaeSpec
    scheduler: SchedulerSpec
    guidance: float = Field(gt=0, description="the pipeline's default guidance scale")
    guidance_2: float | None = Field(None, gt=0, description="guidance of the second expert (Wan2.2-A14B)")
    experts: int = Field(1, ge=1, le=2, description="transformers of the same architecture taking turns (A14B: 2)")
    boundary_ratio: float | None = Field(None, gt=0, lt=1, description="A14B: the high-noise expert runs for "
                                         "timesteps >= boundary_ratio * num_train_timesteps")
    fps: int | None = Field(None, gt=0, description="frame rate of the videos it makes")
    config: dict[str, Any] = Field(default_factory=dict, description="extra pipeline constructor arguments")
    source: str = ""
