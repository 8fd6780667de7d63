"""Build a catalog model's whole diffusers pipeline with every component where the plan places it.

Components come from a local diffusers pipeline folder (`--weights`: transformers through chunkflow's loader, the
others through their libraries' `from_pretrained`) or, without weights, are built from the catalog's configs with
random weights written straight into their final place (never the whole model twice on the host) and local
tokenizers. Placements (chunkflow_planner/pipeline.py) become offload handles:
- `gpu`: `offload(mode="none")` on the device, never parked;
- `phase`: the same, parked (in one pinned host allocation) outside its phase;
- `stream`: `offload(...)` with the plan's setting (a text encoder: 16 MB chunks, its layers), parked outside;
- `cpu`: on the CPU; its inputs are moved there and its outputs back to the device around each forward.
Experts (Wan2.2-A14B's `transformer` and `transformer_2`) take turns on the device (`take_turns`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chunkflow.runtime.handle import OffloadError, OffloadHandle, offload, take_turns
from chunkflow_planner.offload import OffloadConfig

TEXT_STREAM = OffloadConfig("chunkflow", 16 * 10**6, 0.0)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class BuiltPipeline:
    """A pipeline and the handles that place its components."""

    pipe: Any
    spec: Any
    device: torch.device
    placements: dict[str, str]
    handles: dict[str, OffloadHandle] = field(default_factory=dict)
    hooks: list = field(default_factory=list)
    random_weights: bool = True

    def names(self, kind: str) -> list[str]:
        """Component names of a kind: text_encoder, transformer or vae."""
        pipe = self.spec.pipeline
        if kind == "text_encoder":
            return [te.component for te in pipe.text_encoders]
        if kind == "transformer":
            return ["transformer"] + [f"transformer_{k + 1}" for k in range(1, pipe.experts)]
        return [pipe.vae.component]

    def park(self, kind: str) -> None:
        """Park the components of `kind` placed `phase` or `stream` (their device memory back to the allocator)."""
        for n in self.names(kind):
            if self.placements.get(n) in ("phase", "stream"):
                self.handles[n].park()

    def unpark(self, kind: str) -> None:
        for n in self.names(kind):
            if n in self.handles:
                self.handles[n].unpark()

    def remove(self) -> None:
        """Every hook and handle off; components back as they were built (block tensors on the CPU)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for h in self.handles.values():
            h.remove()
        self.handles = {}

    def discard(self) -> None:
        """Every hook and handle off and every host and device buffer freed, nothing put back (no copy of the
        weights): for a run that is done with the pipeline. Its modules are left on the meta device."""
        from chunkflow.runtime.handle import discard

        for h in self.hooks:
            h.remove()
        self.hooks = []
        for h in self.handles.values():
            discard(h)
        self.handles = {}


# ------------------------------------------------------------------------------------------- helpers


def _cpu_io(module: nn.Module, device: torch.device) -> list:
    """Hooks that move a CPU-placed module's tensor inputs to the CPU and its outputs to `device`."""

    def to(x, dev):
        if isinstance(x, torch.Tensor):
            return x.to(dev)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(to(v, dev) for v in x)
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = to(x[k], dev)
            return x
        return x

    def pre(mod, args, kwargs):
        return to(args, torch.device("cpu")), to(kwargs, torch.device("cpu"))

    def post(mod, args, kwargs, out):
        return to(out, device)

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]


def _meta_text_encoder(te, dtype: torch.dtype) -> nn.Module:
    """The transformers class on the meta device (buffers real), parameters in `dtype` except those transformers
    keeps in float32 for it (`_keep_in_fp32_modules_strict`; `_keep_in_fp32_modules` only for float16)."""
    import transformers

    from chunkflow.models.build import _swap_params, params_on_meta

    cls = getattr(transformers, te.cls)
    with warnings.catch_warnings(), params_on_meta(), torch.device("cpu"):
        warnings.simplefilter("ignore")
        module = cls(cls.config_class(**te.config))
    keep = set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    _swap_params(module, lambda p: nn.Parameter(torch.empty(
        p.shape, dtype=torch.float32 if any(k in names[id(p)].split(".") for k in keep) else dtype, device="meta"),
        requires_grad=False))
    return module.eval()


def _meta_vae(vae, dtype: torch.dtype) -> nn.Module:
    import diffusers

    from chunkflow.models.build import _swap_params, params_on_meta

    with params_on_meta(), torch.device("cpu"):
        module = getattr(diffusers, vae.cls)(**vae.config)
    _swap_params(module, lambda p: nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=False))
    return module.eval().requires_grad_(False)


def _place(module: nn.Module, placement: str, device: torch.device, cfg: OffloadConfig | None, source=None,
           blocks=None) -> tuple[OffloadHandle, list]:
    """Offload `module` as `placement` says (see the module docstring); returns (handle, extra hooks)."""
    if placement == "cpu":
        handle = offload(module, "none", device="cpu", source=source)
        return handle, _cpu_io(module, device)
    if placement in ("gpu", "phase"):
        handle = offload(module, "none", device=device, source=source)
    elif placement == "stream":
        handle = offload(module, cfg, device=device, source=source, blocks=blocks)
    else:
        raise OffloadError(f"unknown placement {placement!r}")
    if placement != "gpu":
        handle.park()
    return handle, []


def _random_source(seed: int, device: torch.device, module: nn.Module):
    from chunkflow.models.build import _RandomSource

    return _RandomSource(seed, device, module)


# --------------------------------------------------------------------------------------------- build


def build_pipeline(spec, placements: dict[str, str], transformer_cfg: OffloadConfig, device: torch.device, *,
                   weights: Path | None = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   vae_tiling: bool = False, log=lambda s: None) -> BuiltPipeline:
    """The catalog model's pipeline with its components placed (`placements`: component name -> placement)."""
    import diffusers

    from chunkflow.models.build import build_transformer

    pipe_spec = spec.pipeline
    built = BuiltPipeline(None, spec, device, dict(placements), random_weights=weights is None)
    components: dict[str, Any] = {}
    folder = Path(weights) if weights is not None else None
    extra: dict[str, Any] = dict(pipe_spec.config)
    if folder is not None:
        extra = _folder_config(folder, pipe_spec)
    try:
        for k, name in enumerate(built.names("transformer")):
            where = placements.get(name, "stream")
            cfg = transformer_cfg if where == "stream" else OffloadConfig("none")
            model, handle = build_transformer(spec, weights=folder / name if folder else None, dtype=dtype, device=device,
                                              config=cfg, seed=seed + k)
            if where != "gpu":
                handle.park()
            components[name], built.handles[name] = model, handle
            log(f"{name}: {where} ({cfg.label})")
        if pipe_spec.experts > 1:
            built.hooks.append(take_turns(*[built.handles[n] for n in built.names("transformer")]))
        for i, te in enumerate(pipe_spec.text_encoders):
            where = placements.get(te.component, "phase")
            gen_dev = device if where != "cpu" else torch.device("cpu")
            if folder is None:
                module = _meta_text_encoder(te, dtype)
                source = _random_source(seed + 100 + i, gen_dev, module)
                components[te.tokenizer] = _local_tokenizer(te, pipe_spec)
            else:
                module = _load_library(folder, te.component, te.cls, "transformers", dtype)
                source = None
                components[te.tokenizer] = _load_tokenizer(folder, te.tokenizer)
            handle, hooks = _place(module, where, device, TEXT_STREAM, source)
            components[te.component], built.handles[te.component] = module, handle
            built.hooks += hooks
            log(f"{te.component}: {where}")
        vae = pipe_spec.vae
        where = placements.get(vae.component, "phase")
        vdtype = DTYPES[vae.dtype]
        if folder is None:
            module = _meta_vae(vae, vdtype)
            source = _random_source(seed + 200, device, module)
        else:
            module = _load_library(folder, vae.component, vae.cls, "diffusers", vdtype)
            source = None
        handle, _ = _place(module, "phase" if where == "phase" else "gpu", device, None, source)
        if vae_tiling:
            module.enable_tiling()
        components[vae.component], built.handles[vae.component] = module, handle
        log(f"{vae.component}: {where}" + (" (tiled decode)" if vae_tiling else ""))
        components["scheduler"] = (_load_scheduler(folder, pipe_spec) if folder is not None
                                   else getattr(diffusers, pipe_spec.scheduler.cls).from_config(pipe_spec.scheduler.config))
        cls = getattr(diffusers, pipe_spec.cls)
        built.pipe = cls(**components, **extra)
        built.pipe.set_progress_bar_config(disable=True)
    except BaseException:
        built.remove()
        raise
    return built


def _local_tokenizer(te, pipe_spec):
    from chunkflow.models.tokenizers import build_tokenizer

    template = None
    if te.tokenizer_kind == "qwen2":
        import diffusers

        template = getattr(getattr(diffusers, pipe_spec.cls), "prompt_template_encode", None)
    return build_tokenizer(te.tokenizer_kind, te.tokens, template)


def _folder_config(folder: Path, pipe_spec) -> dict[str, Any]:
    """The pipeline's own settings in model_index.json (e.g. boundary_ratio, expand_timesteps), after checking that
    the folder holds this catalog model's pipeline class."""
    from chunkflow.weights import _model_index

    index = _model_index(folder)
    cls = index.get("_class_name")
    if cls != pipe_spec.cls:
        raise OffloadError(f"{str(folder)!r} holds a {cls}, but the plan's model runs a {pipe_spec.cls}; point --weights "
                           "at that model's pipeline folder")
    return {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}


def _load_library(folder: Path, component: str, cls_name: str, library: str, dtype: torch.dtype) -> nn.Module:
    import importlib

    path = folder / component
    if not path.is_dir():
        raise OffloadError(f"{str(folder)!r} has no {component}/ folder; the pipeline folder is incomplete")
    cls = getattr(importlib.import_module(library), cls_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = cls.from_pretrained(path, torch_dtype=dtype)
        except (OSError, ValueError) as exc:
            raise OffloadError(f"{component} in {str(folder)!r} cannot be loaded ({exc}); download it again") from None
    return module.eval().requires_grad_(False)


def _load_tokenizer(folder: Path, name: str):
    import transformers

    from chunkflow.weights import pipeline_components

    lib, cls_name = pipeline_components(folder).get(name, ("transformers", "AutoTokenizer"))
    cls = getattr(transformers, cls_name, transformers.AutoTokenizer)
    try:
        return cls.from_pretrained(folder / name)
    except (OSError, ValueError) as exc:
        raise OffloadError(f"tokenizer {name} in {str(folder)!r} cannot be loaded ({exc})") from None


def _load_scheduler(folder: Path, pipe_spec):
    import diffusers

    from chunkflow.weights import pipeline_components

    _, cls_name = pipeline_components(folder).get("scheduler", ("diffusers", pipe_spec.scheduler.cls))
    return getattr(diffusers, cls_name).from_pretrained(folder / "scheduler")
