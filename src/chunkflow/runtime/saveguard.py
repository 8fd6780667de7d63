"""Saving an offloaded model into the folder its weights are read from (issue 51): `pipe.save_pretrained(its own
folder)` or `transformer.save_pretrained(its folder)` while a disk tier, the codec's disk storage or disk parking
reads the checkpoint's files. diffusers writes the weight files in place (safetensors truncates and rewrites them), so
the files the model reads would be replaced under it: every later forward and `state_dict()` a DiskTierError.

While the handle lives, the module's `save_pretrained` is wrapped (an instance attribute, so the pipeline's save
finds it too; taken off at remove()). A save into another folder goes straight through. A save into a folder holding
files the model reads is made first into a temporary folder inside it (same file system), then compared:
- every file the model reads is written again with exactly the bytes it has now (the usual case: nothing changed
  since load): those files are left as they are (never rewritten), the other files the save made (config.json, ...)
  replace theirs atomically (os.replace). The folder then holds what the save writes and the model keeps running on
  the same, untouched files.
- a file the model reads would change or go (the model's weights changed since load: a LoRA fused, a different
  dtype, variant or shard size): refused with a DiskTierError before anything in the folder changes; the temporary
  folder is removed. Save elsewhere, or `handle.remove()` first (the weights then live in memory) and save.
Cost: the save is written once to the temporary folder and the files the model reads are read once to compare.

Not covered: a write to those files by other means (safetensors' `save_file` on the same path, another program):
the disk tier's checks then stop the model at its next use with a DiskTierError (runtime/tiers/disk.py).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from chunkflow.runtime.feature import HandleFeature

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.handle import OffloadHandle


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _same_bytes(a: Path, b: Path, piece: int = 16 << 20) -> bool:
    """The two files hold the same bytes; read in pieces, their pages dropped from the page cache after (the files a
    disk tier reads are not kept in host memory by a save)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        try:
            while True:
                x, y = fa.read(piece), fb.read(piece)
                if x != y:
                    return False
                if not x:
                    return True
        finally:
            if hasattr(os, "posix_fadvise"):
                for f in (fa, fb):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _in_folder(path: Path, folder: Path) -> bool:
    """`path` lies in `folder` as named, or the file it links to does (a hub cache's snapshot links to its blobs)."""
    return _same_file(path.parent, folder) or _same_file(Path(os.path.realpath(path)).parent, folder)


class SaveGuard(HandleFeature):
    """The wrapped `save_pretrained` of one handle's module (module docstring). `sources`: the tiers and the park
    home, each telling the files it reads (`files_read`)."""

    def __init__(self, sources):
        self.sources = list(sources)
        self.module = None
        self.wrapper = None

    def files_read(self) -> set[Path]:
        return {Path(p) for s in self.sources for p in s.files_read()}

    def attach(self, handle: OffloadHandle) -> None:
        module = handle.module
        if self.wrapper is not None or not self.files_read():
            return
        original = getattr(module, "save_pretrained", None)
        if not callable(original) or "save_pretrained" in module.__dict__:
            return

        @functools.wraps(original)
        def save_pretrained(save_directory, *args, **kwargs):
            return self.save(original, save_directory, args, kwargs)

        module.__dict__["save_pretrained"] = self.wrapper = save_pretrained
        self.module = module

    def close(self, handle: OffloadHandle, restore: bool) -> None:
        if self.wrapper is not None and self.module.__dict__.get("save_pretrained") is self.wrapper:
            del self.module.__dict__["save_pretrained"]
        self.module = self.wrapper = None

    def save(self, original, save_directory, args, kwargs):
        folder = Path(save_directory)
        read = [p for p in self.files_read() if folder.is_dir() and _in_folder(p, folder)]
        if not read:
            return original(save_directory, *args, **kwargs)
        from chunkflow.runtime.tiers.disk import DiskTierError

        name = type(self.module).__name__
        if kwargs.get("push_to_hub"):
            raise DiskTierError(f"cannot save {name} into {str(folder)!r} with push_to_hub: it reads its weights "
                                "from that folder while offloaded; nothing was written. Save into another folder")
        tmp = Path(tempfile.mkdtemp(prefix=".chunkflow-save-", dir=folder))
        try:
            out = original(str(tmp), *args, **kwargs)
            made = {f.relative_to(tmp): f for f in sorted(tmp.rglob("*")) if f.is_file()}
            for p in read:
                rel = next((r for r in made if _same_file(folder / r, p)), None)
                if rel is None or not _same_bytes(made[rel], p):
                    what = "would no longer be written" if rel is None else "would be written with other bytes"
                    raise DiskTierError(
                        f"cannot save {name} into {str(folder)!r}: {p.name}, which it reads its weights from while "
                        f"offloaded, {what} (its weights, dtype, variant or shard size differ from the file's); "
                        "nothing in the folder was changed. Save into another folder, or handle.remove() first "
                        "(the weights then live in memory) and save")
            kept = {r for r in made if any(_same_file(folder / r, p) for p in read)}  # the same bytes: not rewritten
            for rel, f in made.items():
                if rel in kept:
                    continue
                dest = folder / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not (dest.is_file() and _same_bytes(f, dest)):
                    os.replace(f, dest)
            return out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
