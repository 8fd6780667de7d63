"""The decode of a stored format measured on the run's device (the run report's decode, measured against planned):
the block with the most decoded bytes has each of its quantized weights decoded by its format codec (the very call
its layer runs), a few times, timed; the rate it reaches prices every block's decodes of one forward. Every layer of
such a model dequantizes once a forward (in its forward, or ahead of it for a streamed block: the same work), so a
forward's decode is every block's decoded bytes at that rate.

Measured outside the generation (its weights copied to the device once, apart from the timing), so it adds a
fraction of a second after the run and does not touch the outputs.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from torch import nn

from chunkflow.runtime.codecs.ahead import Planned, plan_block
from chunkflow.runtime.layout import BlockLayout, owned_tensors, pack_block
from chunkflow.runtime.streamer import current

__all__ = ["DecodeProbe", "measure_decode", "module_layouts"]


class DecodeProbe(NamedTuple):
    """A forward's decode: its decoded bytes, the seconds the probe measured for them and the rate (GB/s decoded)."""

    decoded_bytes_per_forward: int
    seconds_per_forward: float
    gbps: float
    tensors_timed: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _jobs(planned: list[Planned], device: torch.device) -> list:
    """Each planned decode's (codec, source, reads, out, decoding) with its stored bytes copied to `device`."""
    jobs = []
    for p in planned:
        stored = current(p.entry).detach().to(device, copy=True)
        reads = [current(r).detach().to(device, copy=True) for r in p.decoding.reads]
        out = torch.empty(p.decoding.shape, dtype=p.decoding.dtype, device=device)
        jobs.append((p.codec, p.codec.source(stored, p.decoding), reads, out, p.decoding))
    return jobs


def module_layouts(module: nn.Module, blocks: list[nn.Module]) -> list[BlockLayout]:
    """The layouts of a module's `blocks` as if offloaded with everything resident: where a module runs
    unoffloaded, what the probe reads its weights by (nothing moves)."""
    return [pack_block(i, str(i), b, entries, None) for i, (b, entries) in
            enumerate(zip(blocks, owned_tensors(module, blocks)))]


def measure_decode(layouts: list[BlockLayout], device: torch.device, repeat: int = 5) -> DecodeProbe | None:
    """A forward's decode measured on `device` (module docstring); None where no block holds a stored format's
    weights."""
    plans = {b.index: plan_block(b) for b in layouts}
    plans = {l: p for l, p in plans.items() if p}
    if not plans:
        return None
    total = sum(x.decoding.nbytes for p in plans.values() for x in p)
    biggest = max(plans.values(), key=lambda p: sum(x.decoding.nbytes for x in p))
    jobs = _jobs(biggest, device)
    times = []
    with torch.no_grad():
        for i in range(repeat + 1):  # the first one warms the kernels up, untimed
            _sync(device)
            t0 = time.perf_counter()
            for codec, source, reads, out, d in jobs:
                codec.decode(source, reads, out, d)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    block_bytes = sum(x.decoding.nbytes for x in biggest)
    gbps = block_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return DecodeProbe(total, total / (gbps * 1e9), gbps, len(jobs))
