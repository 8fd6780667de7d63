"""Single-file transformer checkpoints (`--transformer FILE` beside `--weights DIR`): which format a file is, told
from its first bytes (never from its name alone), and the module that checks and loads that format.

- `gguf`: a GGUF file (llama.cpp's format; city96 / QuantStack's transformers): formats/gguf.py, the module diffusers'
  `from_single_file(..., quantization_config=GGUFQuantizationConfig(...))` builds, its quantized bytes streamed as
  stored (runtime/quantized.py).
- `fp8-scaled`: a safetensors file of float8_e4m3fn weights with per-tensor scales (Comfy-Org / Kijai layout):
  `chunkflow/formats/fp8_scaled.py` where this chunkflow has it.

Every format module has `check(path, model_cls, config_dir)` (the file against the model before anything is read;
a CheckpointError of one line, naming the file and the tensor, for a mismatch) and `load(path, model_cls,
config_dir, compute_dtype) -> nn.Module`. `build` gives what a pipeline places (models/transformer_file.py): the
module and the source the runtime reads it by, so the file streams from every tier (host, disk, shared).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from chunkflow_planner.checkpoint import CheckpointError

__all__ = ["FormatError", "detect", "format_module", "check", "load", "build", "read_bytes", "FORMAT_MODULES"]

# format name -> the module implementing it (imported when used)
FORMAT_MODULES = {"gguf": "chunkflow.formats.gguf", "fp8-scaled": "chunkflow.formats.fp8_scaled"}


class FormatError(CheckpointError):
    """A transformer file chunkflow cannot read as any format it knows; the message says what it is and what to do."""


def _safetensors_header(head: bytes) -> bool:
    """An 8-byte little-endian header length, then a JSON object."""
    return len(head) >= 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 100 * 2**20


def _fp8_scaled() -> ModuleType | None:
    try:
        return importlib.import_module(FORMAT_MODULES["fp8-scaled"])
    except ModuleNotFoundError as exc:
        if exc.name != FORMAT_MODULES["fp8-scaled"]:
            raise
        return None


def detect(path: str | os.PathLike) -> str:
    """The format of the file at `path` ('gguf' or 'fp8-scaled') from its first bytes; FormatError otherwise."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise FormatError(f"--transformer {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    if head[:4] == b"GGUF":
        return "gguf"
    if _safetensors_header(head):
        fp8 = _fp8_scaled()
        if fp8 is not None and fp8.detect(path):
            return "fp8-scaled"
        raise FormatError(f"--transformer {str(path)!r} is a safetensors file but not an fp8-scaled transformer this "
                          "chunkflow reads; a bf16 transformer belongs in the pipeline folder (--weights DIR), or "
                          "use a GGUF file")
    raise FormatError(f"--transformer {str(path)!r} is neither a GGUF file (it does not start with b'GGUF') nor a "
                      "safetensors file; give a .gguf or an fp8-scaled .safetensors transformer")


def format_module(name: str) -> ModuleType:
    """The module implementing format `name`."""
    if name == "fp8-scaled":
        mod = _fp8_scaled()
        if mod is None:
            raise FormatError("fp8-scaled transformer files are not supported by this chunkflow yet")
        return mod
    return importlib.import_module(FORMAT_MODULES[name])


def check(path: str | os.PathLike, model_cls: type, config_dir: str | os.PathLike) -> str:
    """The file's format, after checking the file against `model_cls` built from `config_dir`'s config."""
    fmt = detect(path)
    format_module(fmt).check(Path(path), model_cls, _config(fmt, model_cls, config_dir))
    return fmt


def load(path: str | os.PathLike, model_cls: type, config_dir: str | os.PathLike, compute_dtype):
    """The module `model_cls` from the file (checked first), computing in `compute_dtype`."""
    fmt = detect(path)
    return format_module(fmt).load(Path(path), model_cls, _config(fmt, model_cls, config_dir), compute_dtype)


def build(path: str | os.PathLike, model_cls: type, config_dir: str | os.PathLike, compute_dtype, reader=None):
    """(module, source) for `chunkflow.offload(module, source=source)`: an fp8-scaled file's module on the meta
    device, its source reading each tensor from the file into its final place (through `reader`, a FileReader the
    caller closes) and giving the disk tier the file's byte ranges; a GGUF file's module as diffusers loads it, its
    source the file's byte ranges for the disk tier (formats/gguf.GGUFSource). The file is checked first."""
    fmt = detect(path)
    mod = format_module(fmt)
    config = _config(fmt, model_cls, config_dir)
    if fmt == "fp8-scaled":
        return mod.build(Path(path), model_cls, config, compute_dtype, reader)
    module = mod.load(Path(path), model_cls, config, compute_dtype)
    return module, mod.source(Path(path), module)


def read_bytes(path: str | os.PathLike, fmt: str) -> int:
    """Bytes `build` reads through the caller's reader (what a load's progress counts): an fp8-scaled file's
    tensors, header only; 0 for GGUF (diffusers reads the file itself)."""
    if fmt != "fp8-scaled":
        return 0
    file = format_module(fmt).read_file(Path(path))
    return sum(r.nbytes for r in file.records.values()) + sum(r.nbytes for r in file.scales.values())


def _config(fmt: str, model_cls: type, config_dir: str | os.PathLike):
    """What format `fmt`'s module builds the model from: the folder (GGUF: diffusers' from_single_file reads it), or
    the config it holds (fp8-scaled builds the model itself)."""
    if fmt == "fp8-scaled":
        return dict(model_cls.load_config(str(config_dir)))
    return Path(config_dir)
