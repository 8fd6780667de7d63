"""A module's weights as a short fingerprint, so that ranks sharing one host copy (runtime/hostshare.py) share it only
where they hold the same values, not merely the same layout (another checkpoint, seed or fine-tune at the same
offload call is refused, never streamed from another rank's weights).

Each tensor contributes its name and its bytes at evenly spread positions (at least SAMPLES_MIN, one more every
SAMPLE_EVERY bytes), read where its values are: the checkpoint's file for a tensor a loader reads from one (a map of
the file: only the sampled pages are touched), the tensor itself where the module holds its values (on any device),
and the loader's own `fingerprint(name)` otherwise (random weights: their seed). A value changed between two
sampled positions is not seen (a documented limit; a merged LoRA or another checkpoint changes whole tensors).
A loader that can say none of these gives None: the caller then keeps one copy per rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from chunkflow.runtime.tensors import all_tensors

SAMPLES_MIN = 16
SAMPLE_EVERY = 1 << 20


def positions(nbytes: int) -> np.ndarray:
    """The sampled byte positions of an `nbytes`-byte tensor."""
    k = min(nbytes, SAMPLES_MIN + nbytes // SAMPLE_EVERY)
    return np.linspace(0, nbytes - 1, k).astype(np.int64) if k > 0 else np.zeros(0, dtype=np.int64)


def tensor_sample(t: torch.Tensor) -> bytes:
    """A tensor's bytes at `positions` (on its device; copied to the host)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    idx = torch.from_numpy(positions(flat.numel())).to(flat.device)
    return flat[idx].cpu().numpy().tobytes()


def module_fingerprint(module: torch.nn.Module, source=None) -> str | None:
    """The fingerprint of `module`'s values (the loader's `source` for those it provides), or None where a loader
    provides values it cannot say anything of."""
    h = hashlib.sha1()
    files = source.disk_files() if source is not None and hasattr(source, "disk_files") else None
    maps: dict[Path, np.ndarray] = {}
    try:
        for t in sorted(all_tensors(module), key=lambda t: t.name):
            cur = t.get()
            h.update(t.name.encode() + b"\0" + str(cur.dtype).encode() + str(tuple(cur.shape)).encode())
            from_source = source is not None and (cur.device.type == "meta" or source.provides(t.name))
            if not from_source:
                h.update(tensor_sample(cur))
                continue
            rec = files.record(t.name) if files is not None else None
            if rec is not None:
                mm = maps.get(rec.file)
                if mm is None:
                    mm = maps[rec.file] = np.memmap(rec.file, dtype=np.uint8, mode="r")
                h.update(rec.dtype_name.encode() + mm[rec.begin + positions(rec.nbytes)].tobytes())
                continue
            said = getattr(source, "fingerprint", None)
            if said is None:
                return None
            h.update(str(said(t.name)).encode())
    finally:
        if files is not None:
            files.close()
    return h.hexdigest()


def tensors_fingerprint(tensors) -> str:
    """The fingerprint of tensors holding their values (ModuleTensors: a parked module's, at its first park)."""
    h = hashlib.sha1()
    for t in tensors:
        cur = t.get()
        h.update(t.name.encode() + b"\0" + str(cur.dtype).encode() + str(tuple(cur.shape)).encode())
        h.update(tensor_sample(cur))
    return h.hexdigest()
