"""A module's values from its checkpoint: the TensorSource `chunkflow.offload(source=...)` fills a meta-device module
from, with every check run when it is made, before any tensor is written.

The module is built from its config on the meta device in its final dtypes (models/build.py, models/components.py);
the source matches the checkpoint's tensors to it by name (after the renames the model's library applies to older
checkpoints), and refuses, naming the tensors: a tensor the module has and the checkpoint lacks, one the
checkpoint has and the module does not (another architecture or config), another shape, an integer tensor for a
floating one. A tensor the module holds under several names (tied weights, such as UMT5's `shared` and
`encoder.embed_tokens`) is read once, whichever of its names the checkpoint saved; the module ties weights the
class declares tied where the checkpoint saved one of the pair, or both with the same bytes, as the libraries'
`from_pretrained` does. Floating tensors are cast on the way in (FileReader).
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from chunkflow.loading.reader import FileReader
from chunkflow.runtime.digest import ALGORITHM, DIGEST_THREADS, PIECE
from chunkflow_planner.checkpoint import Checkpoint, CheckpointError, TensorRecord, few_names, shown

__all__ = ["CheckpointSource", "tie_as_saved", "key_renamer"]


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "complex" if dtype.is_complex else "floating" if dtype.is_floating_point else "integer"


def _groups(module: nn.Module) -> list[tuple[list[str], torch.Tensor, bool]]:
    """Each distinct parameter and persistent buffer once: (every name it has, the tensor, is_param)."""
    found: dict[int, tuple[list[str], torch.Tensor, bool]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        found.setdefault(id(p), ([], p, True))[0].append(name)
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers(remove_duplicate=False):
        if name in persistent:
            found.setdefault(id(b), ([], b, False))[0].append(name)
    return list(found.values())


def _nonpersistent_buffers(module: nn.Module) -> set[str]:
    persistent = set(module.state_dict(keep_vars=True))
    return {n for n, _ in module.named_buffers(remove_duplicate=False) if n not in persistent}


def key_renamer(module: nn.Module) -> Callable[[str], str]:
    """The renames the module's library applies to older checkpoints' tensor names (transformers' conversion
    mapping: CLIP's dropped `text_model.` prefix, Qwen2.5-VL's `model.language_model.`; or a class's
    `_checkpoint_conversion_mapping`). A conversion that merges or splits tensors is refused: chunkflow reads each
    tensor as saved."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return lambda key: key
    if not isinstance(module, PreTrainedModel):  # diffusers' models: their checkpoints' names as saved
        return lambda key: key
    legacy = getattr(type(module), "_checkpoint_conversion_mapping", None) or {}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(module)
    except Exception:  # another transformers (or none, or not a transformers model): the class's own mapping only
        transforms = None
    if transforms is None:
        patterns = [(re.compile(k), v) for k, v in legacy.items()]

        def rename_legacy(key: str) -> str:
            for pattern, repl in patterns:
                key, n = pattern.subn(repl, key)
                if n:
                    break
            return key

        return rename_legacy
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(module, "base_model_prefix", None)
    meta = dict.fromkeys(module.state_dict(keep_vars=True))

    def rename(key: str) -> str:
        new, converted = rename_source_key(key, renamings, converters, prefix, meta)
        if converted is not None:
            raise CheckpointError(
                f"tensor {shown(key)} is saved in a layout that transformers converts when loading "
                f"({shown(converted)}); "
                "chunkflow reads each tensor as saved. Re-save the component once with this transformers: "
                "`m = <Class>.from_pretrained(dir); m.save_pretrained(dir)`")
        return new

    return rename


def _tied_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """(target, source) parameter names the class declares tied (transformers' `_tied_weights_keys`), plain names
    only, for the module and its sub-models."""
    out = []
    for prefix, m in module.named_modules():
        keys = getattr(type(m), "_tied_weights_keys", None)
        if isinstance(keys, dict):
            pre = f"{prefix}." if prefix else ""
            out += [(pre + t, pre + s) for t, s in keys.items() if re.fullmatch(r"[\w.]+", t + s)]
    return out


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    parent, _, attr = name.rpartition(".")
    try:
        m = module.get_submodule(parent) if parent else module
    except AttributeError:
        return None
    return (m, attr) if attr in m._parameters else None


def tie_as_saved(module: nn.Module, saved: dict[str, TensorRecord], reader: FileReader) -> None:
    """Tie the pairs the class declares tied that the module holds apart, where the checkpoint (`saved`: renamed
    name -> record) saved one of the two, or both with the same bytes: what `from_pretrained` ties."""
    for target, source in _tied_pairs(module):
        t, s = _owner(module, target), _owner(module, source)
        if t is None or s is None or t[0]._parameters[t[1]] is s[0]._parameters[s[1]]:
            continue
        have_t, have_s = target in saved, source in saved
        if have_t and have_s and not reader.same_bytes(saved[target], saved[source]):
            continue  # saved apart with their own values: they stay apart
        if not (have_t or have_s):
            continue  # neither saved: the missing-tensor check names them
        keep, drop = (s, t) if have_s else (t, s)
        drop[0]._parameters[drop[1]] = keep[0]._parameters[keep[1]]


class CheckpointSource:
    """Values for `module`'s tensors from `ckpt`, read by `reader` (module docstring). `what` names the component in
    errors ("text_encoder in '/models/wan'"). The module is on the meta device, in its final dtypes."""

    def __init__(self, ckpt: Checkpoint, module: nn.Module, reader: FileReader, what: str,
                 rename: Callable[[str], str] | None = None):
        self.reader = reader
        self.what = what
        self.variant = ckpt.variant  # the variant files read (None: the default ones)
        rename = rename or key_renamer(module)
        saved: dict[str, TensorRecord] = {}
        for key, rec in ckpt.tensors.items():
            saved.setdefault(rename(key), rec)
        tie_as_saved(module, saved, reader)
        self.where: dict[str, TensorRecord] = {}
        missing, used = [], set()
        for names, t, is_param in _groups(module):
            present = [n for n in names if n in saved]
            used.update(present)
            if not present:
                if is_param:
                    missing.append(names[0])
                continue  # a persistent buffer the checkpoint lacks keeps the value the class computed
            rec = saved[present[0]]
            for other in present[1:]:
                if not reader.same_bytes(rec, saved[other]):
                    raise CheckpointError(
                        f"{what}: {' and '.join(repr(n) for n in present)} are one tensor in the "
                        f"{type(module).__name__} (tied) but the checkpoint holds different values for them; it is "
                        "for another model or config")
            self._check(names[0], rec, t, is_param)
            for n in names:
                self.where[n] = rec
        if missing:
            raise CheckpointError(f"{what} lacks tensor(s) {few_names(missing)}; the checkpoint is incomplete or for "
                                  "another model: download or save it again")
        ignore = [p for m in module.modules() for p in (getattr(type(m), "_keys_to_ignore_on_load_unexpected", None)
                                                        or [])]
        computed = _nonpersistent_buffers(module)
        unexpected = sorted(k for k in saved if k not in used and k not in computed
                            and not any(re.search(p, k) for p in ignore))
        if unexpected:
            raise CheckpointError(
                f"{what} holds tensor(s) the {type(module).__name__} does not have: {few_names(unexpected)}; the "
                "checkpoint is for another model or config: point --weights at the matching pipeline folder")

    def _check(self, name: str, rec: TensorRecord, t: torch.Tensor, is_param: bool) -> None:
        if tuple(rec.shape) != tuple(t.shape):
            raise CheckpointError(f"{self.what}: tensor {name!r} in {rec.file.name} has shape {list(rec.shape)}, the "
                                  f"model its config.json makes expects {list(t.shape)}; the checkpoint and its "
                                  "config.json do not match: download or save the folder again")
        want = _kind(t.dtype)
        if rec.kind != want:
            raise CheckpointError(
                f"{self.what}: tensor {name!r} in {rec.file.name} is {rec.dtype_name} ({rec.kind}), the model's "
                f"{'parameter' if is_param else 'buffer'} is {str(t.dtype).removeprefix('torch.')} ({want}); chunkflow "
                "casts only between floating dtypes: the checkpoint does not match this model (quantized or "
                "converted?): use an unquantized diffusers checkpoint")

    @property
    def nbytes(self) -> int:
        """Bytes the source reads: each distinct record once."""
        return sum(r.nbytes for r in {id(r): r for r in self.where.values()}.values())

    def provides(self, name: str) -> bool:
        return name in self.where

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        self.reader.read_tensor(self.where[name], out)

    def digests(self, names: list[str]) -> dict[str, str]:
        """A digest of every byte of each named tensor as saved, with its dtype code (runtime/digest.py: what the
        ranks sharing a host copy compare), for those read from the files; the tensors hashed on threads. Read by a
        reader of this call's own (the load's counts stay the load's) that leaves what it reads in the page cache:
        the ranks of a host (the only ones that digest) then read the files from the disk once between them, as the
        pipeline's loader does under torchrun, and the load that follows reads them from the cache."""
        recs = {n: self.where[n] for n in names if n in self.where}
        distinct = list({id(r): r for r in recs.values()}.values())
        with FileReader(threads=1, keep_cache=True) as reader:
            for path in {r.file for r in distinct}:
                reader.file(path)  # opened here, not by two threads at once

            def one(rec: TensorRecord) -> str:
                h = hashlib.new(ALGORITHM, rec.dtype.encode() + b"\0")
                buf = torch.empty(max(1, min(PIECE, rec.nbytes)), dtype=torch.uint8)
                for a in range(0, rec.nbytes, buf.numel()):
                    n = min(buf.numel(), rec.nbytes - a)
                    reader.read_into(rec.file, rec.begin + a, n, buf[:n])
                    h.update(buf[:n].numpy())
                return h.hexdigest()

            with ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="chunkflow-digest") as pool:
                done = dict(zip((id(r) for r in distinct), pool.map(one, distinct)))
        return {n: done[id(r)] for n, r in recs.items()}

    def disk_files(self) -> "CheckpointFiles":
        """What the runtime's disk tier reads each forward (runtime/disk.py): these records, through a reader of its
        own that leaves nothing it reads in the page cache."""
        return CheckpointFiles(dict(self.where))


class CheckpointFiles:
    """The disk tier's view of a checkpoint (runtime/disk.DiskFiles): each tensor's record by its name in the module,
    and raw byte ranges read with the loader's parallel preadv, their pages dropped after each read."""

    def __init__(self, where: dict[str, TensorRecord]):
        self.where = where
        self.reader = FileReader(drop_all=True)

    def record(self, name: str) -> TensorRecord | None:
        return self.where.get(name)

    def read_range(self, path, begin: int, nbytes: int, out: torch.Tensor) -> None:
        self.reader.read_into(path, begin, nbytes, out)

    def read_tensor(self, rec: TensorRecord, out: torch.Tensor) -> None:
        """A (small) tensor in another dtype than the file's: its bytes read as they are, then cast (no staging
        buffers kept for the reader's threads)."""
        raw = torch.empty(rec.nbytes, dtype=torch.uint8)
        self.reader.read_into(rec.file, rec.begin, rec.nbytes, raw)
        out.copy_(raw.view(getattr(torch, rec.dtype_name)).view(out.shape))

    def close(self) -> None:
        self.reader.close()
