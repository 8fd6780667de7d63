"""Build a catalog transformer straight into the offloaded layout: random weights (fast) or a local
diffusers-format directory (config.json + safetensors), never the whole model on the GPU or twice on the host.

The class is constructed with its parameters on the meta device and its buffers real (so buffers computed at
construction, like Wan's rope tables or Qwen's rope frequencies, are computed as usual), in their final dtypes;
`chunkflow.offload(..., source=...)` then lays the blocks out from the meta shapes and writes each tensor once,
block tensors into the host store and the rest straight to the device.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from chunkflow.runtime.handle import OffloadError, OffloadHandle, offload, resolve_device

INIT_STD = 0.02


@contextlib.contextmanager
def params_on_meta():
    """Within: every registered parameter goes to the meta device; buffers are computed as usual (on CPU).

    Patches nn.Module.register_parameter for the duration (as accelerate's init_empty_weights does); not
    thread-safe, and restored on exit.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


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


def param_dtype(module: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """`dtype`, except float32 for modules the class keeps in fp32 (diffusers' `_keep_in_fp32_modules` rule)."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    return torch.float32 if any(k in name.split(".") for k in keep) else dtype


def _normalize(cfg: dict) -> dict:
    return {k: v for k, v in json.loads(json.dumps(cfg)).items() if not k.startswith("_")}


# --------------------------------------------------------------------------------------------- sources


class _RandomSource:
    """normal(0, 0.02) weights, zero biases, unit norm weights: finite activations in bf16. Every parameter is
    drawn (in module order, so a seed gives the same weights in every mode); buffers keep their computed values."""

    def __init__(self, seed: int, device: torch.device, module: nn.Module):
        self.gen_device = device if device.type == "cuda" else torch.device("cpu")
        self.g = torch.Generator(device=self.gen_device).manual_seed(seed)
        self.params = {n for n, _ in module.named_parameters(remove_duplicate=False)}

    def provides(self, name: str) -> bool:
        return name in self.params

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        if attr == "bias":
            out.zero_()
        elif "norm" in type(module).__name__.lower() and attr == "weight":
            out.fill_(1.0)
        elif out.device == self.gen_device:
            out.normal_(0.0, INIT_STD, generator=self.g)
        else:  # into the host store: generate on the GPU, copy down
            tmp = torch.empty(out.shape, dtype=out.dtype, device=self.gen_device)
            tmp.normal_(0.0, INIT_STD, generator=self.g)
            out.copy_(tmp)


class _SafetensorsSource:
    """Tensors read one at a time from a diffusers-format directory (safetensors only)."""

    def __init__(self, path: Path, spec, module: nn.Module):
        from safetensors import safe_open

        if not path.is_dir():
            raise OffloadError(f"weights {str(path)!r} is not a directory; give a diffusers-format model directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}]
            if pickles:
                raise OffloadError(
                    f"{str(path)!r} holds only pickle checkpoints ({', '.join(pickles)}); chunkflow loads safetensors "
                    "only, since unpickling a file can run code. Convert once, from a source you trust: "
                    "`m = <DiffusersClass>.from_pretrained(dir); m.save_pretrained(dir, safe_serialization=True)`"
                )
            raise OffloadError(f"{str(path)!r} has no *.safetensors files")
        self._check_config(path, spec)
        self._open = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where: dict[str, object] = {}
        for f in self._open:
            for k in f.keys():
                self.where[k] = f
        expected = dict(module.named_parameters(remove_duplicate=False))
        expected.update({n: b for n, b in module.named_buffers() if n in module.state_dict()})
        missing = [n for n in expected if n not in self.where]
        if missing:
            raise OffloadError(f"{str(path)!r} lacks tensor(s) {', '.join(missing[:5])}"
                               f"{' and %d more' % (len(missing) - 5) if len(missing) > 5 else ''}")
        for n, t in expected.items():
            shape = tuple(self.where[n].get_slice(n).get_shape())
            if shape != tuple(t.shape):
                raise OffloadError(f"tensor {n!r} in {str(path)!r} has shape {list(shape)}, the model expects "
                                   f"{list(t.shape)}; the checkpoint does not match the config")

    @staticmethod
    def _check_config(path: Path, spec) -> None:
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise OffloadError(f"{str(path)!r} has no config.json; it is not a diffusers-format model directory")
        cfg = json.loads(cfg_path.read_text())
        cls = cfg.get("_class_name")
        if cls is not None and cls != spec.diffusers.cls:
            raise OffloadError(f"{str(path)!r} holds a {cls}, but {spec.name} is a {spec.diffusers.cls}")
        mine, theirs = _normalize(dict(spec.diffusers.config)), _normalize(cfg)
        diff = [k for k in mine if k in theirs and mine[k] != theirs[k]]
        if diff:
            detail = ", ".join(f"{k}: catalog {mine[k]!r} vs file {theirs[k]!r}" for k in diff)
            raise OffloadError(f"config.json in {str(path)!r} does not match catalog entry {spec.name}: {detail}")

    def provides(self, name: str) -> bool:
        return name in self.where

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        out.copy_(self.where[name].get_tensor(name))  # one tensor at a time, cast on copy


# --------------------------------------------------------------------------------------------- build


def build_transformer(model, weights=None, dtype: torch.dtype = torch.bfloat16, device="cuda", config=None, *,
                      mode: str | None = None, chunk_size=None, residency: float | None = None,
                      comm_aware: bool | None = None, seed: int = 0, blocks=None) -> tuple[nn.Module, OffloadHandle]:
    """A catalog model (name or ModelSpec), offloaded as asked (`config` and the keywords as for
    `chunkflow.offload`), with random weights (None or "random") or weights from a local diffusers-format
    directory. Returns (module, handle).

    `handle.remove()` on a built module puts block tensors on the CPU; non-block tensors stay on the device.
    """
    spec = _spec(model)
    dev = resolve_device(device)
    if weights is not None and not (isinstance(weights, str) and weights == "random"):
        weights = Path(weights)
    module = construct_meta(spec)
    source = _SafetensorsSource(weights, spec, module) if isinstance(weights, Path) else None
    pnames: dict[int, str] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        pnames.setdefault(id(p), pname)
    # Parameters get their final dtype (still meta), so the layout is computed from shapes and dtypes alone.
    _swap_params(module, lambda p: nn.Parameter(
        torch.empty(p.shape, dtype=param_dtype(module, pnames[id(p)], dtype), device="meta"), requires_grad=False))
    if source is None:
        source = _RandomSource(seed, dev, module)
    handle = offload(module, config, mode=mode, chunk_size=chunk_size, residency=residency, comm_aware=comm_aware,
                     device=dev, blocks=blocks, source=source)
    return module, handle


def _swap_params(module: nn.Module, make) -> None:
    """Replace every Parameter by make(old); tied Parameters stay tied."""
    new: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for attr, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = make(p)
                m._parameters[attr] = new[id(p)]
