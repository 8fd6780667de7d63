"""A model entry (catalog.ModelSpec) derived from a folder chunkflow has never seen (issue 37).

`derive_model(source)` takes a diffusers pipeline folder (model_index.json), a Hub id in the local Hugging Face
cache, a transformer folder or its config.json, and builds what the planner plans from:

- the transformer, on the meta device from its config.json (`_class_name`), in the dtypes chunkflow runs it in
  (bfloat16, float32 where the class keeps modules so): its block lists found by models/discover.py, each list cut
  into groups of blocks of one size, every block's parameters, float32 share and fp8-kept share measured (the
  runtime's own casting rule), the non-block parameters as the rest;
- its hidden size, heads and attention from its first attention module (`to_q`), its FFN size from the block's
  feed-forward, patch size and channels from the config; the block kind from the block's modules (close to one
  bit: an attention with context projections `add_q_proj` is joint double-stream attention; a second attention,
  or one marked cross-attention, is a DiT block reading the text by cross-attention; one attention alone is joint
  single-stream attention over the concatenated tokens), so the planner's FLOP and activation models apply;
- from model_index.json, the text encoders (a class the catalog prices as the catalog does, any other from its
  measured shape with TEXT_MARGIN), the VAE (the catalog's measured decode where the catalog has that VAE, else
  from its operator shapes on the meta device, models/vae_shapes.py; where the meta device cannot run its decoder,
  the nearest catalog VAE's decode scaled by decoder parameters, times VAE_MARGIN) and the scheduler;
- the default workload from the pipeline class's `__call__` defaults (and the transformer's sample size where
  those are None, as the pipelines do): models/derive_workload.py.

Whatever it cannot derive is named in one error with the `chunkflow plan` flag that supplies it. Family facts the
configs do not state live in models/families.py. Needs torch and diffusers (the planner package does not).
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkflow.models.derive_workload import (
    FRAME_PARAMS,
    cfg_passes,
    default_text_len,
    default_workload,
    missing_inputs,
    patch_sizes,
)
from chunkflow.models.families import Family
from chunkflow_planner.errors import ChunkflowError

if TYPE_CHECKING:
    from chunkflow_planner.components import PipelineSpec, TextEncoderSpec, VaeSpec

__all__ = ["ACTIVATION_MARGIN", "DeriveError", "derive_model", "describe_yaml", "TEXT_MARGIN", "VAE_MARGIN",
           "looks_like_folder"]

# An uncatalogued text encoder's modelled time and activations are multiplied by TEXT_MARGIN, and an uncatalogued
# VAE's decode time and memory (from the nearest catalog VAE, scaled by decoder parameters) by VAE_MARGIN: those
# operator models were fitted on the catalog's architectures only. 1.25 is the text model's largest error on the
# catalog's encoders rounded up (docs: host model within 25%); the VAE's 1.5 because a parameter ratio says
# nothing of the decoder's resolution schedule, the dominant cost.
TEXT_MARGIN = 1.25
VAE_MARGIN = 1.5
# A transformer class the catalog never measured has its activations priced by the default model (memory.py) times
# ACTIVATION_MARGIN: blocks hold temporaries the model does not count (rotary embeddings in float32, norms'
# copies); LTX-Video's and CogVideoX-5B's measured 2.8x and 2.2x the default on an H200 (docs/any-h200.md).
ACTIVATION_MARGIN = 3.0
RUN_DTYPE_BYTES = 2  # chunkflow runs transformers and text encoders in bfloat16

_FFN_NAMES = ("ff", "ffn", "mlp", "feed_forward", "img_mlp", "proj_mlp")


class DeriveError(ChunkflowError):
    """A folder a model entry cannot be derived from; the message says why and what to give instead."""


def looks_like_folder(model: str) -> bool:
    """Whether a `--model` value names a folder, a config.json or a Hub id rather than a catalog name."""
    p = Path(model).expanduser()
    return p.exists() or "/" in model or "\\" in model


# ------------------------------------------------------------------------------------------------ locating


def _locate(source: str) -> tuple[Path | None, Path, str]:
    """(pipeline folder or None, transformer folder, the name shown) of `source`."""
    from chunkflow.weights import MODEL_INDEX, resolve_weights

    path = Path(source).expanduser()
    if path.is_file():
        if path.name != "config.json":
            raise DeriveError(f"{source!r} is a file, not a diffusers folder; give a pipeline folder (holding "
                              f"{MODEL_INDEX}), a transformer folder or its config.json")
        return None, path.parent.absolute(), path.parent.absolute().name
    if path.is_dir():
        path = path.absolute()
        if (path / MODEL_INDEX).exists():
            return path, path / "transformer", path.name
        if (path / "config.json").is_file():
            return None, path, path.name
        raise DeriveError(f"{source!r} is not a diffusers pipeline folder: it holds neither {MODEL_INDEX} (a "
                          "pipeline, what pipe.save_pretrained writes) nor a transformer's config.json")
    folder = resolve_weights(source)  # a Hub id in the local cache (its error says how to download it)
    return folder, folder / "transformer", source.split("@")[0].split("/")[-1]


def _read(path: Path, what: str, name: str = "config.json") -> dict[str, Any]:
    from chunkflow_planner.checkpoint import CheckpointError, read_config

    try:
        return read_config(path, what, name)
    except CheckpointError as exc:
        raise DeriveError(str(exc)) from None


def _clean(config: dict) -> dict:
    return {k: v for k, v in json.loads(json.dumps(config)).items() if not k.startswith("_")}


# ------------------------------------------------------------------------------------------------ modules


def _diffusers_cls(name: Any, where: str, kind: str):
    import diffusers

    from chunkflow_planner.checkpoint import shown

    if not isinstance(name, str) or not name.isidentifier():
        raise DeriveError(f"{where} names no diffusers {kind} class (\"_class_name\" is {shown(name)}); is it a "
                          "diffusers config? re-download or re-save it")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise DeriveError(f"{where} names {name}, a class diffusers {diffusers.__version__} does not have; upgrade "
                          "diffusers (pip install -U diffusers) or give a folder of a class it has")
    return cls


def _meta(make, what: str):
    """A module built by `make()` with parameters on the meta device, then bfloat16 (float32 where its class keeps
    them so)."""
    import torch
    from torch import nn

    from chunkflow.models.meta import param_dtype, params_on_meta, swap_params

    try:
        with warnings.catch_warnings(), params_on_meta(), torch.device("cpu"):
            warnings.simplefilter("ignore")
            module = make()
    except Exception as exc:  # a config its class cannot be built from
        why = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise DeriveError(f"{what} cannot be built from its config.json ({type(exc).__name__}: {why}); the config "
                          "lacks keys its class needs or holds wrong values: re-download or re-save it") from None
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    swap_params(module, lambda p: nn.Parameter(torch.empty(
        p.shape, dtype=param_dtype(module, names[id(p)], torch.bfloat16) if p.is_floating_point() else p.dtype,
        device="meta"), requires_grad=False))
    return module.eval()


def _params(m) -> int:
    return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())


def _fp32(m) -> int:
    import torch

    return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values() if p.dtype == torch.float32)


def _attentions(block) -> list:
    from torch import nn

    return [m for m in block.modules() if isinstance(getattr(m, "to_q", None), nn.Linear)
            and isinstance(getattr(m, "to_k", None), nn.Module)]


def block_kind(block) -> str:
    """dit, mmdit_double or mmdit_single, from the block's attention modules (see the module docstring)."""
    attns = _attentions(block)
    if any(getattr(a, "add_q_proj", None) is not None for a in attns):
        return "mmdit_double"
    if len(attns) >= 2 or any(getattr(a, "is_cross_attention", False) for a in attns):
        return "dit"
    return "mmdit_single"


_ARCH = {"dit": "wan_dit", "mmdit_double": "flux_double", "mmdit_single": "flux_single"}  # nearest operator layout


def _ffn_size(block, d: int) -> int | None:
    """The FFN inner size the FLOP model's 2 matmuls of d x f stand for: the image stream's feed-forward weights
    over 2 d (a gated FFN's three matmuls count as 1.5 f)."""
    from torch import nn

    for name, m in block.named_children():
        if name == "proj_mlp" and isinstance(m, nn.Linear):  # single-stream: the MLP's up projection
            return m.out_features
        if name in _FFN_NAMES:
            w = sum(x.weight.numel() for x in m.modules() if isinstance(x, (nn.Linear, nn.Conv1d, nn.Conv2d)))
            return round(w / (2 * d)) if w else None
    return None


def _shape(block, config: dict) -> tuple[int, int, int]:
    """(d, heads, f) of the transformer, from its first block's attention and feed-forward."""
    attns = _attentions(block)
    if not attns:
        raise DeriveError(f"found no attention module (one with to_q and to_k) in a {type(block).__name__}: chunkflow "
                          "cannot price this block")
    a = attns[0]
    d = a.to_q.in_features
    heads = getattr(a, "heads", None) or config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0 or d % heads:
        raise DeriveError(f"cannot read the attention heads of {type(block).__name__} (config num_attention_heads: "
                          f"{config.get('num_attention_heads')!r}, hidden size {d})")
    f = _ffn_size(block, d) or 4 * d
    return d, heads, f


def _groups(module, lists) -> list[dict]:
    """BlockGroups of the found lists: runs of consecutive blocks of one size, measured."""
    import torch

    from chunkflow.runtime.storage import cast_tensors

    blocks = [(f"{n}.{i}", b) for n, lst in lists.items() for i, b in enumerate(lst)]
    cast = cast_tensors(module, blocks, torch.float8_e4m3fn)
    out: list[dict] = []
    for name, lst in lists.items():
        for i, b in enumerate(lst):
            ps = list({id(p): p for p in b.parameters()}.values())
            params = sum(p.numel() for p in ps)
            fp32 = sum(p.numel() for p in ps if p.dtype == torch.float32)
            kept = sum(p.numel() for p in ps if id(p) not in cast)
            key = dict(kind=block_kind(b), diffusers_list=name, params=params, fp32_params=fp32, fp8_kept_params=kept)
            last = out[-1] if out else None
            if last is not None and all(last[k] == v for k, v in key.items()):
                last["count"] += 1
            else:
                out.append(dict(key, arch=_ARCH[key["kind"]], count=1, first=i))
    return out


# ----------------------------------------------------------------------------------------------- pipeline


def _call_defaults(pipe_cls) -> dict[str, Any]:
    try:
        sig = inspect.signature(pipe_cls.__call__)
    except (TypeError, ValueError):
        return {}
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def _vae_factors(vae, cfg: dict, video: bool, fam) -> tuple[int, int | None]:
    spatial = (getattr(vae, "spatial_compression_ratio", None) or cfg.get("scale_factor_spatial")
               or cfg.get("spatial_compression_ratio"))
    if not spatial and isinstance(cfg.get("block_out_channels"), list):
        spatial = 2 ** (len(cfg["block_out_channels"]) - 1)
    temporal = None
    if video:
        temporal = (cfg.get("temporal_compression_ratio") or cfg.get("scale_factor_temporal")
                    or vars(vae).get("temporal_compression_ratio") or fam.vae_temporal  # an attribute, not config
                    or (1 if "2D" in "".join(cfg.get("down_block_types") or []) else None))  # frame by frame: Latte
    return int(spatial or fam.vae_spatial or 8), (int(temporal) if temporal else None)


def _header_float32(folder: Path) -> bool:
    """Whether the component's safetensors hold mostly float32 (what the pipeline then runs its VAE in)."""
    from chunkflow_planner.checkpoint import DIFFUSERS_STEM, open_checkpoint

    try:
        ckpt = open_checkpoint(folder, DIFFUSERS_STEM, None, fallback=True)
    except Exception:
        return False
    f32 = sum(t.nbytes for t in ckpt.tensors.values() if t.dtype == "F32")
    return f32 * 2 > ckpt.nbytes


def _vae_spec(folder: Path, name: str, cls_name: str, video: bool, notes: list[str], untimed: list[str]):
    from chunkflow_planner.catalog import load_models
    from chunkflow_planner.components import VaeSpec, derived_vae_name

    cfg = _read(folder / name, f"VAE {str(folder / name)!r}")
    cls = _diffusers_cls(cls_name, f"model_index.json in {str(folder)!r}", "VAE")
    vae = _meta(lambda: cls.from_config(cfg), f"VAE {str(folder / name)!r}")
    total = _params(vae)
    decoder = sum(_params(m) for n, m in vae.named_children() if n in ("decoder", "post_quant_conv")) or total
    dtype = "float32" if _header_float32(folder / name) else "bfloat16"
    specs = [s for s in load_models().values() if s.pipeline is not None]
    catalog = [s.pipeline.vae for s in specs]
    clean = _clean(cfg)
    for v in catalog:  # the catalog's VAE: its measured decode and tiling, its name (a profile's fit is by name)
        if v.cls == cls_name and all(clean.get(k) == val for k, val in v.config.items() if k in clean):
            return VaeSpec(name=v.name, component=name, cls=cls_name, config=clean, total_params=total,
                           decoder_params=decoder, dtype=v.dtype, decode=v.decode, tiling=v.tiling), vae, cfg
    latent = clean.get("latent_channels") or clean.get("z_dim")
    try:  # priced from its own operator shapes (models/vae_shapes.py)
        from chunkflow.models.vae_shapes import decode_fit

        import torch

        fit = decode_fit(vae.to(getattr(torch, dtype)), int(latent), video, getattr(torch, dtype))
        untimed.append(f"{name} ({cls_name}, priced from its operator shapes)")
        return VaeSpec(name=derived_vae_name(cls_name, clean, dtype), component=name, cls=cls_name, config=clean,
                       total_params=total, decoder_params=decoder, dtype=dtype, decode=fit), vae, cfg
    except Exception as exc:  # a decoder the meta device cannot run: the nearest catalog VAE's, scaled
        tiled_only = _decodes_only_tiled(vae, int(latent), video, exc)
        notes.append(f"{name}: its decode could not be traced on the meta device ({type(exc).__name__}); priced "
                     "from the nearest catalog VAE's" + ("; its class decodes only tiled, so it is decoded tiled"
                                                         if tiled_only else ""))
    same_kind = [s.pipeline.vae for s in specs if s.pipeline.vae.decode is not None and s.is_video == video]
    same_kind = same_kind or [v for v in catalog if v.decode is not None]
    near = min(same_kind, key=lambda v: abs(math.log(v.decoder_params / decoder)))
    k = decoder / near.decoder_params * VAE_MARGIN
    fit = {key: val for key, val in near.decode.items() if key not in ("tiled", "source")}
    for key in ("mem_per_px", "mem_per_voxel", "time_per_voxel", "time_per_call", "time_const"):
        if key in fit:
            fit[key] = fit[key] * k
    if fit.get("time_per_voxel", 0) <= 0:  # a per-call fit needs the VAE's tiling, which is not known
        raise DeriveError(f"no catalog VAE has an untiled decode fit to price {cls_name} from")
    fit["time_per_call"] = 0.0
    fit["mem_const"] = max(0.0, fit.get("mem_const", 0.0))
    fit["source"] = (f"derived: {near.name}'s decode scaled by decoder parameters ({decoder:,} / "
                     f"{near.decoder_params:,}) x margin {VAE_MARGIN}")
    untimed.append(f"{name} ({cls_name}, priced from {near.name}'s decode by its parameters, x{VAE_MARGIN})")
    if tiled_only:  # the same borrowed price for its tiled decode (per voxel: no tile count is needed)
        fit["tiled"] = dict(fit)
    return VaeSpec(name=derived_vae_name(cls_name, clean, dtype), component=name, cls=cls_name, config=clean,
                   total_params=total, decoder_params=decoder, dtype=dtype, decode=fit, tiled_only=tiled_only), vae, cfg


def _decodes_only_tiled(vae, latent_channels: int, video: bool, untiled: Exception) -> bool:
    """Whether the VAE's class decodes only with tiling on: its untiled decode raised NotImplementedError on the
    meta device and, after enable_tiling(), a small latent decodes (diffusers' AutoencoderKLAllegro)."""
    import torch

    from chunkflow.models.vae_shapes import meta_decode

    if not isinstance(untiled, NotImplementedError) or not callable(getattr(vae, "enable_tiling", None)):
        return False
    vae.enable_tiling()
    try:
        meta_decode(vae, (1, latent_channels, 2, 8, 8) if video else (1, latent_channels, 8, 8),
                    next(vae.parameters()).dtype)
    except Exception:
        return False
    finally:
        vae.use_tiling = False  # as disable_tiling() leaves it (a class may not define that method)
    return True


def _layers(module):
    """(dotted path, list) of the module's largest list of repeated layers, at any depth."""
    from torch import nn

    best = None
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) >= 1 and len({type(b) for b in sub}) == 1:
            size = _params(sub)
            if size and (best is None or size > best[2]):
                best = (name, sub, size)
    return (best[0], best[1]) if best else (None, None)


def _text_shape(module, cfg: dict, layer) -> dict[str, Any]:
    from torch import nn

    t = cfg.get("text_config") or cfg
    d = t.get("hidden_size") or t.get("d_model")
    heads = t.get("num_attention_heads") or t.get("num_heads")
    if not (isinstance(d, int) and isinstance(heads, int) and d > 0 and heads > 0):
        raise DeriveError(f"text encoder config lacks hidden_size/d_model or num_attention_heads/num_heads")
    hd = t.get("head_dim") or t.get("d_kv") or d // heads
    lin = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    ff = t.get("intermediate_size") or t.get("d_ff") or max((m.out_features for m in lin), default=4 * d)
    gated = any(n.split(".")[-1] in ("gate_proj", "wi_0", "w1", "w3") for n, _ in layer.named_modules())
    return dict(d=d, ff=ff, heads=heads, head_dim=hd, kv_heads=t.get("num_key_value_heads") or heads,
                gated=gated, eager_attention=False)


def _text_encoder(folder: Path, name: str, cls_name: str, tokenizer: str | None, defaults: dict,
                  untimed: list[str], notes: list[str], overrides: dict):
    import transformers

    from chunkflow.models.families import text_encoder_template
    from chunkflow_planner.components import TextEncoderSpec

    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise DeriveError(f"model_index.json in {str(folder)!r} names text encoder {cls_name}, a class transformers "
                          f"{transformers.__version__} does not have; upgrade transformers")
    cfg = _read(folder / name, f"text encoder {str(folder / name)!r}")
    module = _meta(lambda: cls(cls.config_class.from_dict(cfg)), f"text encoder {str(folder / name)!r}")
    arch, template = text_encoder_template(cls_name)
    path, layers = _layers(module)
    if layers is None:
        raise DeriveError(f"found no repeated layers in text encoder {name} ({cls_name})")
    # tokens: CLIP's fixed 77; else the pipeline's max_sequence_length, else the tokenizer's model_max_length
    tok_max = None
    if tokenizer and (folder / tokenizer / "tokenizer_config.json").is_file():
        try:
            tok_max = json.loads((folder / tokenizer / "tokenizer_config.json").read_text()).get("model_max_length")
        except (OSError, ValueError):
            tok_max = None
    tok_max = tok_max if isinstance(tok_max, int) and 0 < tok_max <= 8192 else None
    if arch == "clip_text":
        tokens = min(tok_max or 77, cfg.get("max_position_embeddings", 77))
    else:
        tokens = overrides.get("text_len") or defaults.get("max_sequence_length") or tok_max
    if not isinstance(tokens, int) or tokens <= 0:
        raise _missing([("the text length", "--text-len")], folder)
    layer_params = _params(layers[0])
    measured = None
    margin = 1.0
    if arch == "other":
        measured = dict(_text_shape(module, cfg, layers[0]), layers=len(layers), layer_params=layer_params)
        margin = TEXT_MARGIN
        untimed.append(f"{name} ({cls_name}, priced from its shapes, x{TEXT_MARGIN})")
    return TextEncoderSpec(
        component=name, tokenizer=tokenizer or "tokenizer", cls=cls_name, arch=arch,
        tokenizer_kind=template.tokenizer_kind if template is not None else "folder", config=_clean(cfg),
        total_params=_params(module), tokens=tokens,
        block_list=template.block_list if template is not None else path,
        mask=template.mask if template is not None else "padded", measured=measured, margin=margin)


def _missing(what: list[tuple[str, str]], where) -> DeriveError:
    listed = ", ".join(f"{w} ({flag})" for w, flag in what)
    return DeriveError(f"cannot derive {listed} from {str(where)!r}; give {' and '.join(f for _, f in what)} to "
                       "`chunkflow plan`, or plan the whole pipeline folder")


# -------------------------------------------------------------------------------------------------- derive


@dataclass(frozen=True)
class _PipelineIndex:
    """A pipeline folder's model_index.json as derive reads it: the folder, its pipeline class, its components
    (name: (library, class))."""

    folder: Path
    cls_name: str
    components: dict[str, tuple[str, str]]


def _pipeline_index(pipe_folder: Path | None) -> _PipelineIndex | None:
    """The model_index.json of `pipe_folder` (None for a transformer folder); a pipeline without a transformer is
    refused."""
    if pipe_folder is None:
        return None
    from chunkflow.weights import pipeline_class_name, pipeline_components

    components = pipeline_components(pipe_folder)
    pipe_cls_name = pipeline_class_name(pipe_folder)
    tname = next((n for n, (lib, _) in components.items() if n == "transformer"), None)
    if tname is None:
        raise DeriveError(f"the pipeline in {str(pipe_folder)!r} has no transformer component (a UNet pipeline?); "
                          "chunkflow plans diffusion transformers")
    return _PipelineIndex(pipe_folder, pipe_cls_name, components)


@dataclass(frozen=True)
class _Transformer:
    """The transformer as derive measured it: its config.json, class, family facts, module on the meta device, block
    groups, and hidden size, heads and FFN size."""

    config: dict[str, Any]
    cls: type
    fam: Family
    module: Any
    groups: list[dict]
    d: int
    heads: int
    f: int


def _transformer(tdir: Path) -> _Transformer:
    """The transformer in `tdir`, built on the meta device from its config.json, its block lists found and measured."""
    from chunkflow.models.discover import block_lists
    from chunkflow.models.families import family

    config = _read(tdir, f"transformer {str(tdir)!r}")
    cls = _diffusers_cls(config.get("_class_name"), f"config.json in {str(tdir)!r}", "transformer")
    fam = family(cls.__name__)
    module = _meta(lambda: cls.from_config(config), f"{cls.__name__} in {str(tdir)!r}")
    lists = block_lists(module)
    if not lists:
        raise DeriveError(f"found no block list in the {cls.__name__} of {str(tdir)!r} (an nn.ModuleList of two or "
                          "more blocks of one class); chunkflow cannot stream it")
    groups = _groups(module, lists)
    first = next(iter(lists.values()))[0]
    d, heads, f = _shape(first, config)
    return _Transformer(config, cls, fam, module, groups, d, heads, f)


@dataclass(frozen=True)
class _PipelineFacts:
    """What derive reads beyond the transformer: the PipelineSpec (None for a transformer folder), the pipeline
    class's call defaults, the VAE's factors and latent channels (None: the transformer's config says them)."""

    pipeline: PipelineSpec | None
    defaults: dict[str, Any]
    vae_spatial: int | None
    vae_temporal: int | None
    latent: Any


def _call_defaults_of(index: _PipelineIndex) -> dict[str, Any]:
    """The `__call__` defaults of the pipeline class model_index.json names; a class diffusers lacks is refused."""
    import diffusers

    pipe_cls = getattr(diffusers, index.cls_name, None)
    if pipe_cls is None:
        raise DeriveError(f"model_index.json in {str(index.folder)!r} names {index.cls_name}, a pipeline class "
                          f"diffusers {diffusers.__version__} does not have; upgrade diffusers")
    return _call_defaults(pipe_cls)


def _pipeline_vae(index: _PipelineIndex, video: bool, fam: Family, notes: list[str],
                  untimed: list[str]) -> tuple[VaeSpec, int, int | None, Any]:
    """(VaeSpec, spatial factor, temporal factor, latent channels) of the pipeline's VAE (its Autoencoder*
    component)."""
    vae_name = next((n for n, (lib, c) in index.components.items()
                     if lib == "diffusers" and c.startswith("Autoencoder")), None)
    if vae_name is None:
        raise DeriveError(f"the pipeline in {str(index.folder)!r} has no VAE (an Autoencoder* component)")
    vae_spec, vae, vae_cfg = _vae_spec(index.folder, vae_name, index.components[vae_name][1], video, notes, untimed)
    vae_spatial, vae_temporal = _vae_factors(vae, vae_cfg, video, fam)
    latent = vae_cfg.get("latent_channels") or vae_cfg.get("z_dim")
    return vae_spec, vae_spatial, vae_temporal, latent


def _capped_text_len(defaults: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The call defaults with max_sequence_length no more than the transformer's max_text_seq_length, where it
    has one."""
    cap = config.get("max_text_seq_length")  # the text tokens the transformer's positions are made for (CogVideoX)
    if isinstance(cap, int) and cap > 0 and not (isinstance(defaults.get("max_sequence_length"), int)
                                                 and defaults["max_sequence_length"] <= cap):
        defaults = {**defaults, "max_sequence_length": cap}
    return defaults


def _pipeline_text_encoders(index: _PipelineIndex, defaults: dict[str, Any], untimed: list[str], notes: list[str],
                            overrides: dict) -> list[TextEncoderSpec]:
    """The TextEncoderSpec of each transformers text encoder of the pipeline; a pipeline with none is refused."""
    import transformers

    tes = []
    for n, (lib, c) in index.components.items():
        if not n.startswith("text_encoder"):  # an image encoder (Wan2.1 image-to-video) is not a text encoder
            continue
        tcls = getattr(transformers, c, None) if lib == "transformers" else None
        if tcls is not None and issubclass(tcls, transformers.PreTrainedModel):
            tok = n.replace("text_encoder", "tokenizer") if n.startswith("text_encoder") else None
            tes.append(_text_encoder(index.folder, n, c, tok if tok in index.components else None, defaults, untimed,
                                     notes, overrides))
    if not tes:
        raise DeriveError(f"the pipeline in {str(index.folder)!r} has no transformers text encoder")
    return tes


def _pipeline_spec(source: str, index: _PipelineIndex, defaults: dict[str, Any], fam: Family,
                   tes: list[TextEncoderSpec], vae_spec: VaeSpec) -> PipelineSpec:
    """The PipelineSpec of the pipeline: its text encoders, VAE, scheduler, guidance, experts and fps."""
    from pydantic import ValidationError

    from chunkflow_planner.components import PipelineSpec, SchedulerSpec

    components, pipe_folder = index.components, index.folder
    sched = next(((n, c) for n, (lib, c) in components.items() if n == "scheduler"), None)
    sched_cfg = _clean(_read(pipe_folder / "scheduler", "scheduler", "scheduler_config.json")) if sched else {}
    guidance = defaults.get("true_cfg_scale") if (defaults.get("true_cfg_scale") or 0) > 1 else None
    guidance = guidance or defaults.get("guidance_scale") or 1.0
    index_json = json.loads((pipe_folder / "model_index.json").read_text())
    experts = 2 if "transformer_2" in components else 1
    try:
        return PipelineSpec(
            cls=index.cls_name, adapter=fam.adapter, text_encoders=tes, vae=vae_spec,
            scheduler=SchedulerSpec(cls=sched[1] if sched else "unknown", config=sched_cfg),
            guidance=float(guidance), experts=experts,
            boundary_ratio=index_json.get("boundary_ratio") if experts == 2 else None,
            fps=defaults.get("fps") if isinstance(defaults.get("fps"), int) and defaults.get("fps") > 0 else None,
            config={k: v for k, v in index_json.items() if not k.startswith("_") and not isinstance(v, list)
                    and k != "boundary_ratio"},
            source=f"derived from {source}")
    except ValidationError as exc:
        raise DeriveError(f"the pipeline in {str(pipe_folder)!r} cannot be priced: {exc.errors()[0]['msg']}") from None


def _pipeline_facts(source: str, index: _PipelineIndex | None, config: dict[str, Any], fam: Family,
                    notes: list[str], untimed: list[str], overrides: dict) -> _PipelineFacts:
    """The pipeline's spec, call defaults and VAE of `index` (a transformer folder's: the family's VAE factors)."""
    if index is None:
        return _PipelineFacts(None, {}, fam.vae_spatial, fam.vae_temporal, None)
    defaults = _call_defaults_of(index)
    video = any(k in defaults for k in FRAME_PARAMS)
    vae_spec, vae_spatial, vae_temporal, latent = _pipeline_vae(index, video, fam, notes, untimed)
    defaults = _capped_text_len(defaults, config)
    tes = _pipeline_text_encoders(index, defaults, untimed, notes, overrides)
    pipeline = _pipeline_spec(source, index, defaults, fam, tes, vae_spec)
    return _PipelineFacts(pipeline, defaults, vae_spatial, vae_temporal, latent)


def _latent_channels(facts: _PipelineFacts, t: _Transformer, tdir: Path) -> int:
    """The latent channels (the VAE's, else the transformer's in_channels, unpacked); a transformer folder of a
    family whose VAE chunkflow does not know is refused."""
    in_ch = t.config.get("in_channels") or t.config.get("in_dim")
    latent = facts.latent
    if latent is None:
        latent = in_ch // 4 if t.fam.packed and in_ch else in_ch
    if facts.vae_spatial is None:
        raise DeriveError(f"{t.cls.__name__} in {str(tdir)!r} is a transformer folder of a family chunkflow does not "
                          "know the VAE of; give the whole pipeline folder (the one holding model_index.json)")
    if not isinstance(latent, int) or latent <= 0:
        raise DeriveError(f"config.json in {str(tdir)!r} lacks in_channels; re-download or re-save it")
    return latent


def _activation(fam: Family, untimed: list[str]) -> Any:
    """The transformer's activation model: its family's (measured), else the default model x ACTIVATION_MARGIN
    (said in `untimed`), marked as that prior (ActivationModel.prior_multiple)."""
    activation = fam.activation
    if activation is None:  # no class of the catalog measured: the default model times ACTIVATION_MARGIN
        from chunkflow_planner.catalog import ActivationModel

        base = ActivationModel()
        activation = dict(c_f=base.c_f * ACTIVATION_MARGIN, c_d=base.c_d * ACTIVATION_MARGIN,
                          prior_multiple=ACTIVATION_MARGIN)  # an upper bound: its bands reach down to the default
        untimed.append(f"the transformer's activations (the default model x{ACTIVATION_MARGIN}: its class was never "
                       "measured)")
    return activation


def derive_model(source: str, overrides: dict[str, int | None] | None = None):
    """The ModelSpec of the model in `source` (see the module docstring). `overrides`: height, width, frames,
    steps, text_len given on the command line, for what the folder does not say."""
    from pydantic import ValidationError

    from chunkflow_planner.catalog import Derived, ModelSpec

    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    pipe_folder, tdir, label = _locate(source)
    index = _pipeline_index(pipe_folder)
    t = _transformer(tdir)
    config, fam = t.config, t.fam
    pt, p = patch_sizes(config, fam)
    notes: list[str] = []
    untimed: list[str] = []
    facts = _pipeline_facts(source, index, config, fam, notes, untimed, overrides)
    latent = _latent_channels(facts, t, tdir)
    # the default workload: the pipeline's call defaults, the transformer's sample size x the VAE where None
    want = default_workload(config, facts.defaults, overrides, fam, facts.vae_spatial, facts.vae_temporal)
    text_len = default_text_len(config, facts.defaults, overrides)
    missing = missing_inputs(want, text_len)
    if missing:
        raise _missing(missing, pipe_folder or tdir)
    passes = cfg_passes(facts.pipeline, config, notes)
    activation = _activation(fam, untimed)
    try:
        return ModelSpec(
            name=label, description=f"{t.cls.__name__} derived from {source}", d=t.d, f=t.f, heads=t.heads,
            text_len=text_len, patch=(int(pt or 1), int(p or 1), int(p or 1)), vae_spatial=facts.vae_spatial,
            vae_temporal=facts.vae_temporal, latent_channels=latent, dtype_bytes=RUN_DTYPE_BYTES, blocks=t.groups,
            total_params=_params(t.module), fp32_params=_fp32(t.module), activation=activation,
            default_workload=dict(height=want["height"], width=want["width"], frames=want["frames"],
                                  steps=want["steps"], cfg_passes=passes),
            diffusers=dict(cls=t.cls.__name__, config=_clean(config), inputs=fam.inputs, cp_plan=fam.cp_plan,
                           masked_attention=fam.masked_attention),
            pipeline=facts.pipeline, derived=Derived(source=str(source), untimed=untimed, notes=notes))
    except ValidationError as exc:
        e = exc.errors()[0]
        raise DeriveError(f"the model derived from {source!r} is not one chunkflow can plan: "
                          f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}") from None


def describe_yaml(spec) -> str:
    """The entry in models.yaml's format (`models: {name: {...}}`, every field the catalog reads, defaults left
    out), where it came from and what no calibration timed as comments above it: pasted into a models.yaml it is a
    catalog entry (without `derived`)."""
    import yaml

    data = spec.model_dump(mode="json", exclude={"name", "derived"}, exclude_defaults=True)
    head = []
    if spec.derived is not None:
        head.append(f"# derived by `chunkflow models --describe` from {spec.derived.source}")
        head += [f"# not timed by any calibration: {u}" for u in spec.derived.untimed]
        head += [f"# assumed: {n}" for n in spec.derived.notes]
    text = yaml.safe_dump({"models": {spec.name: data}}, sort_keys=False, width=120)
    return "\n".join(head + [text])
