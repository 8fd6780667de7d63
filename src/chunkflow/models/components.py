"""A pipeline component made ready to place: its class built on the meta device in its final dtypes, from the
catalog's config (random weights) or its checkpoint folder's (checked against the catalog and its files), and the
TensorSource that fills it. Random and loaded components go through this one path and the same `offload()`, so
they are the same modules with the same bytes, and the plan that counted one counts the other.

A folder's component is refused before anything is read when its class is not the catalog's (a T5EncoderModel in
UMT5's slot), when its config makes a model of another size than the one planned, or when its files lack tensors,
hold others, or hold them in other shapes (loading/source.py). Every component is read from safetensors only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from chunkflow.loading.reader import FileReader
from chunkflow.loading.source import CheckpointSource
from chunkflow.runtime.tensors import TensorSource
from chunkflow.models.meta import RandomSource, param_dtype, params_on_meta, swap_params
from chunkflow.models.config_bounds import check_config_size, init_defaults, reference_config
from chunkflow_planner.checkpoint import (DIFFUSERS_STEM, TRANSFORMERS_STEM, CheckpointError, open_checkpoint,
                                         read_config, shown)

__all__ = ["Component", "text_encoder_component", "vae_component", "meta_text_encoder", "meta_vae", "distinct_params"]


@dataclass
class Component:
    """A module on the meta device (final dtypes) and where its values come from; a transformer from a single file
    has no module until it is loaded (`file`)."""

    name: str  # the pipeline's attribute: text_encoder, transformer, vae, ...
    module: nn.Module
    source: TensorSource
    read_bytes: int = 0  # bytes its checkpoint files give it (0: random weights)
    variant: str | None = None  # the variant files read, where a folder's were
    file: Path | None = None  # a transformer read from a single file (--transformer FILE): models/transformer_file.py
    fmt: str | None = None  # that file's format (chunkflow.formats: "gguf", "fp8-scaled")
    config_dir: Path | None = None  # the folder's config the file is checked against and loaded with


def distinct_params(module: nn.Module) -> int:
    """Parameters of the module, each tied one once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _differences(catalog: dict, folder: dict, limit: int = 4) -> str:
    diff = [k for k in catalog if k in folder and catalog[k] != folder[k] and not k.startswith("_")]
    return "; ".join(f"{k}: catalog {shown(catalog[k])}, file {shown(folder[k])}" for k in diff[:limit])


def _check_size(module: nn.Module, planned: int, what: str, cls: str, catalog_cfg: dict, cfg: dict) -> None:
    have = distinct_params(module)
    if have != planned:
        diff = _differences(catalog_cfg, cfg)
        raise CheckpointError(
            f"{what}: its config.json makes a {cls} of {have:,} parameters, the plan's model has {planned:,}"
            + (f" ({diff})" if diff else "") + "; the folder holds another model: point --weights at the "
            "pipeline the plan was made for")


# --------------------------------------------------------------------------------------------- meta modules


def meta_text_encoder(te, dtype: torch.dtype, config: dict | None = None) -> nn.Module:
    """The transformers class on the meta device (buffers real) from `config` (default: the catalog's), parameters
    in `dtype` except those transformers keeps in float32 for it (`_keep_in_fp32_modules_strict`;
    `_keep_in_fp32_modules` only for float16), as its `from_pretrained(torch_dtype=dtype)` does."""
    import transformers

    cls = getattr(transformers, te.cls)
    with warnings.catch_warnings(), params_on_meta(), torch.device("cpu"):
        warnings.simplefilter("ignore")
        cfg = cls.config_class(**te.config) if config is None else cls.config_class.from_dict(config)
        module = cls(cfg)
    keep = set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    swap_params(module, lambda p: nn.Parameter(torch.empty(
        p.shape, dtype=torch.float32 if any(k in names[id(p)].split(".") for k in keep) else dtype, device="meta"),
        requires_grad=False))
    return module.eval()


def meta_vae(vae, dtype: torch.dtype, config: dict | None = None) -> nn.Module:
    """The diffusers VAE class on the meta device from `config` (default: the catalog's), in `dtype` except the
    modules the class keeps in float32 (diffusers' `from_pretrained(torch_dtype=...)` rule)."""
    import diffusers

    cls = getattr(diffusers, vae.cls)
    with warnings.catch_warnings(), params_on_meta(), torch.device("cpu"):
        warnings.simplefilter("ignore")
        module = cls(**vae.config) if config is None else cls.from_config(config)
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    swap_params(module, lambda p: nn.Parameter(torch.empty(p.shape, dtype=param_dtype(module, names[id(p)], dtype),
                                                            device="meta"), requires_grad=False))
    return module.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ components


def _folder(folder: Path, component: str) -> Path:
    path = folder / component
    if not path.is_dir():
        raise CheckpointError(f"{str(folder)!r} has no {component}/ folder; the pipeline folder is incomplete: "
                              "download or save it again")
    return path


def _check_class(cfg: dict, cls: str, what: str, path: Path) -> None:
    """The class a component's config names (transformers' `architectures`, diffusers' `_class_name`) is `cls`."""
    archs = cfg.get("architectures")
    named = cfg.get("_class_name") or (archs[0] if isinstance(archs, list) and archs else archs)
    if named is not None and named != cls:
        shown_as = named if isinstance(named, str) and named.isidentifier() and len(named) <= 80 else shown(named)
        raise CheckpointError(f"{what}: {str(path)!r} holds a {shown_as} (config.json), but the plan's model runs a "
                              f"{cls}; the pipeline folder is not the one the plan was made for")


def text_encoder_reference(te) -> dict:
    """The config the catalog's text encoder is built from: its catalog config (as the checkpoint saved it) over
    the config transformers makes of it (every default and derived value, in this transformers' layout: UMT5's
    num_decoder_layers is its num_layers, Qwen2.5-VL's text settings move into text_config)."""
    import logging

    import transformers

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            made = getattr(transformers, te.cls).config_class.from_dict(dict(te.config)).to_dict()
    finally:
        quiet.setLevel(level)
    return reference_config(made, dict(te.config))


def vae_reference(vae) -> dict:
    """The config the catalog's VAE is built from: its catalog config over the class's constructor defaults."""
    import diffusers

    return reference_config(init_defaults(getattr(diffusers, vae.cls)), dict(vae.config))


def text_encoder_component(te, dtype: torch.dtype, *, folder: Path | None = None, reader: FileReader | None = None,
                           variant: str | None = None, seed: int = 0,
                           gen_device: torch.device = torch.device("cpu")) -> Component:
    """A catalog text encoder (`te`, components.TextEncoderSpec): random weights drawn with `seed` on `gen_device`,
    or the folder's `te.component/` read by `reader`."""
    if folder is None:
        module = meta_text_encoder(te, dtype)
        return Component(te.component, module, RandomSource(seed, gen_device, module))
    return _folder_component(te, lambda cfg: meta_text_encoder(te, dtype, cfg), text_encoder_reference, folder,
                             reader, variant, TRANSFORMERS_STEM)


def vae_component(vae, dtype: torch.dtype, *, folder: Path | None = None, reader: FileReader | None = None,
                  variant: str | None = None, seed: int = 0,
                  gen_device: torch.device = torch.device("cpu")) -> Component:
    """The catalog VAE (`vae`, components.VaeSpec): random weights, or the folder's `vae.component/`."""
    if folder is None:
        module = meta_vae(vae, dtype)
        return Component(vae.component, module, RandomSource(seed, gen_device, module))
    return _folder_component(vae, lambda cfg: meta_vae(vae, dtype, cfg), vae_reference, folder, reader, variant,
                             DIFFUSERS_STEM, rename=lambda k: k)


def checked_module(spec, make, reference, folder: Path) -> tuple[Path, str, nn.Module]:
    """(its folder, how errors name it, its meta module) of a catalog component (text encoder or VAE `spec`) of the
    pipeline folder: its config.json's class checked, its config checked to make the catalog's class no larger than
    the catalog's (`reference(spec)`, config_bounds.py) before `make(config)` builds its meta module, which is then
    counted against the catalog's size. Nothing is read but the config."""
    path = _folder(folder, spec.component)
    what = f"{spec.component} in {str(folder)!r}"
    cfg = read_config(path, what)
    _check_class(cfg, spec.cls, what, path)
    check_config_size(cfg, reference(spec), what, spec.cls)
    module = _make(make, cfg, what, spec.cls)
    _check_size(module, spec.total_params, what, spec.cls, dict(spec.config), cfg)
    return path, what, module


def _make(make, cfg: dict, what: str, cls: str) -> nn.Module:
    try:
        return make(cfg)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError,
            ZeroDivisionError) as exc:  # what a class raises for settings it cannot take
        why = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise CheckpointError(f"{what}: its config.json does not make a {cls} ({type(exc).__name__}: {why}); "
                              "download or save the pipeline again") from None


# an extra model (an image encoder) has no catalog entry to bound its config by: its integers and lists are held to
# what real ones stay far under (a CLIP ViT-H/14 vision config's largest integer is 5,120)
EXTRA_MAX_INT = 10**6
EXTRA_MAX_LIST = 4096


def extra_meta_module(cls: type, cfg: dict, dtype: torch.dtype) -> nn.Module:
    """A transformers or diffusers model class on the meta device from a folder's config, in `dtype` but for the
    modules its class keeps in float32."""
    import transformers

    with warnings.catch_warnings(), params_on_meta(), torch.device("cpu"):
        warnings.simplefilter("ignore")
        if issubclass(cls, transformers.PreTrainedModel):
            module = cls(cls.config_class.from_dict(cfg))
        else:
            module = cls.from_config(cfg)
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    swap_params(module, lambda p: nn.Parameter(torch.empty(p.shape, dtype=param_dtype(module, names[id(p)], dtype),
                                                            device="meta"), requires_grad=False))
    return module.eval().requires_grad_(False)


def checked_extra(name: str, cls: type, folder: Path, dtype: torch.dtype) -> tuple[Path, str, nn.Module, str]:
    """(its folder, how errors name it, its meta module, its files' stem) of a component the run's pipeline class
    takes beyond the plan's model (an image encoder): its config's class checked and its sizes bounded (EXTRA_MAX_INT,
    EXTRA_MAX_LIST) before anything is built from it."""
    import transformers

    from chunkflow.models.folder_parts import _scheduler_bounds

    path = _folder(folder, name)
    what = f"{name} in {str(folder)!r}"
    cfg = read_config(path, what)
    _check_class(cfg, cls.__name__, what, path)
    _scheduler_bounds(cfg, what, EXTRA_MAX_INT, EXTRA_MAX_LIST, "config.json")
    stem = TRANSFORMERS_STEM if issubclass(cls, transformers.PreTrainedModel) else DIFFUSERS_STEM
    return path, what, _make(lambda c: extra_meta_module(cls, c, dtype), cfg, what, cls.__name__), stem


def extra_component(name: str, cls: type, dtype: torch.dtype, *, folder: Path, reader: FileReader,
                    variant: str | None = None) -> Component:
    """An extra model of the pipeline folder (checked_extra), its files read by `reader`."""
    path, what, module, stem = checked_extra(name, cls, folder, dtype)
    reader.watch(path)
    ckpt = open_checkpoint(path, stem, variant, convert_hint=cls.__name__, fallback=True)
    kw = {"rename": lambda k: k} if stem == DIFFUSERS_STEM else {}
    source = CheckpointSource(ckpt, module, reader, what, **kw)
    return Component(name, module, source, source.nbytes, ckpt.variant)


def _folder_component(spec, make, reference, folder: Path, reader: FileReader, variant: str | None, stem: str,
                      **source_kw) -> Component:
    """A catalog component (text encoder or VAE `spec`) of the pipeline folder: its config checked to make the
    catalog's class no larger than the catalog's (`reference(spec)`, config_bounds.py) before `make(config)` builds
    its meta module, which is then counted against the catalog's size; its files read by `reader`."""
    path, what, module = checked_module(spec, make, reference, folder)
    reader.watch(path)
    ckpt = open_checkpoint(path, stem, variant, convert_hint=spec.cls, fallback=True)
    source = CheckpointSource(ckpt, module, reader, what, **source_kw)
    return Component(spec.component, module, source, source.nbytes, ckpt.variant)
