"""A transformer file in a stored format (`--transformer FILE`: a .gguf, or an fp8-scaled .safetensors), priced
exactly from its header (issue 52): each block's bytes summed from its tensors' records, the format named from
their types. Nothing here reads tensor data.

A tensor belongs to block i of a group when its name, less a checkpoint prefix (`model.diffusion_model.`), starts
with the group's diffusers list (`transformer_blocks.i.`) or the original layout's (city96's FLUX and HunyuanVideo
files keep `double_blocks.i.` / `single_blocks.i.`; Wan's original `blocks.i.` is diffusers' too). Its bytes as
stored stream; a quantized weight (a GGUF quant type formats.py prices, or float8_e4m3fn) is decoded each call.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chunkflow_planner.formats import COMPUTE_BYTES, GGUF_FORMATS, GGUF_KEPT_TYPES, FormatError

if TYPE_CHECKING:
    from chunkflow_planner.catalog import BlockGroup, ModelSpec, StoredBlock

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
ORIGINAL_LISTS = {"flux_double": "double_blocks", "flux_single": "single_blocks", "hunyuan_double": "double_blocks",
                  "hunyuan_single": "single_blocks"}
FP8_SCALES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale")  # Comfy's per-tensor scales
SAFETENSORS_KEPT = ("F32", "F16", "BF16")
FP8 = "F8_E4M3"


@dataclass(frozen=True)
class Tensor:
    """One tensor record: its name, type (a GGUF type name, or a safetensors dtype code), shape and bytes stored."""

    name: str
    type: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def gguf_tensors(path: Path) -> tuple[list[Tensor], int]:
    """(tensor records, file size) of a GGUF file: the one use of gguf_header (branch gguf's reader)."""
    from chunkflow_planner.gguf_header import read_header

    h = read_header(path)
    return [Tensor(t.name, t.type_name, tuple(t.shape), t.nbytes) for t in h.tensors], h.file_size


def safetensors_tensors(path: Path) -> tuple[list[Tensor], int]:
    """(tensor records, file size) of one safetensors file (checkpoint.read_header)."""
    from chunkflow_planner.checkpoint import read_header

    return [Tensor(r.key, r.dtype, tuple(r.shape), r.nbytes) for r in read_header(path).values()], \
        Path(path).stat().st_size


def read_tensors(path: Path) -> tuple[list[Tensor], int, str]:
    """(records, file size, container) of a .gguf or .safetensors file; anything else is one line."""
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return (*gguf_tensors(path), "gguf")
    if suffix == ".safetensors":
        return (*safetensors_tensors(path), "safetensors")
    raise FormatError(f"{str(path)!r} is neither a .gguf nor a .safetensors file; give the transformer's GGUF file "
                      "or its fp8-scaled safetensors file")


def quant_format(t: Tensor, container: str) -> str | None:
    """The formats.py format a weight is quantized in (None: kept as it is, not decoded)."""
    if container == "gguf":
        return GGUF_FORMATS.get(t.type)
    return "fp8-scaled" if t.type == FP8 else None


def _check_types(path: Path, tensors: list[Tensor], container: str) -> None:
    """Every tensor in a type chunkflow prices: else one line naming the types and what to do."""
    ok = set(GGUF_FORMATS) | set(GGUF_KEPT_TYPES) if container == "gguf" else {FP8, *SAFETENSORS_KEPT}
    bad = sorted({t.type for t in tensors if t.type not in ok})
    if bad:
        first = next(t.name for t in tensors if t.type == bad[0])
        raise FormatError(f"{str(path)!r} holds tensors in {', '.join(bad)} (first {first!r}), which chunkflow does "
                          f"not run; supported: {', '.join(GGUF_FORMATS) if container == 'gguf' else 'float8_e4m3fn'}"
                          f" weights with F32/F16/BF16 for the rest: download that file's Q8_0, Q6_K, Q5_K_M, "
                          "Q4_K_M or Q4_0 version")


def block_of(spec: ModelSpec, name: str) -> int | None:
    """The block (its position in execution order) tensor `name` belongs to, or None for a non-block tensor."""
    for p in PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    start = 0
    for g in spec.blocks:
        for lst in (g.diffusers_list, ORIGINAL_LISTS.get(g.arch)):
            if lst and name.startswith(lst + "."):
                index = name[len(lst) + 1:].split(".", 1)[0]
                if index.isdigit() and g.first <= int(index) < g.first + g.count:
                    return start + int(index) - g.first
        start += g.count
    return None


def _stored_block(tensors: list[Tensor], container: str) -> tuple[StoredBlock, int]:
    """(one block as the file stores it, its parameters: scale tensors are not parameters)."""
    from chunkflow_planner.catalog import StoredBlock

    decoded: dict[str, int] = {}
    peak = params = 0
    for t in tensors:
        fmt = quant_format(t, container)
        if fmt is not None:
            decoded[fmt] = decoded.get(fmt, 0) + t.numel * COMPUTE_BYTES
            peak = max(peak, t.numel * COMPUTE_BYTES)
        if not t.name.endswith(FP8_SCALES):
            params += t.numel
    return StoredBlock(nbytes=sum(t.nbytes for t in tensors), decoded=decoded, dequant_peak_bytes=peak), params


def from_file(spec: ModelSpec, path: str | Path) -> ModelSpec:
    """`spec` with its weights as the file at `path` stores them, every block's bytes from the header; a file whose
    blocks do not hold the model's parameters, or that holds a type chunkflow does not run, is one line."""
    from chunkflow_planner.catalog import StoredWeights

    path = Path(path).expanduser()
    tensors, size, container = read_tensors(path)
    _check_types(path, tensors, container)
    per_block: list[list[Tensor]] = [[] for _ in range(spec.n_blocks)]
    for t in tensors:
        b = block_of(spec, t.name)
        if b is not None:
            per_block[b].append(t)
    missing = [i for i, ts in enumerate(per_block) if not ts]
    if missing:
        raise FormatError(f"{str(path)!r} holds no tensors of {len(missing)} of {spec.name}'s {spec.n_blocks} blocks "
                          f"(first: block {missing[0]}): the file is another model's, or not a whole transformer")
    blocks = [_stored_block(ts, container) for ts in per_block]
    for i, (g, (_, params)) in enumerate(zip(spec.block_sequence(), blocks)):
        if params != spec.block_params(g):
            raise FormatError(f"{str(path)!r}: block {i} ({g.diffusers_list}) holds {params:,} parameters, "
                              f"{spec.name}'s {spec.block_params(g):,}: the file is another model's (or another "
                              "size's); give the file of this model")
    types = _weight_types(per_block, container)
    quantized = {f: n for f, n in types.items() if f in GGUF_FORMATS or f == FP8}
    if not quantized:
        raise FormatError(f"{str(path)!r} holds no quantized block weights (its blocks are "
                          f"{', '.join(types) or 'empty'}): plan the diffusers folder (bf16) instead")
    main = max(quantized, key=quantized.get)
    stored = StoredWeights(format=GGUF_FORMATS.get(main, "fp8-scaled"), source=f"header of {str(path)!r}",
                           nbytes=sum(t.nbytes for t in tensors), file_bytes=size,
                           bf16_block_bytes=spec.block_bytes_total, types=types)
    return spec.model_copy(update={"blocks": _groups(spec, [b for b, _ in blocks]), "stored": stored})


def _weight_types(per_block: list[list[Tensor]], container: str) -> dict[str, int]:
    """Block parameters by the type they are stored in (scales left out)."""
    out: dict[str, int] = {}
    for ts in per_block:
        for t in ts:
            if not t.name.endswith(FP8_SCALES):
                out[t.type] = out.get(t.type, 0) + t.numel
    return out


def _groups(spec: ModelSpec, stored: list[StoredBlock]) -> list[BlockGroup]:
    """The model's block groups, each split where consecutive blocks are stored differently (a Q4_K_M file's mixed
    types), each part with its blocks' StoredBlock."""
    out: list[BlockGroup] = []
    start = 0
    for g in spec.blocks:
        run = 0
        for k in range(1, g.count + 1):
            if k == g.count or stored[start + k] != stored[start + run]:
                out.append(g.model_copy(update={"count": k - run, "first": g.first + run,
                                                "stored": stored[start + run]}))
                run = k
        start += g.count
    return out
