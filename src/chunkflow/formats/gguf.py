"""A GGUF transformer file: checked from its header against the model, loaded as diffusers loads it, and its
tensors' byte ranges in the file for the disk tier.

- `check(path, model_cls, config_dir)`: before a byte of tensor data is read, the header (chunkflow_planner/
  gguf_header.py: magic, version, every tensor within the file), every tensor's type (GGUF_TYPES, and F32/F16/BF16
  for unquantized ones), and its names and shapes after diffusers' own key conversion (the converter
  `from_single_file` runs, here on meta tensors) against `model_cls` built from the config on the meta device.
  A mismatch is one CheckpointError line naming the file and the tensor.
- `load(...)`: the check, then `model_cls.from_single_file(path, quantization_config=GGUFQuantizationConfig(
  compute_dtype=...), config=config_dir, torch_dtype=...)`: the module diffusers builds, GGUFLinear layers holding
  GGUFParameters (the stored bytes and their quant_type); chunkflow streams those bytes as stored
  (runtime/quantized.py) and diffusers dequantizes them in each layer's forward, so outputs are diffusers' own.
- `GGUFSource(path, module)`: what `chunkflow.offload(source=...)` takes for `disk_blocks` with such a module: each
  module tensor's byte range in the file (`records`), found by running diffusers' converter on row-index proxies,
  so a tensor diffusers splits out of a stored one (Flux's fused qkv) is its rows' contiguous range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from chunkflow.loading.reader import FileReader
from chunkflow_planner.checkpoint import CheckpointError, TensorRecord, few_names, shown
from chunkflow_planner.gguf_header import GGUFHeader, GGUFTensor, read_header

__all__ = ["GGUF_TYPES", "UNQUANTIZED_TYPES", "check", "load", "source", "GGUFSource", "GGUFFiles", "byte_records"]

GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0")  # quantized types chunkflow streams
UNQUANTIZED_TYPES = ("F32", "F16", "BF16")
_TORCH_CODE = {"F32": "F32", "F16": "F16"}


def _mapping(model_cls: type, path: Path) -> tuple[Callable, Callable]:
    """diffusers' single-file key converter for `model_cls` and its test of whether a checkpoint needs it."""
    from diffusers.loaders.single_file_model import (
        SINGLE_FILE_LOADABLE_CLASSES,
        _get_single_file_loadable_mapping_class,
        _should_convert_state_dict_to_diffusers,
    )

    name = _get_single_file_loadable_mapping_class(model_cls)
    if name is None:
        raise CheckpointError(f"{str(path)!r}: diffusers cannot load a {model_cls.__name__} from a single file, so "
                              "chunkflow cannot either; use the pipeline folder's own transformer")
    return SINGLE_FILE_LOADABLE_CLASSES[name]["checkpoint_mapping_fn"], _should_convert_state_dict_to_diffusers


def _check_types(header: GGUFHeader) -> None:
    for t in header.tensors:
        if t.type_name not in GGUF_TYPES + UNQUANTIZED_TYPES:
            raise CheckpointError(
                f"{str(header.path)!r}: tensor {shown(t.name)} is stored as {t.type_name}; chunkflow streams GGUF "
                f"{', '.join(GGUF_TYPES)} (and {', '.join(UNQUANTIZED_TYPES)} for unquantized tensors): pick a "
                "file in one of those types")


def _converted(header: GGUFHeader, model_cls: type, config: dict, stand_in: Callable[[int, GGUFTensor], torch.Tensor]
               ) -> tuple[dict, dict]:
    """(the model's tensors on meta, the file's tensors as `stand_in` makes them after diffusers' conversion, as
    from_single_file runs it); one line where the conversion fails."""
    with torch.device("meta"):
        expected = model_cls.from_config(config).state_dict()
    convert, should = _mapping(model_cls, header.path)
    checkpoint = {t.name: stand_in(i, t) for i, t in enumerate(header.tensors)}
    if not should(expected, checkpoint):
        return expected, checkpoint
    try:
        return expected, convert(checkpoint=checkpoint, config=config)
    except Exception as exc:  # the converter met names or shapes of another model
        raise CheckpointError(f"{str(header.path)!r}: diffusers' conversion of its tensor names for "
                              f"{model_cls.__name__} failed ({type(exc).__name__}: {shown(str(exc))}); the file is "
                              "for another model") from None


def check(path: Path, model_cls: type, config_dir: Path) -> GGUFHeader:
    """The file against `model_cls` built from `config_dir`'s config (module docstring); reads the header only."""
    header = read_header(path)
    _check_types(header)
    config = model_cls.load_config(str(config_dir))
    expected, converted = _converted(header, model_cls, config, lambda i, t: torch.empty(t.shape, device="meta"))
    where = f"the {model_cls.__name__} configured in {str(config_dir)!r}"
    missing = [k for k in expected if k not in converted]
    if missing:
        raise CheckpointError(f"{str(path)!r} lacks tensor(s) {few_names(missing)} of {where} (after diffusers' "
                              "name conversion); the file is for another model or config")
    extra = [k for k in converted if k not in expected]
    if extra:
        raise CheckpointError(f"{str(path)!r} holds tensor(s) {few_names(extra)} that {where} does not have; the "
                              "file is for another model or config")
    for k, v in converted.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(f"{str(path)!r}: tensor {k} has shape {list(v.shape)} in the file, {where} "
                                  f"expects {list(expected[k].shape)}; the file is for another config")
    return header


def _proxy(index: int, t: GGUFTensor) -> torch.Tensor:
    """Stored tensor `index`'s rows as int64 (index << 32 | row), shaped as its rows with ones after: diffusers'
    converters split, chunk and concatenate along the rows, which these values follow."""
    rows = t.shape[0] if t.shape else 1
    return ((index << 32) + torch.arange(rows, dtype=torch.int64)).reshape(rows, *([1] * (len(t.shape) - 1)))


def byte_records(header: GGUFHeader, model_cls: type, config: dict) -> dict[str, TensorRecord]:
    """Module tensor name -> where its bytes lie in the file, for each module tensor that is a contiguous row range
    of one stored tensor (diffusers' conversion run on row-index proxies: one int64 a stored row)."""
    _, converted = _converted(header, model_cls, config, _proxy)
    return {name: rec for name, rows in converted.items() if (rec := _record(header, rows.reshape(-1))) is not None}


def _record(header: GGUFHeader, rows: torch.Tensor) -> TensorRecord | None:
    """The byte range of consecutive rows of one stored tensor; None for reordered or joined rows (Flux's final
    scale/shift swap: no single range)."""
    if not rows.numel() or not torch.equal(rows, int(rows[0]) + torch.arange(rows.numel(), dtype=torch.int64)):
        return None
    t = header.tensors[int(rows[0]) >> 32]
    first, n = int(rows[0]) & 0xFFFFFFFF, rows.numel()
    row_bytes = t.nbytes // (t.shape[0] if t.shape else 1)
    code = _TORCH_CODE.get(t.type_name, "U8")  # diffusers holds F32/F16 as such, every other type as bytes
    inner = t.shape[1:] if code != "U8" else t.byte_shape[1:] if len(t.shape) > 1 else ()
    shape = (n, *inner) if code != "U8" or len(t.shape) > 1 else (n * row_bytes,)
    return TensorRecord(t.name, header.path, code, tuple(shape), t.offset + first * row_bytes, n * row_bytes)


def load(path: Path, model_cls: type, config_dir: Path, compute_dtype: torch.dtype) -> nn.Module:
    """The module diffusers builds from the GGUF file (checked first: nothing is read before the check passes)."""
    from diffusers import GGUFQuantizationConfig

    check(path, model_cls, config_dir)
    return model_cls.from_single_file(str(path), config=str(config_dir), torch_dtype=compute_dtype,
                                      quantization_config=GGUFQuantizationConfig(compute_dtype=compute_dtype)).eval()


class GGUFFiles:
    """The disk tier's view of a GGUF file (runtime/tiers/disk.DiskFiles): each module tensor's byte range, raw
    reads that drop the pages they bring into the page cache, and the data section's start (the disk tier checks
    the header ends before it)."""

    def __init__(self, records: dict[str, TensorRecord], data_start: int):
        self.where = records
        self.data_start = data_start
        self.reader = FileReader(drop_all=True)

    def record(self, name: str) -> TensorRecord | None:
        return self.where.get(name)

    def header_end(self, path: Path) -> int:
        return self.data_start

    def read_range(self, path, begin: int, nbytes: int, out: torch.Tensor) -> None:
        self.reader.read_into(path, begin, nbytes, out)

    def read_tensor(self, rec: TensorRecord, out: torch.Tensor) -> None:
        """A small tensor held in another dtype than the file's (F32 norms of a bf16 module): read, then cast."""
        raw = torch.empty(rec.nbytes, dtype=torch.uint8)
        self.reader.read_into(rec.file, rec.begin, rec.nbytes, raw)
        out.copy_(raw.view(getattr(torch, rec.dtype_name)).view(out.shape))

    def close(self) -> None:
        self.reader.close()


def _holds_file_values(t: torch.Tensor, rec: TensorRecord) -> bool:
    """Whether the module's tensor is the record's values: its bytes as stored (quantized), or the same number of
    floating values (F32/F16, cast at load); not a tensor diffusers dequantized at load (a module it keeps in
    float32), which the disk tier then leaves in host memory."""
    if rec.dtype == "U8":
        return t.dtype == torch.uint8 and t.numel() == rec.nbytes
    return t.is_floating_point() and tuple(t.shape) == tuple(rec.shape)


class GGUFSource:
    """`chunkflow.offload(module, disk_blocks=k, source=GGUFSource(path, module))` for a module loaded from the GGUF
    file at `path` (formats/gguf.load, or diffusers' from_single_file): the module keeps its own values (nothing is
    provided), and the disk tier reads its blocks' bytes from the file, where each lies."""

    def __init__(self, path: str | Path, module: nn.Module):
        header = read_header(Path(path))
        _check_types(header)
        held = module.state_dict(keep_vars=True)
        self.records = {k: rec for k, rec in byte_records(header, type(module), dict(module.config)).items()
                        if k in held and _holds_file_values(held[k], rec)}
        self.data_start = header.data_start

    def provides(self, name: str) -> bool:
        return False

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        raise KeyError(name)

    def disk_files(self) -> GGUFFiles:
        return GGUFFiles(dict(self.records), self.data_start)


def source(path: Path, module: nn.Module) -> GGUFSource:
    """What the runtime's disk tier reads `module`'s blocks by (formats' optional `source` hook)."""
    return GGUFSource(path, module)
