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


_WEIGHTS_STEM = "diffusion_pytorch_model"  # diffusers' SAFETENSORS_WEIGHTS_NAME, less ".safetensors"
_ST = ".safetensors"
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
              "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64"}


def _add_variant(name: str, variant: str | None) -> str:
    """diffusers' rule: the variant goes before the last suffix (`a.safetensors` -> `a.fp16.safetensors`,
    `a.safetensors.index.json` -> `a.safetensors.index.fp16.json`)."""
    if variant is None:
        return name
    head, _, tail = name.rpartition(".")
    return f"{head}.{variant}.{tail}"


def _unshard(name: str) -> tuple[str, bool]:
    """A `*.safetensors` file name's stem without its shard number, and whether it had one."""
    import re

    stem, n = re.subn(r"-\d{5}-of-\d{5}(?=\.|$)", "", name[: -len(_ST)])
    return stem, n > 0


def _parse_weights_name(name: str) -> tuple[str, str | None, bool]:
    """A `*.safetensors` file name as (base, variant, is_shard): `m.safetensors` -> (m, None, False),
    `m.fp16.safetensors` -> (m, fp16, False), `m-00001-of-00002.safetensors` -> (m, None, True), and both shard forms
    of a variant, `m.fp16-00001-of-00002.safetensors` and the legacy `m-00001-of-00002.fp16.safetensors`."""
    stem, shard = _unshard(name)
    base, dot, variant = stem.rpartition(".")
    return (base, variant, shard) if dot and base else (stem, None, shard)


def _index_variant(name: str) -> str | None:
    """The variant of an index file name: `m.safetensors.index.fp16.json` (or legacy `m.safetensors.fp16.index.json`)
    -> fp16; `m.safetensors.index.json` -> None."""
    parts = name.split(_ST, 1)[1].strip(".").split(".")
    rest = [p for p in parts if p not in {"index", "json"}]
    return rest[0] if len(parts) == 3 and len(rest) == 1 else None


def _re_search(pattern: str, key: str) -> bool:
    import re

    return re.search(pattern, key) is not None


def _dtype_kind(dtype) -> str | None:
    """'floating', 'integer', 'bool' or 'complex' for a torch dtype or a safetensors dtype code (None: unknown)."""
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return "bool"
        return "complex" if dtype.is_complex else "floating" if dtype.is_floating_point else "integer"
    if dtype == "BOOL":
        return "bool"
    if dtype.startswith(("I", "U")):
        return "integer"
    if dtype.startswith("C"):
        return "complex"
    if dtype.startswith(("F", "BF", "E")):
        return "floating"
    return None


def _names(items, limit: int = 5) -> str:
    items = list(items)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _open_safetensors(file: Path):
    """A safetensors file opened for reading one tensor at a time; a damaged or truncated one is an OffloadError."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for damaged files
        raise OffloadError(f"{str(file)!r} is not a readable safetensors file ({exc}); it may be truncated: "
                           "download or save it again") from None


class _SafetensorsSource:
    """Tensors read one at a time from a diffusers-format directory (safetensors only), chosen as
    `ModelMixin.from_pretrained` chooses them:

    1. an index for the variant (`diffusion_pytorch_model.safetensors.index[.VARIANT].json`, or the legacy
       `...safetensors.VARIANT.index.json`; failing those, the folder's one `*.safetensors.index[.VARIANT].json`):
       its `weight_map` alone says which shard holds each tensor;
    2. else the single file `diffusion_pytorch_model[.VARIANT].safetensors`;
    3. else the folder's one `*.safetensors` file that is not a shard and not a variant of another name (with a
       variant: the one `*.VARIANT.safetensors`).

    Variant files are ignored unless `variant` asks for one. Every check (missing, unexpected, misshapen tensors and
    integer/floating mix-ups) runs here, before any tensor is filled; floating tensors are cast on copy.
    """

    def __init__(self, path: Path, spec, module: nn.Module, *, variant: str | None = None,
                 dtype: torch.dtype | None = None):
        if not path.is_dir():
            raise OffloadError(f"weights {str(path)!r} is not a directory; give a diffusers-format model directory")
        if variant is not None and (not isinstance(variant, str) or not variant or any(c in variant for c in "./\\")):
            raise OffloadError(f"variant {variant!r} is not a variant name; give one like 'fp16', or None")
        files = sorted(p.name for p in path.glob("*" + _ST) if p.is_file())
        indexes = sorted(p.name for p in path.glob("*" + _ST + ".*json") if p.is_file())
        if not files and not indexes:
            pickles = [p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}]
            if pickles:
                raise OffloadError(
                    f"{str(path)!r} holds only pickle checkpoints ({', '.join(pickles)}); chunkflow loads safetensors "
                    "only, since unpickling a file can run code. Convert once, from a source you trust: "
                    "`m = <DiffusersClass>.from_pretrained(dir); m.save_pretrained(dir, safe_serialization=True)`"
                )
            raise OffloadError(f"{str(path)!r} has no *.safetensors files")
        self._check_config(path, spec)

        index, single = self._choose(path, files, indexes, variant)
        self.where: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        if index is not None:
            weight_map = self._read_index(path, index)
            shards = sorted(set(weight_map.values()))
            handles = {s: _open_safetensors(path / s) for s in shards}
            keys = {s: set(h.keys()) for s, h in handles.items()}
            absent = [k for k, s in weight_map.items() if k not in keys[s]]
            if absent:
                raise OffloadError(
                    f"{index} in {str(path)!r} places tensor(s) {_names(absent)} in shards that do not hold them (e.g. "
                    f"{absent[0]!r} in {weight_map[absent[0]]}); the index does not match its shards: download or save "
                    "the checkpoint again")
            for k, s in weight_map.items():
                self.where[k], self.file_of[k] = handles[s], s
        else:
            h = _open_safetensors(path / single)
            for k in h.keys():
                self.where[k], self.file_of[k] = h, single

        state = module.state_dict(keep_vars=True)
        expected = dict(module.named_parameters(remove_duplicate=False))
        expected.update({n: b for n, b in module.named_buffers() if n in state})
        missing = [n for n in expected if n not in self.where]
        if missing:
            raise OffloadError(f"{str(path)!r} lacks tensor(s) {_names(missing)}")
        ignore = getattr(type(module), "_keys_to_ignore_on_load_unexpected", None) or []
        unexpected = [k for k in self.where if k not in expected]
        skipped = [k for k in unexpected if any(_re_search(p, k) for p in ignore)]
        for k in skipped:  # keys the class declares harmless (diffusers drops them too, e.g. Wan's norm_added_q)
            del self.where[k]
        unexpected = [k for k in unexpected if k not in skipped]
        if unexpected:
            raise OffloadError(
                f"{str(path)!r} holds tensor(s) the {type(module).__name__} does not have: "
                f"{_names(sorted(unexpected))}; "
                "the checkpoint is for another model or config: point weights= at the matching transformer directory")
        params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        for n, t in expected.items():
            sl = self.where[n].get_slice(n)
            shape = tuple(sl.get_shape())
            if shape != tuple(t.shape):
                raise OffloadError(f"tensor {n!r} in {str(path)!r} has shape {list(shape)}, the model expects "
                                   f"{list(t.shape)}; the checkpoint does not match the config")
            code = sl.get_dtype()
            want = param_dtype(module, n, dtype) if (n in params and dtype is not None) else t.dtype
            have_kind, want_kind = _dtype_kind(code), _dtype_kind(want)
            if have_kind is not None and have_kind != want_kind:
                raise OffloadError(
                    f"tensor {n!r} in {self.file_of[n]} ({str(path)!r}) is {_ST_DTYPES.get(code, code)} ({have_kind}), "
                    f"the model's {'parameter' if n in params else 'buffer'} is {str(want).removeprefix('torch.')} "
                    f"({want_kind}); chunkflow casts only between floating dtypes: the checkpoint does not match this "
                    "model (quantized or converted?): use an unquantized diffusers checkpoint")

    @staticmethod
    def _choose(path: Path, files: list[str], indexes: list[str], variant: str | None) -> tuple[str | None, str | None]:
        """(index file, None) or (None, single weights file) for `variant`, by the rules in the class docstring."""
        std_index = _add_variant(_WEIGHTS_STEM + _ST + ".index.json", variant)
        candidates = [std_index] + ([f"{_WEIGHTS_STEM}{_ST}.{variant}.index.json"] if variant else [])
        for c in candidates:
            if c in indexes:
                return c, None
        std_file = _add_variant(_WEIGHTS_STEM + _ST, variant)
        if std_file in files:
            return None, std_file
        suffixes = [f"{_ST}.index.{variant}.json", f"{_ST}.{variant}.index.json"] if variant else [f"{_ST}.index.json"]
        other_index = [i for i in indexes if i.endswith(tuple(suffixes))]
        if len(other_index) == 1:
            return other_index[0], None

        stems = {_unshard(f)[0] for f in files} | {i.split(_ST)[0] for i in indexes if _index_variant(i) is None}
        parsed = {f: _parse_weights_name(f) for f in files}

        def is_variant(f: str) -> bool:  # of another name: the diffusers name, or a base whose own file is here
            base, v, _ = parsed[f]
            return v is not None and (base == _WEIGHTS_STEM or base in stems)

        present = sorted({parsed[f][1] for f in files if is_variant(f)}
                         | {v for v in map(_index_variant, indexes) if v is not None})
        if variant is None:
            pool = [f for f in files if not is_variant(f)]
        else:
            pool = [f for f in files if parsed[f][1] == variant]
        singles = [f for f in pool if not parsed[f][2]]
        shards = [f for f in pool if parsed[f][2]]
        if len(singles) == 1 and not shards and not other_index:
            return None, singles[0]

        where = f"{str(path)!r} (found: {_names(files + indexes, 12) or 'nothing'})"
        what = f"the {variant!r} variant" if variant else "the default (non-variant) weights"
        if len(other_index) > 1:
            raise OffloadError(f"several index files ({_names(other_index)}) could hold {what} in {where}; keep only "
                               "the right one")
        if shards:
            raise OffloadError(f"{what} in {str(path)!r} are sharded ({_names(shards, 3)}) but their index "
                               f"({std_index}) is missing; download it again, or re-save with save_pretrained")
        if len(singles) > 1:
            raise OffloadError(f"several files ({_names(singles)}) could hold {what} in {where}; chunkflow reads one "
                               f"file or the shards an index names: keep one, or name it {std_file}")
        if variant is not None:
            others = (f"variants present: {', '.join(repr(v) for v in present)}" if present
                      else "it has no variants: leave variant unset for the default weights")
            raise OffloadError(f"there is no {variant!r} variant in {where}: no {std_index} and no {std_file}; "
                               f"{others}")
        if present:
            raise OffloadError(f"{where} has no {std_index} or {std_file}, only variant files; ask for one with "
                               f"variant= one of {', '.join(repr(v) for v in present)}")
        raise OffloadError(f"{where} has no {std_index} or {std_file}; give a diffusers-format model directory")

    @staticmethod
    def _read_index(path: Path, index: str) -> dict[str, str]:
        """The index's weight_map, checked: well formed, shard names plain file names, every shard present."""
        try:
            data = json.loads((path / index).read_text())
        except (OSError, ValueError) as exc:
            raise OffloadError(f"index {index} in {str(path)!r} cannot be read ({exc}); download it again") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise OffloadError(f"index {index} in {str(path)!r} has no weight_map of tensor name -> shard file; "
                               "download it again or re-save the model with save_pretrained")
        shards = sorted(set(wm.values()))
        bad = [s for s in shards if s in {"", ".", ".."} or Path(s).name != s or "\\" in s]
        if bad:
            raise OffloadError(f"index {index} in {str(path)!r} names shard(s) {_names(bad)} outside the directory; "
                               "shard names must be plain file names: the index is damaged or not to be trusted")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise OffloadError(f"index {index} in {str(path)!r} names shard file(s) {_names(missing)} that are not in "
                               "the directory; download the missing shard(s) again")
        return wm

    @staticmethod
    def _check_config(path: Path, spec) -> None:
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise OffloadError(f"{str(path)!r} has no config.json; it is not a diffusers-format model directory")
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OffloadError(f"config.json in {str(path)!r} cannot be read as JSON ({exc}); download or save the "
                               "model again") from None
        if not isinstance(cfg, dict):
            raise OffloadError(f"config.json in {str(path)!r} must hold a JSON object (the model's constructor "
                               f"arguments), not a {type(cfg).__name__}")
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
                      comm_aware: bool | None = None, seed: int = 0, blocks=None,
                      variant: str | None = None) -> tuple[nn.Module, OffloadHandle]:
    """A catalog model (name or ModelSpec), offloaded as asked (`config` and the keywords as for
    `chunkflow.offload`), with random weights (None or "random") or weights from a local diffusers-format
    directory (`variant`, e.g. "fp16", picks diffusers' variant files there, as `from_pretrained` does).
    Returns (module, handle).

    `handle.remove()` on a built module puts block tensors on the CPU; non-block tensors stay on the device.
    """
    spec = _spec(model)
    dev = resolve_device(device)
    if weights is not None and not (isinstance(weights, str) and weights == "random"):
        weights = Path(weights)
    if variant is not None and not isinstance(weights, Path):
        raise OffloadError(f"variant {variant!r} picks files in a weights directory; give weights=DIR with it")
    module = construct_meta(spec)
    source = (_SafetensorsSource(weights, spec, module, variant=variant, dtype=dtype)
              if isinstance(weights, Path) else None)
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
