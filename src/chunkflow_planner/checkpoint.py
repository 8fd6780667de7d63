"""A component's safetensors checkpoint in a folder, read without torch: which files hold its weights (the rules of
diffusers' and transformers' `from_pretrained`: an index, variants, shards) and every tensor's dtype, shape and byte
range, from the files' headers. The planner prices a load by it; the runtime's loader reads by it.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape,
[begin, end) of its bytes after the header) and the tensors' bytes. Nothing here maps or reads those bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkflow_planner.errors import ChunkflowError

__all__ = ["CheckpointError", "TensorRecord", "Checkpoint", "open_checkpoint", "read_header", "DTYPE_BYTES",
           "DIFFUSERS_STEM", "TRANSFORMERS_STEM", "PICKLE_SUFFIXES", "read_config", "read_json", "shown",
           "MAX_JSON_BYTES", "plain_name", "is_dir"]

DIFFUSERS_STEM = "diffusion_pytorch_model"  # diffusers' SAFETENSORS_WEIGHTS_NAME, less ".safetensors"
TRANSFORMERS_STEM = "model"  # transformers' SAFE_WEIGHTS_NAME, less ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_ST = ".safetensors"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header
# a folder's JSON files (model_index.json, config.json, scheduler_config.json, a shard index): the largest real ones
# are an index of a few MB (a model of tens of thousands of tensors); anything over this is not such a file
MAX_JSON_BYTES = 32 * 2**20
NAME_MAX = 255  # bytes of a file name (Linux, macOS, Windows)

# safetensors dtype code -> (torch dtype name, bytes per element)
DTYPE_BYTES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2),
    "U8": ("uint8", 1), "BOOL": ("bool", 1), "C64": ("complex64", 8),
}


class CheckpointError(ChunkflowError):
    """A checkpoint folder that cannot be loaded as it is; the message says which file and what to do."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a checkpoint: the file holding it, its safetensors dtype code and shape, and where its bytes
    are in the file (absolute offsets)."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.begin + self.nbytes

    @property
    def dtype_name(self) -> str:
        """The torch dtype's name ("bfloat16")."""
        return DTYPE_BYTES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype][1]

    @property
    def kind(self) -> str:
        """'floating', 'integer', 'bool' or 'complex'."""
        if self.dtype == "BOOL":
            return "bool"
        if self.dtype.startswith(("I", "U")):
            return "integer"
        return "complex" if self.dtype.startswith("C") else "floating"


def _damaged(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{str(path)!r} is not a readable safetensors file ({why}); it may be truncated or still "
                           "downloading: download or save it again")


def _advise(fd: int, advice: str, length: int = 0) -> None:
    """posix_fadvise where the system has it (Linux): page-cache advice for the file, best effort."""
    if hasattr(os, "posix_fadvise") and hasattr(os, advice):
        try:
            os.posix_fadvise(fd, 0, length, getattr(os, advice))
        except OSError:
            pass


def _refused(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{str(path)!r} has a safetensors header that does not describe its bytes ({why}); "
                           "safetensors itself refuses such a file: it is damaged or crafted, download or save it "
                           "again")


def _read_head(path: Path) -> tuple[bytes, int]:
    """The raw JSON header of a safetensors file and the file's size; the file checked to be a regular one before
    it is opened (a FIFO would block the open, a device read for ever)."""
    from chunkflow_planner.files import irregular_kind

    try:
        kind = irregular_kind(os.stat(path).st_mode)
        if kind is not None:
            raise CheckpointError(f"{str(path)!r} is {kind}, not a safetensors file; download or save the model again")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            kind, size = irregular_kind(st.st_mode), st.st_size
            if kind is not None:
                raise CheckpointError(f"{str(path)!r} is {kind}, not a safetensors file; download or save the model "
                                      "again")
            _advise(fd, "POSIX_FADV_RANDOM")  # no read-ahead: the header alone comes into the page cache
            # (the loader drops it with the rest it read: FileReader.watch notes the cache's state before)
            head = f.read(8)
            if len(head) < 8:
                raise _damaged(path, f"{size} bytes, shorter than a header")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or 8 + n > size:
                raise _damaged(path, f"a header of {n} bytes in a file of {size}")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{str(path)!r} cannot be read: {exc.strerror or exc}") from None
    if len(raw) < n:
        raise _damaged(path, f"{8 + len(raw)} bytes read of a header of {n}")
    return raw, size


def _no_duplicates(path: Path):
    """A json object hook that refuses a name given twice (json.loads would keep the last one silently)."""

    def pairs(items: list) -> dict:
        out = dict(items)
        if len(out) != len(items):
            seen: set = set()
            twice = next(k for k, _ in items if k in seen or seen.add(k))
            raise _refused(path, f"the name {shown(twice)} is given twice")
        return out

    return pairs


def _record(path: Path, key: str, entry: object, base: int) -> TensorRecord:
    """One header entry as a record: a known dtype, a shape of non-negative integers, offsets that fit it."""
    try:
        dtype, shape, (a, b) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]  # type: ignore[index]
        ints = all(type(v) is int for v in (*shape, a, b))  # bool is an int to Python, not to safetensors
        ok = ints and dtype in DTYPE_BYTES and all(d >= 0 for d in shape) and 0 <= a <= b
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise _damaged(path, f"tensor {shown(key)} has a malformed header entry")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype][1]
    if b - a != nbytes:
        raise _refused(path, f"tensor {shown(key)} is {dtype} {shown(list(shape))}, {nbytes:,} bytes, but its "
                             f"offsets [{a}, {b}) hold {b - a:,}")
    return TensorRecord(key, path, dtype, shape, base + a, b - a)


def _check_coverage(path: Path, records: list[TensorRecord], base: int, size: int) -> None:
    """The tensors' bytes follow one another from the header's end to the file's end: no overlap (two tensors
    sharing bytes), no gap and nothing after the last, as safetensors requires (a file of hidden bytes is refused)."""
    at = base
    for rec in sorted(records, key=lambda r: (r.begin, r.end)):
        if rec.begin != at:
            why = ("overlaps the tensor before it" if rec.begin < at
                   else f"leaves {rec.begin - at:,} bytes unused before it")
            raise _refused(path, f"tensor {shown(rec.key)} at [{rec.begin - base}, {rec.end - base}) {why}")
        at = rec.end
    if at > size:
        raise _damaged(path, f"its tensors end at byte {at:,} of a file of {size:,}")
    if at < size:
        raise _refused(path, f"{size - at:,} bytes after the last tensor belong to none")


def read_header(path: str | Path) -> dict[str, TensorRecord]:
    """The tensors of one safetensors file, from its header alone, checked as safetensors checks them: a regular
    file, a JSON object of distinct names, each a known dtype and shape whose bytes fit its offsets, the tensors
    covering the data exactly (no overlap, no gap, nothing after the last)."""
    path = Path(path)
    raw, size = _read_head(path)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except CheckpointError:  # a name given twice (a ValueError too)
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise _damaged(path, f"its header is not JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise _damaged(path, "its header is nested too deeply to be one") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _damaged(path, "its __metadata__ is not an object of strings")
    base = 8 + len(raw)
    records = [_record(path, key, entry, base) for key, entry in header.items() if key != "__metadata__"]
    _check_coverage(path, records, base, size)
    return {r.key: r for r in records}


# ----------------------------------------------------------------------------------------- file names


def shown(value: object, limit: int = 80) -> str:
    """A value from a file as an error shows it: its repr (a string quoted and escaped), cut to `limit` characters
    with its length said, so a name of a megabyte (or holding control characters) is one short, printable line."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def few_names(items, limit: int = 5) -> str:
    """Up to `limit` names, each cut short (`shown` past 120 characters), then how many more."""
    items = [str(i) for i in items]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(i if len(i) <= 120 and i.isprintable() else shown(i, 120) for i in items[:limit]) + more


def _add_variant(name: str, variant: str | None) -> str:
    """The libraries' rule: the variant goes before the last suffix (`a.safetensors` -> `a.fp16.safetensors`,
    `a.safetensors.index.json` -> `a.safetensors.index.fp16.json`)."""
    if variant is None:
        return name
    head, _, tail = name.rpartition(".")
    return f"{head}.{variant}.{tail}"


def _unshard(name: str) -> tuple[str, bool]:
    """A `*.safetensors` file name's stem without its shard number, and whether it had one."""
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


def _choose(path: Path, stem: str, files: list[str], indexes: list[str],
            variant: str | None) -> tuple[str | None, str | None]:
    """(index file, None) or (None, single weights file) for `variant`:

    1. an index for the variant (`STEM.safetensors.index[.VARIANT].json`, or the legacy
       `STEM.safetensors.VARIANT.index.json`; failing those, the folder's one `*.safetensors.index[.VARIANT].json`):
       its `weight_map` alone says which shard holds each tensor;
    2. else the single file `STEM[.VARIANT].safetensors`;
    3. else the folder's one `*.safetensors` file that is not a shard and not a variant of another name (with a
       variant: the one `*.VARIANT.safetensors`).
    Variant files are ignored unless `variant` asks for one."""
    std_index = _add_variant(stem + _ST + ".index.json", variant)
    candidates = [std_index] + ([f"{stem}{_ST}.{variant}.index.json"] if variant else [])
    for c in candidates:
        if c in indexes:
            return c, None
    std_file = _add_variant(stem + _ST, variant)
    if std_file in files:
        return None, std_file
    suffixes = [f"{_ST}.index.{variant}.json", f"{_ST}.{variant}.index.json"] if variant else [f"{_ST}.index.json"]
    other_index = [i for i in indexes if i.endswith(tuple(suffixes))]
    if len(other_index) == 1:
        return other_index[0], None

    stems = {_unshard(f)[0] for f in files} | {i.split(_ST)[0] for i in indexes if _index_variant(i) is None}
    parsed = {f: _parse_weights_name(f) for f in files}

    def is_variant(f: str) -> bool:  # of another name: the library's name, or a base whose own file is here
        base, v, _ = parsed[f]
        return v is not None and (base == stem or base in stems)

    present = sorted({parsed[f][1] for f in files if is_variant(f)}
                     | {v for v in map(_index_variant, indexes) if v is not None})
    pool = [f for f in files if not is_variant(f)] if variant is None else [f for f in files if parsed[f][1] == variant]
    singles = [f for f in pool if not parsed[f][2]]
    shards = [f for f in pool if parsed[f][2]]
    if len(singles) == 1 and not shards and not other_index:
        return None, singles[0]

    where = f"{str(path)!r} (found: {few_names(files + indexes, 12) or 'nothing'})"
    what = f"the {variant!r} variant" if variant else "the default (non-variant) weights"
    if len(other_index) > 1:
        raise CheckpointError(f"several index files ({few_names(other_index)}) could hold {what} in {where}; keep only "
                              "the right one")
    if shards:
        raise CheckpointError(f"{what} in {str(path)!r} are sharded ({few_names(shards, 3)}) but their index "
                              f"({std_index}) is missing; download it again, or re-save with save_pretrained")
    if len(singles) > 1:
        raise CheckpointError(f"several files ({few_names(singles)}) could hold {what} in {where}; chunkflow reads one "
                              f"file or the shards an index names: keep one, or name it {std_file}")
    if variant is not None:
        others = (f"variants present: {', '.join(repr(v) for v in present)}" if present
                  else "it has no variants: leave variant unset for the default weights")
        raise CheckpointError(f"there is no {variant!r} variant in {where}: no {std_index} and no {std_file}; "
                              f"{others}")
    if present:
        raise CheckpointError(f"{where} has no {std_index} or {std_file}, only variant files; ask for one with "
                              f"variant= (--variant) one of {', '.join(repr(v) for v in present)}")
    raise CheckpointError(f"{where} has no {std_index} or {std_file}; give a diffusers-format model directory")


def is_dir(path: Path) -> bool:
    """Whether `path` is a directory; a path the system cannot look up (a name over 255 bytes, a loop of links) is
    a CheckpointError saying so, not an OSError."""
    try:
        return path.is_dir()
    except OSError as exc:
        raise CheckpointError(f"{shown(str(path))} cannot be looked up: {exc.strerror or exc}; give a "
                              "diffusers-format model directory") from None


def plain_name(name: str) -> bool:
    """A file name of the folder itself: no separator, no NUL, not '.' or '..', at most NAME_MAX bytes."""
    try:
        fits = len(name.encode("utf-8")) <= NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate: no file has that name
        return False
    return (fits and name not in {"", ".", ".."} and not any(c in name for c in "/\\\0")
            and Path(name).name == name)


def _read_index(path: Path, index: str) -> dict[str, str]:
    """The index's weight_map, checked: well formed, shard names plain file names, every shard present."""
    data = read_json(path / index, f"index {index} in {str(path)!r}")
    wm = data.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"index {index} in {str(path)!r} has no weight_map of tensor name -> shard file; "
                              "download it again or re-save the model with save_pretrained")
    shards = sorted(set(wm.values()))
    bad = [s for s in shards if not plain_name(s)]
    if bad:
        raise CheckpointError(f"index {index} in {str(path)!r} names shard(s) {few_names(bad)} outside the "
                              f"directory or longer than a file name ({NAME_MAX} bytes); shard names must be plain "
                              "file names: the index is damaged or not to be trusted")
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise CheckpointError(f"index {index} in {str(path)!r} names shard file(s) {few_names(missing)} that are not in "
                              "the directory; download the missing shard(s) again")
    return wm


def _incomplete(path: Path) -> list[str]:
    """Names of interrupted Hugging Face downloads behind a folder (`.incomplete` blobs of its cache entry)."""
    real = path.resolve()
    for parent in [real, *real.parents]:
        if parent.name.startswith("models--") and (parent / "blobs").is_dir():
            return sorted(p.name for p in (parent / "blobs").glob("*.incomplete"))
    return []


# ------------------------------------------------------------------------------------------ checkpoint


@dataclass(frozen=True)
class Checkpoint:
    """The weights of one component: the files chosen and every tensor they hold, by name."""

    folder: Path
    files: tuple[str, ...]
    tensors: dict[str, TensorRecord]
    variant: str | None = None  # the variant read (None: the default files)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor, as stored."""
        return sum(t.nbytes for t in self.tensors.values())


def _has_variant(files: list[str], indexes: list[str], variant: str) -> bool:
    return (any(_parse_weights_name(f)[1] == variant for f in files)
            or any(_index_variant(i) == variant for i in indexes))


def open_checkpoint(folder: str | Path, stem: str = DIFFUSERS_STEM, variant: str | None = None,
                    convert_hint: str = "<Class>", fallback: bool = False) -> Checkpoint:
    """The component checkpoint in `folder` (files chosen as the docstring of `_choose` says), its headers read and
    checked. Pickled weights (.bin, .pt, ...) are refused for every component alike: unpickling runs code.
    `convert_hint` names the class in the one-line conversion the message offers. `fallback`: a folder without any
    `variant` file gives its default files (as a diffusers pipeline's `from_pretrained(variant=...)` does for a
    component saved without the variant); `Checkpoint.variant` says which were read."""
    path = Path(folder)
    if not is_dir(path):
        raise CheckpointError(f"weights {str(path)!r} is not a directory; give a diffusers-format model directory")
    if variant is not None and (not isinstance(variant, str) or not variant or any(c in variant for c in "./\\")):
        raise CheckpointError(f"variant {variant!r} is not a variant name; give one like 'fp16', or None")
    try:
        entries = list(path.iterdir())
    except OSError as exc:
        raise CheckpointError(f"{str(path)!r} cannot be listed: {exc.strerror or exc}") from None
    odd = sorted(p.name for p in entries if p.name.endswith(_ST) and p.exists() and not p.is_file() and not p.is_dir())
    if odd:
        raise CheckpointError(f"{str(path)!r}: {few_names(odd)} is not a regular file (a FIFO, a device or a socket); "
                              "a checkpoint's weights are files: download or save the model again")
    files = sorted(p.name for p in entries if p.name.endswith(_ST) and p.is_file())
    indexes = sorted(p.name for p in entries if re.search(re.escape(_ST) + r"\..*json$", p.name) and p.is_file())
    dangling = sorted(p.name for p in entries if p.name.endswith(_ST) and p.is_symlink() and not p.exists())
    if dangling or not (files or indexes):
        partial = _incomplete(path)
        if partial:
            raise CheckpointError(f"{str(path)!r} is an interrupted Hugging Face download ({len(partial)} incomplete "
                                  f"file(s), e.g. {partial[0]}); run the same `hf download` again to finish it")
        if dangling:
            raise CheckpointError(f"{str(path)!r}: {few_names(dangling)} point(s) to files that do not exist (a broken "
                                  "Hugging Face cache?); download the model again")
    if not files and not indexes:
        pickles = sorted(p.name for p in entries if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{str(path)!r} holds only pickle checkpoints ({', '.join(pickles)}); chunkflow loads safetensors only, "
                "since unpickling a file can run code. Convert once, from a source you trust: "
                f"`m = {convert_hint}.from_pretrained(dir); m.save_pretrained(dir, safe_serialization=True)`")
        raise CheckpointError(f"{str(path)!r} has no *.safetensors files")
    if fallback and variant is not None and not _has_variant(files, indexes, variant):
        variant = None
    index, single = _choose(path, stem, files, indexes, variant)
    tensors: dict[str, TensorRecord] = {}
    if index is not None:
        weight_map = _read_index(path, index)
        shards = sorted(set(weight_map.values()))
        headers = {s: read_header(path / s) for s in shards}
        absent = [k for k, s in weight_map.items() if k not in headers[s]]
        if absent:
            raise CheckpointError(
                f"{index} in {str(path)!r} places tensor(s) {few_names(absent)} in shards that do not hold them (e.g. "
                f"{shown(absent[0])} in {shown(weight_map[absent[0]])}); the index does not match its shards: "
                "download or save the checkpoint again")
        tensors = {k: headers[s][k] for k, s in weight_map.items()}
        chosen = tuple(shards)
    else:
        tensors = read_header(path / single)
        chosen = (single,)
    return Checkpoint(path, chosen, tensors, variant)


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON object from a folder's file, read bounded (`files.read_bounded`: a regular file of at most `limit`
    bytes); unreadable, malformed, nested too deeply or not an object is a CheckpointError naming it (`what`)."""
    from chunkflow_planner.files import read_bounded

    raw = read_bounded(path, what, limit, error=CheckpointError, fix="download or save the model again")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise CheckpointError(f"{what} cannot be read as JSON ({why}); download or save the model again") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} must hold a JSON object, not a {type(data).__name__}; download or save the "
                              "model again")
    return data


def read_config(path: Path, what: str, name: str = "config.json") -> dict[str, Any]:
    """A component folder's config file (`name`) as a dict, read bounded (`read_json`); missing or malformed is a
    CheckpointError naming it."""
    cfg_path = path / name
    if not cfg_path.exists():
        raise CheckpointError(f"{what}: {str(path)!r} has no {name}; it is not a saved model folder "
                              "(save_pretrained writes one): download or save the pipeline again")
    return read_json(cfg_path, f"{what}: {name} in {str(path)!r}")


def pipeline_read_bytes(folder: str | Path, spec, variant: str | None = None) -> int:
    """Bytes a load of catalog model `spec`'s pipeline from `folder` reads (every component's tensors as stored, by
    the files its loader chooses), after checking that model_index.json names the model's pipeline class."""
    folder = Path(folder)
    index = read_config(folder, f"pipeline {str(folder)!r}", "model_index.json")
    pipe = spec.pipeline
    if index.get("_class_name") != pipe.cls:
        raise CheckpointError(f"{str(folder)!r} holds a {shown(index.get('_class_name'))}, but {spec.name} runs a "
                              f"{pipe.cls}; point --weights at that model's pipeline folder")
    parts = [("transformer", DIFFUSERS_STEM, spec.diffusers.cls)]
    parts += [(f"transformer_{k + 1}", DIFFUSERS_STEM, spec.diffusers.cls) for k in range(1, pipe.experts)]
    parts += [(te.component, TRANSFORMERS_STEM, te.cls) for te in pipe.text_encoders]
    parts.append((pipe.vae.component, DIFFUSERS_STEM, pipe.vae.cls))
    total = 0
    for name, stem, cls in parts:
        if not (folder / name).is_dir():
            raise CheckpointError(f"{str(folder)!r} has no {name}/ folder; the pipeline folder is incomplete: "
                                  "download or save it again")
        ckpt = open_checkpoint(folder / name, stem, variant, convert_hint=cls, fallback=True)
        total += ckpt.nbytes
    return total
