"""Build a catalog transformer straight into the offloaded layout: random weights (fast) or a local
diffusers-format directory (config.json + safetensors), never the whole model on the GPU or twice on the host.

The class is constructed with its parameters on the meta device and its buffers real (so buffers computed at
construction, like Wan's rope tables or Qwen's rope frequencies, are computed as usual), in their final dtypes;
`chunkflow.offload(..., source=...)` then lays the blocks out from the meta shapes and writes each tensor once,
block tensors into the host store and the rest straight to the device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from chunkflow.models.meta import RandomSource, param_dtype, params_on_meta, swap_params
from chunkflow.api import offload
from chunkflow.runtime.handle import OffloadError, OffloadHandle, resolve_device


def _diffusers_class(name: str):
    import diffusers

    cls = getattr(diffusers, name, None)
    if cls is None:
        raise OffloadError(f"diffusers {diffusers.__version__} has no class {name}; upgrade diffusers")
    return cls


def _spec(model):
    if not isinstance(model, str):
        return model
    from chunkflow_planner.catalog import get_model

    try:
        return get_model(model)
    except ValueError as exc:
        raise OffloadError(str(exc)) from None


def construct_meta(spec, config: dict | None = None) -> nn.Module:
    """The spec's diffusers class with meta parameters and real buffers, in eval mode."""
    cls = _diffusers_class(spec.diffusers.cls)
    with params_on_meta(), torch.device("cpu"):
        module = cls(**(config if config is not None else dict(spec.diffusers.config)))
    return module.eval().requires_grad_(False)


def _normalize(cfg: dict) -> dict:
    return {k: v for k, v in json.loads(json.dumps(cfg)).items() if not k.startswith("_")}


def check_transformer_config(path: Path, spec) -> None:
    """The folder's config.json is the catalog model's: its class, and every constructor argument both name."""
    from chunkflow_planner.checkpoint import CheckpointError, read_config, shown

    cfg = read_config(path, f"transformer {str(path)!r}")
    cls = cfg.get("_class_name")
    if cls is not None and cls != spec.diffusers.cls:
        raise CheckpointError(f"{str(path)!r} holds a {shown(cls)}, but {spec.name} is a {spec.diffusers.cls}; point "
                              "--weights at that model's folder")
    mine, theirs = _normalize(dict(spec.diffusers.config)), _normalize(cfg)
    diff = [k for k in mine if k in theirs and mine[k] != theirs[k]]
    if diff:
        detail = ", ".join(f"{k}: catalog {shown(mine[k])} vs file {shown(theirs[k])}" for k in diff)
        raise CheckpointError(f"config.json in {str(path)!r} does not match catalog entry {spec.name}: {detail}")


def transformer_source(path: Path, spec, module: nn.Module, reader, variant: str | None = None,
                       fallback: bool = False):
    """The CheckpointSource of a diffusers-format transformer folder for `module` (meta, final dtypes), every check
    run: the config (check_transformer_config), the files (chunkflow_planner.checkpoint.open_checkpoint: an index,
    variants, shards, as `ModelMixin.from_pretrained` chooses them) and the tensors (loading/source.py)."""
    from chunkflow.loading.source import CheckpointSource
    from chunkflow_planner.checkpoint import DIFFUSERS_STEM, CheckpointError, is_dir, open_checkpoint

    if not is_dir(path):
        raise CheckpointError(f"weights {str(path)!r} is not a directory; give a diffusers-format model directory")
    check_transformer_config(path, spec)
    reader.watch(path)
    ckpt = open_checkpoint(path, DIFFUSERS_STEM, variant, convert_hint=spec.diffusers.cls, fallback=fallback)
    return CheckpointSource(ckpt, module, reader, f"transformer {str(path)!r}", rename=lambda k: k)


# --------------------------------------------------------------------------------------------- build


def transformer_module(spec, dtype: torch.dtype) -> nn.Module:
    """The catalog transformer on the meta device with its parameters in their final dtypes (`dtype`, float32 where
    the class keeps modules in fp32), so the layout is computed from shapes and dtypes alone."""
    module = construct_meta(spec)
    pnames: dict[int, str] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        pnames.setdefault(id(p), pname)
    swap_params(module, lambda p: nn.Parameter(
        torch.empty(p.shape, dtype=param_dtype(module, pnames[id(p)], dtype), device="meta"), requires_grad=False))
    return module


def build_transformer(model, weights=None, dtype: torch.dtype = torch.bfloat16, device="cuda", config=None, *,
                      seed: int = 0, blocks=None, variant: str | None = None,
                      reader=None) -> tuple[nn.Module, OffloadHandle]:
    """A catalog model (name or ModelSpec), offloaded as `config` says (an OffloadConfig, a plan or plan file, or a
    mode name, as `chunkflow.offload` takes it), with random weights (None or "random") or weights from a local diffusers-format
    directory (`variant`, e.g. "fp16", picks diffusers' variant files there, as `from_pretrained` does), read
    straight into their final place by `reader` (a loading.FileReader; one of its own by default).
    Returns (module, handle).

    `handle.remove()` on a built module puts block tensors on the CPU; non-block tensors stay on the device.
    """
    from chunkflow.loading.reader import FileReader

    spec = _spec(model)
    dev = resolve_device(device)
    if weights is not None and not (isinstance(weights, str) and weights == "random"):
        weights = Path(weights)
    if variant is not None and not isinstance(weights, Path):
        raise OffloadError(f"variant {variant!r} picks files in a weights directory; give weights=DIR with it")
    module = transformer_module(spec, dtype)
    own = reader is None and isinstance(weights, Path)
    reader = FileReader() if own else reader
    try:
        source = (transformer_source(weights, spec, module, reader, variant) if isinstance(weights, Path)
                  else RandomSource(seed, dev, module))
        handle = offload(module, config, device=dev, blocks=blocks, source=source)
    finally:
        if own:
            reader.close()
    return module, handle
