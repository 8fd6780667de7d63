"""fp8-scaled transformer files (Comfy-Org / Kijai "fp8_scaled" repackages): detect, check from the header, load.

The format: one .safetensors file in the model's original key layout (FLUX: BFL names such as
`double_blocks.0.img_attn.qkv.weight`; Wan: `blocks.0.self_attn.q.weight`), optionally under
`model.diffusion_model.`. Each quantized linear stores its weight as float8_e4m3fn with a companion
`<layer>.scale_weight`, a float32 scalar; the rest (norms, biases, embeddings, modulation) stays bf16/fp16/fp32.
A `scaled_fp8` tensor at the top level marks the file (its dtype names the fp8 type: only e4m3 is taken here);
`<layer>.scale_input` tensors, which ComfyUI reads only for its fp8-matmul path, are accepted and not used.

Dequantization follows ComfyUI's `scaled_fp8_ops` (comfy/ops.py): the weight is cast to the compute dtype and
multiplied by the scale cast to the compute dtype, `weight.to(dt) * scale_weight.to(dt)` (its `convert_weight`,
and the forward's branch for weights smaller than the input); `ScaledFp8Linear` computes
`F.linear(x, that, bias)` on the device, so chunkflow streams the file's fp8 bytes (half of bf16's) as they are
(and, for a streamed block, runs that dequantization ahead of the forward on the copy stream: runtime/codecs/ahead.py;
the layer then finds its weight decoded, its class marked `DECODED`, and uses it as it is).
Not the same bits as ComfyUI's other paths: its forward scales the *input* instead where the weight has more
elements than the input, its fp8-matmul path (`torch._scaled_mm`) and its newer quant_ops layout multiply by the
float32 scale unrounded; each rounds differently. The reference here is the one the issue names:
`w.to(bf16) * scale`.

diffusers (0.42) neither writes nor reads a scaled-fp8 layout: nothing in it knows `scale_weight`, its
single-file converters drop (FLUX) or rename (Wan) such tensors blindly, and its own fp8 (layerwise casting) has
no scale. Names are mapped by diffusers' own converter all the same (`SINGLE_FILE_LOADABLE_CLASSES`), without
reading data: it runs on row-id probes (one int64 per row of each file tensor), and what comes out of each
converted name says which rows of which file tensors it holds, so a split such as FLUX's fused qkv becomes byte
ranges in the file (what the disk tier reads) and each layer finds its scale. diffusers' FLUX converter splits
single blocks at FLUX.1's width (3072, fixed in single_file_utils); for a narrower config each row is repeated
3072/width times in the probes, so the fixed split falls where the model's own would.

Decisions: a `ScaledFp8Linear` is no `nn.Linear`, so diffusers' layerwise casting and chunkflow's
`weight_dtype="fp8_e4m3"` leave it as stored (never cast again, its scale never cast to fp8): that setting then
stores the file's other layers in fp8 exactly as it does for any module. LoRA on a `ScaledFp8Linear` is refused:
peft wraps only layer types it knows, and would cast adapters to the base layer's dtype (fp8); the module's
`load_lora_adapter` (diffusers' path, `pipe.load_lora_weights`) checks the adapter's targets first and raises
before anything changes; LoRAs on the other layers load as usual. peft's own `inject_adapter_in_model` on such a
layer raises peft's ValueError, after wrapping the targets before it.
"""

from __future__ import annotations

import hashlib
import re
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from chunkflow.runtime.params import DECODED
from chunkflow_planner.checkpoint import CheckpointError, TensorRecord, few_names, read_header, shown

__all__ = ["detect", "check", "build", "load", "source", "ScaledFp8Linear", "Fp8ScaledError", "Fp8ScaledSource",
           "Fp8ScaledFileRanges"]

SCALE = "scale_weight"
INPUT_SCALE = "scale_input"
MARKER = "scaled_fp8"
PREFIX = "model.diffusion_model."
FP8 = "F8_E4M3"
SCALE_DTYPES = ("F32", "F16", "BF16")  # held exactly by the float32 buffer
FLUX_WIDTH = 3072  # diffusers' convert_flux_transformer_checkpoint_to_diffusers: inner_dim = 3072
LORA_KEY = re.compile(r"\.(lora_A|lora_B|lora_down|lora_up|lora\.down|lora\.up|lora_magnitude_vector|alpha)(\.|$)")


class Fp8ScaledError(CheckpointError):
    """An fp8-scaled file that cannot be loaded as it is, or a change its layers cannot take; one line naming the
    file and tensor and what to do."""


class ScaledFp8Linear(nn.Module):
    """A linear layer holding the file's float8_e4m3fn `weight` and float32 `scale_weight` as stored, dequantized
    at each forward as ComfyUI does: `F.linear(x, weight.to(dt) * scale_weight.to(dt), bias)`, dt the compute
    dtype diffusers gives the layer's weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        # the bias first: diffusers reads a model's dtype (ModelMixin.dtype) and some layers' (Wan's time embedder)
        # from the first floating parameter, which must be the compute dtype, not fp8
        bias_value = torch.empty(out_features, dtype=compute_dtype, device=device) if bias else None
        self.bias = nn.Parameter(bias_value, requires_grad=False) if bias else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.register_buffer(SCALE, torch.ones((), dtype=torch.float32, device=device))

    @staticmethod
    def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored weight in `dtype`: the one dequantization, in the forward or ahead of it (chunkflow's
        runtime/codecs/fp8_scaled.py decodes a streamed block's weights with it, on the copy stream)."""
        return weight.to(dtype) * scale.to(dtype)

    def dequantized_weight(self) -> torch.Tensor:
        if getattr(type(self.weight), DECODED, False):  # chunkflow bound it to `dequantize`'s result already
            return self.weight
        return self.dequantize(self.weight, self.scale_weight, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        dt = str(self.compute_dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"weight=float8_e4m3fn x scale_weight -> {dt}"


# ------------------------------------------------------------------------------------------- the file's header


@dataclass(frozen=True)
class FileTensors:
    """The file's tensors by name (prefix removed), scales and markers apart: `scales` maps a weight's name to its
    scale's record."""

    path: Path
    records: dict[str, TensorRecord]
    scales: dict[str, TensorRecord]


def _err(path: Path, what: str) -> Fp8ScaledError:
    return Fp8ScaledError(f"fp8-scaled file {str(path)!r}: {what}")


def _strip(path: Path, header: dict[str, TensorRecord]) -> dict[str, TensorRecord]:
    """Names without ComfyUI's `model.diffusion_model.` prefix (as diffusers' converters strip it)."""
    out: dict[str, TensorRecord] = {}
    for key, rec in header.items():
        name = key.removeprefix(PREFIX)
        if name in out:
            raise _err(path, f"holds {shown(name)} both with and without the {PREFIX!r} prefix; re-download it")
        out[name] = rec
    return out


def _check_scale(path: Path, name: str, rec: TensorRecord, records: dict[str, TensorRecord]) -> str:
    """The weight a scale belongs to, after checking both."""
    weight = name[: -len(SCALE)] + "weight"
    if rec.dtype not in SCALE_DTYPES or rec.nbytes != rec.itemsize:
        raise _err(path, f"tensor {shown(rec.key)} is {rec.dtype} {list(rec.shape)}; a per-tensor scale is one "
                         f"{', '.join(SCALE_DTYPES)} value: the file is another quantization, use a GGUF or bf16 file")
    if weight not in records:
        raise _err(path, f"tensor {shown(rec.key)} scales a weight the file does not hold ({shown(weight)}); it is "
                         "incomplete: download it again")
    if records[weight].dtype != FP8:
        raise _err(path, f"tensor {shown(rec.key)} scales {shown(records[weight].key)}, which is "
                         f"{records[weight].dtype}, not F8_E4M3; the file is not fp8-scaled as ComfyUI writes it")
    return weight


def read_file(path: str | Path) -> FileTensors:
    """The file's tensors from its header (safetensors' own checks: bounds, overlaps, a truncated file), each fp8
    weight with its scale, every scale a scalar float of an e4m3 weight."""
    path = Path(path)
    records = _strip(path, read_header(path))
    marker = records.pop(MARKER, None)
    if marker is not None and marker.dtype != FP8:
        raise _err(path, f"its {MARKER!r} marker is {marker.dtype}: weights stored as float8_e5m2 are not supported; "
                         "use an e4m3 (fp8_e4m3fn) file")
    for name in [n for n in records if n.endswith("." + INPUT_SCALE)]:
        del records[name]  # ComfyUI's fp8-matmul path only (module docstring)
    scale_names = [n for n in records if n.endswith("." + SCALE)]
    scale_recs = {n: records.pop(n) for n in scale_names}
    scales = {_check_scale(path, n, rec, records): rec for n, rec in scale_recs.items()}
    for name, rec in records.items():
        if rec.dtype.startswith("F8_") and name not in scales:
            raise _err(path, f"tensor {shown(rec.key)} is {rec.dtype} without a {SCALE!r}; the file is incomplete or "
                             "another fp8 layout: download it again, or use a bf16 file")
    return FileTensors(path, records, scales)


def detect(path: str | Path) -> bool:
    """Whether the safetensors file at `path` is fp8-scaled: e4m3 weights with `scale_weight` companions (header
    only). A file that is no readable safetensors file raises CheckpointError naming it."""
    names = _strip(Path(path), read_header(path))
    return any(n.endswith("." + SCALE) and names.get(n[: -len(SCALE)] + "weight") is not None
               and names[n[: -len(SCALE)] + "weight"].dtype == FP8 for n in names)


# ------------------------------------------------------------------------- names: diffusers' converter, traced


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) (along dim 0) of the file tensor `key`."""

    key: str
    start: int
    stop: int


def _rows(rec: TensorRecord) -> int:
    return rec.shape[0] if rec.shape else 1


def _converter(model_cls: type):
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(model_cls.__name__)
    return entry["checkpoint_mapping_fn"] if entry else None


def _stretch(path: Path, model_cls: type, config: dict) -> int:
    """How many times each row is repeated in the probes (module docstring: FLUX's fixed split)."""
    if model_cls.__name__ != "FluxTransformer2DModel":
        return 1
    width = int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128))
    if FLUX_WIDTH % width:
        raise _err(path, f"diffusers' FLUX converter splits single blocks at width {FLUX_WIDTH}; a width of {width} "
                         "(num_attention_heads x attention_head_dim) is not a divisor of it, so the split is unknown")
    return FLUX_WIDTH // width


def _decode(ids: torch.Tensor, bounds: torch.Tensor, keys: list[str]) -> tuple[Rows, ...]:
    """Row ids -> runs of consecutive rows of one file tensor (`bounds`: each tensor's first id, then the total)."""
    if ids.numel() == 0:
        return ()
    starts = bounds[:-1]
    first, n = int(ids[0]), ids.numel()
    i = int(torch.searchsorted(starts, torch.tensor([first]), right=True)) - 1
    if first + n <= int(bounds[i + 1]) and bool((ids[1:] - ids[:-1] == 1).all()):  # one run (most tensors)
        return (Rows(keys[i], first - int(starts[i]), first - int(starts[i]) + n),)
    which = torch.searchsorted(starts, ids.contiguous(), right=True) - 1
    row = ids - starts[which]
    cut = torch.ones(n, dtype=torch.bool)
    cut[1:] = (which[1:] != which[:-1]) | (row[1:] != row[:-1] + 1)
    at = cut.nonzero().flatten().tolist() + [n]
    return tuple(Rows(keys[int(which[a])], int(row[a]), int(row[a]) + b - a) for a, b in zip(at[:-1], at[1:]))


def _unstretch(path: Path, name: str, probe, m: int) -> torch.Tensor:
    ok = isinstance(probe, torch.Tensor) and probe.dtype == torch.int64 and probe.dim() == 1 and probe.numel() % m == 0
    groups = probe.view(-1, m) if ok else None
    if groups is None or not bool((groups == groups[:, :1]).all()):
        raise _err(path, f"diffusers' converter builds {shown(name)} other than from whole rows of the file's tensors; "
                         "chunkflow cannot map it without reading the data")
    return groups[:, 0]


def trace_names(file: FileTensors, model_cls: type, config: dict, module_names: set[str]) -> dict[str, tuple[Rows, ...]]:
    """Module tensor name -> the file rows it holds, by diffusers' single-file converter for `model_cls` run on
    row-id probes (no data read); the file's own names where they are already the module's."""
    keys = list(file.records)
    if set(keys) == module_names:
        return {k: (Rows(k, 0, _rows(file.records[k])),) for k in keys}
    convert = _converter(model_cls)
    if convert is None:
        raise _err(file.path, f"its names are not {model_cls.__name__}'s and diffusers has no single-file converter "
                              "for that class")
    m = _stretch(file.path, model_cls, config)
    counts = [_rows(file.records[k]) for k in keys]
    starts = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
    probes = {k: torch.arange(int(starts[i]), int(starts[i + 1])).repeat_interleave(m) for i, k in enumerate(keys)}
    try:
        out = convert(checkpoint=probes, config=dict(config))
    except Exception as exc:  # the converter's own complaint (a KeyError names the tensor it looked for)
        raise _err(file.path, f"diffusers' {getattr(convert, '__name__', 'converter')} cannot map its names to "
                              f"{model_cls.__name__} ({type(exc).__name__}: {str(exc)[:200]}); the file is for "
                              "another model or config") from None
    return {name: _decode(_unstretch(file.path, name, p, m), starts, keys) for name, p in out.items()}


# ----------------------------------------------------------------------------------- the plan: check, then build


@dataclass
class Plan:
    """What the file gives the module: each tensor's file records (several where rows are joined) and, per fp8
    layer (its module name), the file weight whose scale it takes."""

    module: nn.Module  # the plain diffusers class, parameters on the meta device
    parts: dict[str, tuple[TensorRecord, ...]]
    scaled: dict[str, str]


def meta_module(model_cls: type, config: dict) -> nn.Module:
    """`model_cls` from `config` with its parameters on the meta device (buffers computed), in eval mode."""
    from chunkflow.models.meta import params_on_meta

    with params_on_meta(), torch.device("cpu"):
        module = model_cls.from_config(dict(config))
    return module.eval().requires_grad_(False)


def _slice(rec: TensorRecord, r: Rows, shape: tuple[int, ...] | None = None) -> TensorRecord:
    """The record of rows r of `rec` (shape: the module's, where one run is the whole tensor)."""
    row_bytes = rec.nbytes // max(1, _rows(rec))
    whole = (r.start, r.stop) == (0, _rows(rec))
    key = rec.key if whole else f"{rec.key}[{r.start}:{r.stop}]"
    own = (r.stop - r.start, *rec.shape[1:]) if rec.shape else ()
    return TensorRecord(key, rec.file, rec.dtype, shape if shape is not None else own,
                        rec.begin + r.start * row_bytes, (r.stop - r.start) * row_bytes)


def _check_tensor(file: FileTensors, name: str, runs: tuple[Rows, ...], t: torch.Tensor) -> None:
    recs = [file.records[r.key] for r in runs]
    rows = sum(r.stop - r.start for r in runs)
    want_rows = t.shape[0] if t.dim() else 1
    if rows != want_rows or any(tuple(rec.shape[1:]) != tuple(t.shape[1:]) for rec in recs):
        raise _err(file.path, f"tensor {shown(recs[0].key if recs else name)} gives {name!r} {rows} rows of "
                              f"{[list(r.shape) for r in recs][:3]}, the model expects {list(t.shape)}; the file "
                              "does not match the config")
    bad = [rec for rec in recs if rec.kind != "floating"]
    if bad:
        raise _err(file.path, f"tensor {shown(bad[0].key)} is {bad[0].dtype}, the model's {name!r} is floating; the "
                              "file does not match this model")


def _scaled_layer(file: FileTensors, name: str, runs: tuple[Rows, ...]) -> str | None:
    """The fp8 file weight whose scale the layer of module tensor `name` takes (None: not fp8)."""
    fp8 = {r.key for r in runs if r.key in file.scales}
    if not fp8:
        return None
    if len(fp8) > 1 or len(fp8) != len({r.key for r in runs}) or not name.endswith(".weight"):
        raise _err(file.path, f"diffusers' converter builds {name!r} from {few_names(sorted({r.key for r in runs}))}; "
                              "one fp8 layer takes one file weight and its one scale")
    return fp8.pop()


def _coverage(file: FileTensors, traced: dict[str, tuple[Rows, ...]]) -> None:
    """Every row of every file tensor lands in the module: anything left over is a tensor the model lacks."""
    used: dict[str, int] = {}
    for runs in traced.values():
        for r in runs:
            used[r.key] = used.get(r.key, 0) + r.stop - r.start
    extra = [file.records[k].key for k in file.records if used.get(k, 0) < _rows(file.records[k])]
    if extra:
        raise _err(file.path, f"holds tensor(s) the model does not have: {few_names(extra)}; the file is for another "
                              "model or config")


def plan(path: str | Path, model_cls: type, config: dict) -> Plan:
    """Everything `check` checks, and what `build` needs: header only, no tensor data read."""
    file = read_file(path)
    module = meta_module(model_cls, config)
    state = module.state_dict(keep_vars=True)
    traced = trace_names(file, model_cls, config, set(state))
    unknown = sorted(n for n in traced if n not in state)
    if unknown:
        raise _err(file.path, f"maps to tensor(s) {model_cls.__name__} does not have: {few_names(unknown)}; the file "
                              "is for another model or config")
    params = {n for n, _ in module.named_parameters()}
    missing = sorted(n for n in params if n not in traced)
    if missing:
        raise _err(file.path, f"lacks tensor(s) {few_names(missing)}; the file is incomplete or for another config")
    _coverage(file, traced)
    parts: dict[str, tuple[TensorRecord, ...]] = {}
    scaled: dict[str, str] = {}
    for name, runs in traced.items():
        _check_tensor(file, name, runs, state[name])
        recs = [file.records[r.key] for r in runs]
        one = tuple(state[name].shape) if len(runs) == 1 else None
        parts[name] = tuple(_slice(rec, r, one) for rec, r in zip(recs, runs))
        key = _scaled_layer(file, name, runs)
        if key is not None:
            scaled[name.removesuffix(".weight")] = key
    _check_layers(file, module, scaled)
    for layer, key in scaled.items():  # each fp8 layer's scale, in the buffer's shape ()
        rec = file.scales[key]
        parts[f"{layer}.{SCALE}"] = (TensorRecord(rec.key, rec.file, rec.dtype, (), rec.begin, rec.nbytes),)
    return Plan(module, parts, scaled)


def _check_layers(file: FileTensors, module: nn.Module, scaled: dict[str, str]) -> None:
    for layer, key in scaled.items():
        m = module.get_submodule(layer)
        if type(m) is not nn.Linear:
            raise _err(file.path, f"tensor {shown(file.records[key].key)} is fp8-scaled but {layer!r} is a "
                                  f"{type(m).__name__}; only Linear layers are dequantized (as ComfyUI does)")


def check(path: str | Path, model_cls: type, config: dict) -> None:
    """Check the fp8-scaled file at `path` against `model_cls` built from `config`, from its header alone: every
    tensor's dtype, shape and byte range inside the file, the names after diffusers' key conversion (missing and
    extra tensors), each fp8 weight's scale. Raises Fp8ScaledError (a CheckpointError), one line naming the file
    and tensor; reads no tensor data."""
    plan(path, model_cls, config)


# ------------------------------------------------------------------------------------------ build and load


class Fp8ScaledSource:
    """The module's values from the file (a chunkflow TensorSource, what `chunkflow.offload(source=...)` takes):
    each tensor from its records in the file (several where diffusers' converter joins rows), read as stored
    (fp8 weights and scales) or cast on the way in (another float dtype), and the records for the disk tier."""

    def __init__(self, parts: dict[str, tuple[TensorRecord, ...]], reader, what: str, owns_reader: bool = False):
        self.parts = parts
        self.reader = reader
        self.what = what
        self.owns_reader = owns_reader

    @property
    def nbytes(self) -> int:
        """Bytes the source reads: each distinct record once."""
        seen = {(r.file, r.begin, r.nbytes) for recs in self.parts.values() for r in recs}
        return sum(n for _, _, n in seen)

    def provides(self, name: str) -> bool:
        return name in self.parts

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        recs = self.parts[name]
        if len(recs) == 1:
            self.reader.read_tensor(recs[0], out)
            return
        flat, at = out.view(-1), 0
        for rec in recs:  # rows joined along dim 0: consecutive pieces of the contiguous destination
            n = rec.nbytes // rec.itemsize
            self.reader.read_tensor(rec, flat[at : at + n])
            at += n

    def digests(self, names: list[str]) -> dict[str, str]:
        """A digest of each named tensor's bytes as stored, with its dtype code (runtime/digest.py: what ranks
        sharing a host copy compare), read by a reader of its own that leaves the page cache as it found it."""
        from chunkflow.loading.reader import FileReader
        from chunkflow.runtime.digest import ALGORITHM, DIGEST_THREADS, PIECE

        wanted = [n for n in names if n in self.parts]
        with FileReader(threads=1, keep_cache=True) as reader:
            for path in {r.file for n in wanted for r in self.parts[n]}:
                reader.file(path)  # opened here, not by two threads at once

            def one(name: str) -> str:
                recs = self.parts[name]
                h = hashlib.new(ALGORITHM, recs[0].dtype.encode() + b"\0")
                buf = torch.empty(PIECE, dtype=torch.uint8)
                for rec in recs:
                    for a in range(0, rec.nbytes, PIECE):
                        n = min(PIECE, rec.nbytes - a)
                        reader.read_into(rec.file, rec.begin + a, n, buf[:n])
                        h.update(buf[:n].numpy())
                return h.hexdigest()

            with ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="chunkflow-digest") as pool:
                return dict(zip(wanted, pool.map(one, wanted)))

    def disk_files(self):
        """What the disk tier reads (runtime/tiers/disk.py): each tensor that is one byte range of the file; a
        block holding a joined one stays in host memory."""
        from chunkflow.loading.source import CheckpointFiles

        return CheckpointFiles({n: recs[0] for n, recs in self.parts.items() if len(recs) == 1})

    def close(self) -> None:
        if self.owns_reader:
            self.reader.close()


class Fp8ScaledFileRanges:
    """`chunkflow.offload(module, disk_blocks=k, source=source(path, module))` for a module `load` made from the
    fp8-scaled file at `path` (as formats/gguf.GGUFSource for a GGUF module): the module keeps its own values
    (nothing is provided), and the disk tier reads its blocks' bytes from the file, where each lies (the e4m3
    weights and scales as stored, the rest cast on the way in where the module holds another dtype)."""

    def __init__(self, path: str | Path, module: nn.Module):
        parts = plan(path, type(module), dict(module.config)).parts
        held = module.state_dict(keep_vars=True)
        self.records = {n: recs[0] for n, recs in parts.items()
                        if len(recs) == 1 and n in held and tuple(held[n].shape) == tuple(recs[0].shape)}

    def provides(self, name: str) -> bool:
        return False

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        raise KeyError(name)

    def disk_files(self):
        from chunkflow.loading.source import CheckpointFiles

        return CheckpointFiles(dict(self.records))


def source(path: str | Path, module: nn.Module) -> Fp8ScaledFileRanges:
    """What the runtime's disk tier reads a loaded module's blocks by (formats' optional `source` hook)."""
    return Fp8ScaledFileRanges(path, module)


def _replace(module: nn.Module, layer: str, compute_dtype: torch.dtype) -> None:
    """Swap the nn.Linear `layer` (meta) for a ScaledFp8Linear of the same size (meta)."""
    parent_name, _, attr = layer.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    old = getattr(parent, attr)
    new = ScaledFp8Linear(old.in_features, old.out_features, old.bias is not None, compute_dtype, device="meta")
    setattr(parent, attr, new.train(old.training))


def build(path: str | Path, model_cls: type, config: dict, compute_dtype: torch.dtype = torch.bfloat16,
          reader=None) -> tuple[nn.Module, Fp8ScaledSource]:
    """`model_cls` from `config` on the meta device, every fp8-scaled linear of the file a ScaledFp8Linear, the
    other parameters in `compute_dtype` (float32 in the modules the class keeps in fp32, as diffusers loads them),
    and the source of its values: `chunkflow.offload(module, ..., source=source)` reads each tensor once into its
    final place (and the disk tier reads the file). Everything `check` checks is checked first.

    Args:
        path: the fp8-scaled .safetensors file.
        model_cls: the diffusers class (FluxTransformer2DModel, WanTransformer3DModel, ...).
        config: its config (the transformer's config.json as a dict).
        compute_dtype: the dtype the model runs in.
        reader: a loading.FileReader (closed by the caller); None: the source's own (`source.close()`).
    """
    from chunkflow.loading.reader import FileReader
    from chunkflow.models.meta import param_dtype, swap_params

    p = plan(path, model_cls, config)
    module = p.module
    names: dict[int, str] = {}
    for name, prm in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(prm), name)
    swap_params(module, lambda prm: nn.Parameter(torch.empty(
        prm.shape, dtype=param_dtype(module, names[id(prm)], compute_dtype), device="meta"), requires_grad=False))
    for layer in p.scaled:
        _replace(module, layer, param_dtype(module, f"{layer}.weight", compute_dtype))
    _guard_lora(module, Path(path))
    own = reader is None
    source = Fp8ScaledSource(p.parts, FileReader() if own else reader, f"fp8-scaled file {str(path)!r}", own)
    return module, source


def _materialize(module: nn.Module, source: Fp8ScaledSource) -> None:
    """Every tensor the source provides read into a new CPU tensor (tied ones once)."""
    done: dict[int, torch.Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
            name = f"{prefix}.{attr}" if prefix else attr
            if t is None or (id(t) not in done and not source.provides(name)):
                continue
            if id(t) not in done:
                value = torch.empty(t.shape, dtype=t.dtype)
                source.fill(name, m, attr, value)
                done[id(t)] = nn.Parameter(value, requires_grad=False) if attr in m._parameters else value
            (m._parameters if attr in m._parameters else m._buffers)[attr] = done[id(t)]


def load(path: str | Path, model_cls: type, config: dict, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model of the fp8-scaled file at `path` on the CPU: `build`'s module with every tensor read (fp8 weights
    and scales as stored). Raises Fp8ScaledError (one line) for a file `check` refuses, before reading any data."""
    from chunkflow.loading.reader import FileReader

    with FileReader() as reader:
        module, source = build(path, model_cls, config, compute_dtype, reader)
        _materialize(module, source)
    return module


# ------------------------------------------------------------------------------------------------- LoRA


def _lora_targets(state_dict: dict, prefix: str | None) -> set[str]:
    """The module names a LoRA state dict (diffusers' or peft's names) puts adapters on."""
    keys = [k.removeprefix(f"{prefix}.") for k in state_dict if prefix is None or k.startswith(f"{prefix}.")]
    return {k[: m.start()] for k in keys if (m := LORA_KEY.search(k))}


def _guard_lora(module: nn.Module, path: Path) -> None:
    """The module's `load_lora_adapter` (diffusers') refuses an adapter on a ScaledFp8Linear before anything
    changes (module docstring); other adapters load as usual."""
    if getattr(type(module), "load_lora_adapter", None) is None:
        return

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", **kwargs):
        if isinstance(pretrained_model_name_or_path_or_dict, dict):
            hit = []
            for target in sorted(_lora_targets(pretrained_model_name_or_path_or_dict, prefix)):
                try:
                    if isinstance(self.get_submodule(target), ScaledFp8Linear):
                        hit.append(target)
                except AttributeError:
                    continue  # not a layer of this model: diffusers says so
            if hit:
                raise Fp8ScaledError(
                    f"a LoRA on {few_names(hit)}: fp8-scaled layers of {str(path)!r} (ScaledFp8Linear), which peft "
                    "cannot wrap (it would store the adapter in fp8); nothing was loaded. Use a bf16 or GGUF file "
                    "of the model with this LoRA, or fuse it into the weights before quantizing")
        return type(self).load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix=prefix, **kwargs)

    module.load_lora_adapter = types.MethodType(load_lora_adapter, module)
