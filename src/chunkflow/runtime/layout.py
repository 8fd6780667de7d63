"""Per-block byte layout: which tensors a block owns, where they sit in its flat byte range, its chunks,
and the split of that range into a resident head and a streamed tail (paper sections 3.2 and 3.3).

Pure bookkeeping on shapes and dtypes: nothing here allocates or copies, so it runs on meta tensors.

Symbols follow the paper and the issue: V_l is block l's packed byte extent, C the chunk size, r the target
residency, R_l = min(k_l C, V_l) the resident bytes, k_l whole chunks chosen so R_l is nearest to r V_l. The streamed
tail is [R_l, V_l). A tensor straddling R_l starts at R'_l < R_l; the device slot holds [A_l, V_l) with
A_l = floor_256(R'_l), so every tensor keeps its alignment inside the slot. Bytes [R'_l, R_l) are copied
device-to-device from the resident buffer, bytes [R_l, V_l) host-to-device in chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from chunkflow_planner.offload import resident_bytes

if TYPE_CHECKING:  # annotations only
    from chunkflow.runtime.tiers.base import Tier

ALIGN = 256


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int = ALIGN) -> int:
    return n // a * a


@dataclass
class TensorEntry:
    """One tensor a block owns: where it lives in the block's byte range and who holds it."""

    name: str  # dotted name inside the block (first owner)
    owners: list[tuple[nn.Module, str]]  # (module, attribute) pairs holding this very tensor
    is_param: bool
    offset: int  # byte offset inside the block's range, ALIGN-aligned
    nbytes: int
    dtype: torch.dtype  # as stored (host store, resident buffer, slots)
    shape: tuple[int, ...]
    compute_dtype: torch.dtype | None = None  # fp8 storage: the dtype it is cast to on the device for the forward

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def compute_nbytes(self) -> int:
        """Bytes of its compute-dtype copy (0 when it is used as stored)."""
        if self.compute_dtype is None:
            return 0
        return math.prod(self.shape) * self.compute_dtype.itemsize


@dataclass
class BlockLayout:
    """Block l's packed bytes, its residency split and its H2D chunks (block-relative offsets)."""

    index: int
    name: str
    module: nn.Module
    tensors: list[TensorEntry]
    nbytes: int  # V_l: packed extent (tensor bytes plus alignment gaps)
    tensor_bytes: int  # sum of the tensors' own bytes
    host_offset: int = 0  # where [0, V_l) starts in the host store
    resident_bytes: int = 0  # R_l
    straddle_start: int = 0  # R'_l: start of the first tensor not wholly resident (R_l if none straddles)
    slot_start: int = 0  # A_l: byte of the block that sits at slot[0]
    chunks: list[tuple[int, int]] = field(default_factory=list)  # H2D ranges covering [R_l, V_l)
    tier: Tier | None = None  # where [R_l, V_l) lives and how its chunks reach the device (runtime/tiers/)

    @property
    def host_extent(self) -> int:
        """Bytes of the host store this block takes (its tier says: all of it, or only its resident head)."""
        return self.tier.host_extent(self)

    @property
    def streamed_bytes(self) -> int:
        return self.nbytes - self.resident_bytes

    @property
    def d2d_bytes(self) -> int:
        return self.resident_bytes - self.straddle_start

    @property
    def slot_extent(self) -> int:
        """Bytes of a streaming slot this block needs (0 when fully resident)."""
        return 0 if self.streamed_bytes == 0 else self.nbytes - self.slot_start

    @property
    def is_streamed(self) -> bool:
        return self.streamed_bytes > 0

    def cast_tensors(self) -> list[TensorEntry]:
        """Tensors stored in fp8 and cast to their compute dtype before the block runs."""
        return [t for t in self.tensors if t.compute_dtype is not None]

    @property
    def cast_extent(self) -> int:
        """Bytes of the cast buffer this block needs: its fp8 tensors in their compute dtype, ALIGN-aligned."""
        off = 0
        for t in self.cast_tensors():
            off = align_up(off) + t.compute_nbytes
        return off

    def resident_tensors(self) -> list[TensorEntry]:
        return [t for t in self.tensors if t.end <= self.resident_bytes]

    def streamed_tensors(self) -> list[TensorEntry]:
        return [t for t in self.tensors if t.end > self.resident_bytes]


def _direct_tensors(m: nn.Module):
    for attr, p in m._parameters.items():
        if p is not None:
            yield attr, p, True
    for attr, b in m._buffers.items():
        if b is not None:
            yield attr, b, False


def owned_tensors(root: nn.Module, blocks: list[nn.Module]) -> list[list[tuple[str, nn.Module, str, torch.Tensor, bool]]]:
    """For each block, the tensors only it holds: (name, module, attr, tensor, is_param), in registration order.

    A tensor also held outside the block (by the root, another block, or a module shared with one) is left
    out: it stays resident with the non-block state.
    """
    block_of_module: dict[int, set[int]] = {}
    for i, blk in enumerate(blocks):
        for m in blk.modules():
            block_of_module.setdefault(id(m), set()).add(i)
    holders: dict[int, set] = {}
    for m in root.modules():
        where = block_of_module.get(id(m), {"outside"})
        for _, t, _ in _direct_tensors(m):
            holders.setdefault(id(t), set()).update(where)
    out = []
    for i, blk in enumerate(blocks):
        seen: set[tuple[int, str]] = set()
        entries = []
        for mname, m in blk.named_modules(remove_duplicate=False):
            for attr, t, is_param in _direct_tensors(m):
                if (id(m), attr) in seen:
                    continue
                seen.add((id(m), attr))
                if holders.get(id(t), {"outside"}) != {i} or t.numel() == 0:
                    continue
                entries.append((f"{mname}.{attr}" if mname else attr, m, attr, t, is_param))
        out.append(entries)
    return out


def pack_block(index: int, name: str, module: nn.Module, entries,
               cast: dict[int, torch.dtype] | None = None) -> BlockLayout:
    """Pack a block's tensors, grouped by stored dtype (order of first appearance), at ALIGN-aligned offsets.
    `cast`: id(tensor) -> storage dtype for tensors stored in another dtype than their own (fp8 storage)."""
    cast = cast or {}
    by_tensor: dict[int, TensorEntry] = {}
    order: list[torch.Tensor] = []
    for ename, m, attr, t, is_param in entries:
        if id(t) in by_tensor:  # tied inside the block: one copy, several owners
            by_tensor[id(t)].owners.append((m, attr))
            continue
        stored = cast.get(id(t), t.dtype)
        by_tensor[id(t)] = TensorEntry(ename, [(m, attr)], is_param, 0, t.numel() * stored.itemsize, stored,
                                       tuple(t.shape),
                                       t.dtype if stored != t.dtype else None)
        order.append(t)
    dtypes: list[torch.dtype] = []
    for t in order:
        if by_tensor[id(t)].dtype not in dtypes:
            dtypes.append(by_tensor[id(t)].dtype)
    tensors: list[TensorEntry] = []
    off = 0
    for dt in dtypes:
        for t in order:
            if by_tensor[id(t)].dtype is dt:
                e = by_tensor[id(t)]
                off = align_up(off)
                e.offset = off
                off += e.nbytes
                tensors.append(e)
    return BlockLayout(index, name, module, tensors, nbytes=off, tensor_bytes=sum(e.nbytes for e in tensors))


def split_residency(b: BlockLayout, chunk_bytes: int | None, residency: float) -> None:
    """Set R_l, R'_l, A_l and the H2D chunks of block b. chunk_bytes None: the whole block is one chunk."""
    V = b.nbytes
    C = V if chunk_bytes is None else chunk_bytes
    if V == 0:
        b.resident_bytes = b.straddle_start = b.slot_start = 0
        b.chunks = []
        return
    R = int(resident_bytes(V, C, residency))  # the planner's rule: nearest whole-chunk prefix to r V
    straddle = [t.offset for t in b.tensors if t.offset < R < t.end]
    r_prime = straddle[0] if straddle else R
    b.resident_bytes = R
    b.straddle_start = r_prime
    b.slot_start = align_down(r_prime) if R < V else V
    b.chunks = [(a, min(a + C, V)) for a in range(R, V, C)]


def block_layouts(root: nn.Module, blocks: list[tuple[str, nn.Module]], chunk_bytes: int | None,
                  residency: float, cast: dict[int, torch.dtype] | None, tier_of: Callable[[BlockLayout], Tier],
                  whole: frozenset[int] = frozenset()) -> list[BlockLayout]:
    """The layouts of all blocks, each with its tier (`tier_of(b)`, asked once b is packed and split) and its offset
    in the one host store (each block's range ALIGN-aligned); `cast` as in pack_block; the blocks of `whole` (their
    indices) kept wholly resident, the others at `residency`."""
    owned = owned_tensors(root, [m for _, m in blocks])
    layouts = []
    for i, ((name, m), entries) in enumerate(zip(blocks, owned)):
        b = pack_block(i, name, m, entries, cast)
        split_residency(b, chunk_bytes, 1.0 if i in whole else residency)
        b.tier = tier_of(b)
        layouts.append(b)
    return place_in_store(layouts)


def place_in_store(layouts: list[BlockLayout]) -> list[BlockLayout]:
    """Each block's offset in the one host store (ALIGN-aligned), by its host extent (what its tier keeps there)."""
    host = 0
    for b in layouts:
        host = align_up(host)
        b.host_offset = host
        host += b.host_extent
    return layouts


def block_spans(layouts: list[BlockLayout]) -> list[tuple[int, int]]:
    """(offset, bytes) of each block's span of the host store, padding included: together they cover the store, and
    every copy from it lies inside one span."""
    ends = [b.host_offset for b in layouts[1:]] + [store_bytes(layouts)]
    return [(b.host_offset, end - b.host_offset) for b, end in zip(layouts, ends)]


def store_bytes(layouts: list[BlockLayout]) -> int:
    if not layouts:
        return 0
    last = layouts[-1]
    return last.host_offset + last.host_extent
