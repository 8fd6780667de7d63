"""`offload()` and `OffloadHandle`: the one way to attach chunkflow to a module; `remove()` undoes it.

`offload(module, config)` takes an OffloadConfig, a plan (object or file) or keywords, lays the module's blocks
out, writes their bytes into one host store, places everything else on the device and starts the ring. Model
builders and loaders go through the same call, with a TensorSource that fills tensors a module holds on the meta
device. Every check runs before the module is touched, so a bad argument leaves it exactly as it was.

An offloaded module stays a normal module: block tensors are views of the host store outside their forward
(runtime/params.py), writes are seen and carried to the device at the next forward (runtime/writes.py), a dtype
change is applied to the store (the blocks are laid out again), and a device change is refused.

The handle holds the layout, the host store, the streamer and the block hooks; each feature beyond streaming is a
part registered on it (runtime/feature.py): fp8 storage (runtime/casting.py), write watching (runtime/writes.py),
communication awareness (runtime/comm.py) and parking (runtime/parking.py). `remove()` and `discard()` end the
handle through one teardown; `discard()` leaves the module without weights instead of giving them back.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import torch
from torch import nn

from chunkflow.runtime.casting import FP8_NO_NEW_MODULES, Fp8Storage
from chunkflow.runtime.comm import CollectiveTap, CommAwareness, CommPacer
from chunkflow.runtime.errors import OffloadError, warn_user
from chunkflow.runtime.feature import HandleFeature
from chunkflow.runtime.fp8cast import cast_kernel_name
from chunkflow.runtime.hooks import HANDLE_KEY, BlockHook, hook_module, hook_part, unhook_module, unhook_part
from chunkflow.runtime.layout import BlockLayout, block_layouts, block_spans, store_bytes
from chunkflow.runtime.observe import Observer, Observers
from chunkflow.runtime.order import ExecutionOrder
from chunkflow.runtime.params import bind_data, raw_data
from chunkflow.runtime.parking import Parking, TurnTaking, take_turns
from chunkflow.runtime.quantized import check_quantized
from chunkflow.runtime.runs import BlockRuns
from chunkflow.runtime.resolve import (
    check_not_offloaded,
    check_parameters,
    check_whole_blocks,
    resolve_blocks,
    resolve_config,
    resolve_device,
    unwrap_module,
)
from chunkflow.runtime.saveguard import SaveGuard
from chunkflow.runtime.stats import OffloadStats
from chunkflow.runtime.storage import check_no_layerwise_casting, storage_dtype
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.streamer import CpuBackend, CudaBackend, Streamer, bind, current
from chunkflow.runtime.tensors import ModuleTensor, TensorSource, all_tensors, check_values, fill, home, place
from chunkflow.runtime.codecs.ahead import DecodeAhead, check_decode
from chunkflow.runtime.codecs.layer import tiers_with_codec
from chunkflow.runtime.tiers import Tier, park_home
from chunkflow.runtime.writes import WriteWatch
from chunkflow_planner.offload import OffloadConfig

__all__ = ["offload", "take_turns", "TurnTaking", "OffloadHandle", "OffloadError", "OffloadStats", "TensorSource",
           "resolve_device", "discard"]


def _locked(method):
    """The method under the handle's lock (it waits for a forward running in another thread to end)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return run


class ResidencyRoundedWarning(UserWarning):
    """The residency kept differs from the one asked: each block keeps whole chunks on the device."""


def _warn_rounded(cfg: OffloadConfig, layouts: list[BlockLayout]) -> None:
    """Say so where whole chunks make the kept residency far from the one asked (small blocks, big chunks)."""
    layouts = [b for b in layouts if b.index not in cfg.whole_blocks]  # those keep all their bytes, as asked
    V = sum(b.nbytes for b in layouts)
    if cfg.mode != "chunkflow" or not V or cfg.residency in (0.0, 1.0):
        return
    kept = sum(b.resident_bytes for b in layouts) / V
    if abs(kept - cfg.residency) > 0.05:
        from chunkflow_planner.units import format_bytes

        block = max(b.nbytes for b in layouts)
        warn_user(f"chunkflow: residency {cfg.residency:.0%} asked, {kept:.0%} kept: each block keeps whole chunks "
                  f"({format_bytes(cfg.chunk_bytes)}) on the device and the largest block here is "
                  f"{format_bytes(block)}; a chunk_size well under the block keeps residency closer",
                  ResidencyRoundedWarning)


class OffloadHandle:
    """State of one offloaded module. Made by `offload()`; undo with `remove()`."""

    def __init__(self, module: nn.Module, cfg: OffloadConfig, device: torch.device,
                 blocks: list[tuple[str, nn.Module]], tiers: list[Tier] | None = None, park=None,
                 decode: str = "ahead"):
        self.module = module
        self.cfg = cfg
        self.device = device
        self.blocks = blocks
        self.layouts: list[BlockLayout] = []
        self.store: HostStore | None = None
        self.streamer: Streamer | None = None
        self.hooks: list[BlockHook] = []
        self.non_block: list[ModuleTensor] = []  # the tensors outside the blocks (on the device unless parked)
        self.observers: list[Observer] = []
        self.obs: Observer | None = None  # the observers as one (None: none attached)
        self.refreshes = 0
        self.relayouts = 0
        self.reorders = 0  # re-layouts into the order the first forward entered the blocks (runtime/order.py)
        self.order = ExecutionOrder()
        self.runs = BlockRuns()  # blocks computed and skipped (a cache's hits), runtime/runs.py
        self.removed = False
        self._origin: dict[tuple[int, str], torch.device] = {}  # (id(owner), attr) -> device before offload
        self._home: torch.device = torch.device("cpu")  # where tensors new since offload go at remove()
        fp8 = storage_dtype(cfg.weight_dtype)
        self.parking = Parking(park) if park is not None else Parking()
        self.casting = Fp8Storage(fp8, on_copy=cfg.fp8_cast == "copy") if fp8 is not None else None
        self.writes = WriteWatch() if cfg.streams else None
        self.decode = decode  # streamed blocks' quantized weights: decoded ahead of their forward, or in it
        self.ahead: DecodeAhead | None = None  # the streamer's decode buffers while attached (runtime/codecs/ahead.py)
        self.comm = CommAwareness()
        # where the blocks' tails live (runtime/tiers/): each block is taken by the first tier that claims it
        self.tiers: list[Tier] = list(tiers or [])
        # the parts, in the order they are attached and closed (detached in reverse); None: not used by this setting
        self.features: list[HandleFeature] = [f for f in (self.parking, self.casting, self.writes, self.comm)
                                              if f is not None] + self.tiers
        # a save into the folder the tiers or the park home read from leaves those files as they are, or is refused
        self.features.append(SaveGuard([*self.tiers, self.parking.home]))
        # one forward at a time (two threads sharing the module would share its slots): held through the root's
        # call (hooks._root_call), around each block's, and by park, unpark, apply and remove; `take_turns` gives
        # the modules taking turns one lock. `depth`: forwards of the module running in the thread holding it
        self.lock = threading.RLock()
        self.depth = 0
        self.submodules: list[nn.Module] = []  # the modules inside it whose class was swapped (hooks.hook_part)

    def __repr__(self) -> str:
        state = "removed" if self.removed else "parked" if self.parked else "on " + str(self.device)
        return f"<OffloadHandle {type(self.module).__name__} {self.cfg.label}, {state}>"

    @property
    def pacer(self) -> CommPacer | None:
        """The pacer of chunks around collectives (runtime/comm.py), while one paces."""
        return self.comm.pacer

    @property
    def tap(self) -> CollectiveTap | None:
        """The collective wrappers this handle owns, while installed."""
        return self.comm.tap

    # ---- attach and detach (start-up, remove, laying out again)

    def _attach(self, source: TensorSource | None = None, first: bool = False) -> None:
        """Lay the blocks out, fill a new host store and the device, start streaming, attach the parts. The first
        time, note where every tensor was (remove() puts it back there)."""
        tensors = all_tensors(self.module)
        check_values(tensors, source)
        if first:
            self._origin = {(id(t.owners[0][0]), t.owners[0][1]): home(t.device) for t in tensors}
            self._home = home(tensors[0].device) if tensors else torch.device("cpu")
        layouts = self._lay_out(tensors, source, first)
        skip = self.parking.starts_parked(self._outside(layouts, tensors)) if first else frozenset()
        with torch.inference_mode(False):
            self._fill(layouts, tensors, source, skip)
            if self.cfg.streams:
                self._start_streaming()
            for f in self.features:
                f.attach(self)
            if self.writes is not None:
                fp8 = self.casting is not None and self.casting.stores_any
                self.writes.refuse_registrations(FP8_NO_NEW_MODULES if fp8 else None, self.module)
        if self.streamer is not None:
            self.streamer.obs = self.obs

    def _lay_out(self, tensors: list[ModuleTensor], source: TensorSource | None, first: bool) -> list[BlockLayout]:
        """The blocks' layouts, with the tensors fp8 storage casts; the first time, values fp8 cannot hold are
        refused before anything is written."""
        cast = self.casting.plan(self.module, self.blocks) if self.casting is not None else {}
        if first and self.casting is not None:
            self.casting.check_values(tensors, source)
        layouts = block_layouts(self.module, self.blocks, self.cfg.chunk_bytes, self.cfg.residency, cast,
                                self._tier_of, whole=frozenset(self.cfg.whole_blocks))
        if first:
            _warn_rounded(self.cfg, layouts)
        for t in self.tiers:
            t.laid_out(layouts, pin=self.device.type == "cuda")
        return layouts

    def _tier_of(self, b: BlockLayout) -> Tier:
        """The first tier that takes block b's tail (the host tier, last, takes any)."""
        return next(t for t in self.tiers if t.claim(b))

    @staticmethod
    def _outside(layouts: list[BlockLayout], tensors: list[ModuleTensor]) -> list[ModuleTensor]:
        """The tensors no block owns."""
        owned = {id(current(e)) for b in layouts for e in b.tensors}
        return [t for t in tensors if id(t.get()) not in owned]

    def _fill(self, layouts: list[BlockLayout], tensors: list[ModuleTensor], source: TensorSource | None,
              skip: frozenset[str] = frozenset()) -> None:
        """A new host store holding the blocks' bytes (page-locked span by span while they are written: a loader's
        reads overlap the locking), every other tensor on the device (fp8-stored layers in fp8)."""
        store = HostStore(store_bytes(layouts), pin=self.device.type == "cuda",
                          ranges=block_spans(layouts)) if self.cfg.streams else None
        try:
            self.non_block = fill(layouts, store, tensors, self.device, source, skip)
            if store is not None:
                store.wait()
        except BaseException:
            if store is not None:
                store.release()
            raise
        place(self.non_block, self.device)
        if self.casting is not None:  # before the streamer's buffers: the device holds these layers in fp8 by then
            self.casting.store_outside()
        if self.device.type == "cuda" and source is not None:
            torch.cuda.synchronize(self.device)
        self.layouts, self.store = layouts, store

    def _start_streaming(self) -> None:
        """The streamer (device buffers, the first block prefetched) and the block hooks."""
        features = self.casting.block_casts(self.layouts, self.device) if self.casting is not None else []
        ahead = DecodeAhead(self.layouts, self.device) if self.decode == "ahead" else None
        self.ahead = ahead if ahead else None
        features += [self.ahead] if self.ahead is not None else []
        backend = CudaBackend(self.device) if self.device.type == "cuda" else CpuBackend()
        self.streamer = Streamer(self.layouts, self.store, self.device, backend, features)
        self.streamer.fill_resident_and_start()
        self.hooks = [BlockHook(self, b.index, b.module) for b in self.layouts]

    def _detach(self, to_host: bool) -> HostStore | None:
        """Detach the parts, stop streaming. to_host: block tensors stay what they are between forwards (views of
        the old store, which is returned and must outlive them, or whatever replaced them since); else each goes
        back where it was before offload, with its current values, and the store is released."""
        for f in reversed(self.features):
            f.detach(self)
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.streamer is not None:
            self.streamer.release()
        self.streamer, self.ahead = None, None
        if not to_host:
            self._give_back_blocks()
        store, self.store, self.layouts = self.store, None, []
        if to_host:
            return store
        if store is not None:
            store.release()
        return None

    def _give_back_blocks(self) -> None:
        """Every block tensor back on its device before offload, in its compute dtype, with its current values."""
        lost = []
        for b in self.layouts:
            for t in b.tensors:
                cur = current(t)
                try:
                    bind(t, (raw_data(cur) if t.is_param else cur).to(self._origin_of(t), dtype=t.compute_dtype
                                                                       or t.dtype, copy=True))
                except (RuntimeError, NotImplementedError):  # replaced behind torch's back by one with no values
                    lost.append(f"{b.name}.{t.name}")  # (meta): left as it is, the rest put back
        if lost:
            warn_user(f"chunkflow: remove() could not give back {', '.join(lost[:5])}"
                      f"{' and more' if len(lost) > 5 else ''}: replaced while offloaded by tensors without "
                      "values; they are left as they are")

    def _origin_of(self, t) -> torch.device:
        return self._origin.get((id(t.owners[0][0]), t.owners[0][1]), self._home)

    def _block_compute_dtypes(self) -> dict[int, torch.dtype]:
        """id(tensor) -> compute dtype, for the block tensors stored in fp8 now."""
        return {id(current(e)): e.compute_dtype for b in self.layouts for e in b.tensors if e.compute_dtype}

    def _relayout(self, dtypes: dict[torch.dtype, torch.dtype] | None = None, device: torch.device | None = None
                  ) -> None:
        """Lay the blocks out again from the module as it is now (new tensors included), with `dtypes` applied to
        every tensor if given, on `device` if given. Host memory holds the old store and the new one for the time
        of the copy. Whole or not at all: where the new layout fails, every tensor is put back as it was (dtype,
        device, values) and laid out as before, and the error raised."""
        compute = self._block_compute_dtypes()
        before: list[tuple[ModuleTensor, torch.Tensor, torch.Tensor]] = []  # (tensor, object, its data before)
        was_device = self.device
        with torch.inference_mode(False), torch.no_grad():
            old = self._detach(to_host=True)
            try:
                if device is not None:
                    self.device = device
                if dtypes or compute:  # fp8-stored tensors become their compute dtype again (then stored anew)
                    dtypes = dtypes or {}
                    for t in all_tensors(self.module):
                        cur = t.get()
                        own = compute.get(id(cur), cur.dtype)
                        new = cur.to(dtypes.get(own, own))
                        if new is cur:
                            continue
                        before.append((t, cur, raw_data(cur) if t.is_param else cur))
                        if t.is_param:
                            bind_data(cur, new)
                        else:
                            t.set_buffer(new)
                self._attach()
            except BaseException:
                self._undo_relayout(before, was_device)
                raise
            finally:
                if old is not None:
                    old.release()
        self.relayouts += 1

    def _undo_relayout(self, before: list, device: torch.device) -> None:
        """A failed re-layout: every converted tensor back to what it was, laid out as before (a new store holding
        the old values)."""
        for t, cur, data in before:
            if t.is_param:
                bind_data(cur, data)
            else:
                t.set_buffer(data)
        self.device = device
        partial = self._detach(to_host=True) if self.streamer is not None or self.store is not None else None
        self._attach()
        if partial is not None:
            partial.release()

    # ---- forwards (the block hooks call these)

    def enter_block(self, l: int, lazy: bool = False) -> bool:
        """Block l was called: the forward's bookkeeping (its order, writes carried to the device), then its tensors
        bound on the device (`streamer.enter`: its prefetch waited for, the next one issued) unless `lazy`, where
        that waits for its own forward to begin (`stream_in`): a block a step cache skips is never waited for and
        prefetches nothing. Returns whether the block was entered now."""
        first = self.order.enter(l) if self.depth else False  # the first block of a forward not checked yet
        relayouts, starts = self.relayouts, l == 0 or first
        if starts:  # a forward starts: carry writes made since the last one to the device
            self.sync()
        self.streamer.called(l)  # (on the streamer of the layout the block runs in)
        lazy = lazy and self.relayouts == relayouts  # laid out again: the block's hook is a new one, entered now
        if not starts and self.writes is not None:
            stale = self.writes.stale(l)  # written earlier in this forward (by a hook): its prefetched copies are old
            b = self.layouts[l]
            if stale and b.host_extent < b.nbytes:  # its tail's source is not what was written (not the store): the
                self.streamer.enter(l)  # written tensors are copied over its bytes, and the block leaves its tier at
                self.streamer.copy_in(l, stale)  # the next forward
                self.writes.touched.add(l)
                self.refreshes += 1
                return True
            if stale:
                self.streamer.refresh({l})
                self.refreshes += 1
        if lazy:
            return False
        self.streamer.enter(l)
        return True

    def stream_in(self, l: int) -> None:
        """Block l's own forward begins (entered lazily): its tensors bound on the device, the next prefetched."""
        self.streamer.enter(l)

    def forward_done(self) -> None:
        """A top-level forward of the module completed: the first one's block order is checked, and where it is
        not the layout's the blocks are laid out again in the order they ran (runtime/order.py)."""
        if self.depth != 1 or self.streamer is None:
            return
        self.runs.done()
        if self.order.checked:
            self.streamer.prefetch_first()  # where a step cache skipped the last blocks, nothing prefetched it
            return
        order = self.order.done(len(self.layouts))
        if order is None:
            self.streamer.prefetch_first()
        else:
            was = self.blocks
            self.blocks = [self.blocks[l] for l in order]
            try:
                self._relayout()
            except BaseException:
                self.blocks = was
                raise
            self.reorders += 1

    def exit_block(self, l: int, ran: bool | None = True, entered: bool = True) -> None:
        """Block l's call ended; `ran`: whether its own forward ran (False: a cache skipped it; None: its enter
        failed, not counted); `entered`: whether its tensors were bound (a lazily entered block its cache skipped
        never was: nothing to give back)."""
        if not entered:
            self.streamer.skipped(l)
            if ran is not None:
                self.runs.block(self.blocks[l][0], ran, self.streamer.run_bytes[l] if self.layouts[l].is_streamed
                                else 0)
            return
        written = self.writes.written(l) if self.writes is not None else []
        try:
            if written:  # the block wrote its own tensors' device copies: the host store, the truth, takes them
                self.streamer.write_back(l, written)
        finally:  # a refused write still gives the slot back
            self.streamer.exit(l)
        if ran is not None:
            self.runs.block(self.blocks[l][0], ran, self.streamer.run_bytes[l] if self.layouts[l].is_streamed else 0)

    def sync(self) -> None:
        """Bring the device copies up to date with writes to the blocks since the last forward (writes.py)."""
        relayout, dirty = self.writes.collect()
        hit = dirty | self.writes.replaced
        if hit and any([t.demote(hit) for t in self.tiers]):
            relayout = True  # a block written or given new tensors where its tier cannot hold them (a file, never
            # written): its values move to the host store
        if relayout:
            self._relayout()
        elif dirty:
            self.streamer.refresh(dirty)
            self.refreshes += 1

    # ---- dtype and device changes (the root's `_apply`: .to(), .half(), .cuda(), ...)

    def _conversion(self, fn, tensors) -> tuple[torch.device | None, dict[torch.dtype, torch.dtype]]:
        """What `fn` (a `.to()`/`.half()` conversion) does to the module: the device it moves to (None: stays on the
        handle's) and its dtype mapping (each tensor's own dtype: the compute dtype of those stored in fp8)."""
        compute = self._block_compute_dtypes()
        compute.update(self.casting.resident_compute() if self.casting is not None else {})
        target, mapping = None, {}
        for dt in {compute.get(id(t.get()), t.get().dtype) for t in tensors}:
            out = fn(torch.empty(0, dtype=dt, device=self.device))
            if out.device != self.device:
                target = out.device
            if out.dtype != dt:
                mapping[dt] = out.dtype
        return target, mapping

    @_locked
    def apply(self, fn, recurse: bool = True) -> nn.Module:
        """A conversion of the whole module (`.to()`, `.half()`, `.cuda()`), as a module not offloaded takes it: a
        dtype change is applied to the host store (the blocks are laid out again); another device offloads it there
        (same setting; 'cpu' runs chunkflow's CPU mode); 'meta' ends the offload, every tensor left on the meta
        device (no weights), as it leaves a plain module."""
        self.unpark()
        target, mapping = self._conversion(fn, all_tensors(self.module))
        if mapping:
            for t in self.tiers:  # before anything changes (files hold one dtype)
                t.check_dtypes(self.layouts, mapping)
        if target is not None and target.type == "meta":
            self.discard()
            return self.module
        if target is not None:
            self._relayout(mapping, device=target)
            self._origin = {k: target for k in self._origin}  # remove() leaves it where it was moved
            self._home = target
            self.parking.release_store()
        elif mapping:
            self._relayout(mapping)
        return self.module

    def apply_part(self, part: nn.Module, fn) -> nn.Module:
        """A conversion of a module inside the offloaded one: nothing to do where it keeps every tensor's device
        and dtype; any other is refused before anything changes (the handle owns where and how they are stored)."""
        target, mapping = self._conversion(fn, all_tensors(part))
        if target is None and not mapping:
            return part
        name = next((n for n, m in self.module.named_modules() if m is part), type(part).__name__)
        changes = ([f"move to {target}"] if target is not None else []) + (
            ["change dtype (" + ", ".join(f"{str(a).removeprefix('torch.')} -> {str(b).removeprefix('torch.')}"
                                         for a, b in mapping.items()) + ")"] if mapping else [])
        what = " and ".join(changes)
        hint = (" To store the weights in fp8, offload with weight_dtype='fp8_e4m3' (diffusers' layerwise casting "
                "does the same arithmetic)." if any(b.is_floating_point and b.itemsize == 1 for b in mapping.values())
                else "")
        raise OffloadError(
            f"{name or type(part).__name__} is part of a module offloaded by chunkflow to {self.device}; it cannot "
            f"{what or 'change'} on its own (nothing was changed): convert the whole module (module.to(...)), or call "
            f"handle.remove() first.{hint}")

    # ---- communication awareness and observers (runtime/comm.py, runtime/observe.py)

    def _configure(self) -> None:
        """The attached observers as one, told to the streamer and the comm part (which adds or drops its pacer
        and tap as the setting and the observers ask)."""
        obs = None if not self.observers else (self.observers[0] if len(self.observers) == 1
                                                else Observers(self.observers))
        if self.streamer is not None:
            self.streamer.obs = obs
        self.obs = obs
        self.comm.configure(self, obs)

    def set_comm_aware(self, aware: bool) -> None:
        """Switch communication awareness (chunkflow mode, under SP); takes effect at the next block boundary."""
        self.cfg = self.cfg.with_overrides(comm_aware=bool(aware))
        self._configure()

    def add_observer(self, obs: Observer) -> Observer:
        """Tell `obs` (chunkflow.probes, or any Observer) of every copy, wait and collective from now on."""
        self.observers.append(obs)
        self._configure()
        return obs

    def remove_observer(self, obs: Observer) -> None:
        self.observers.remove(obs)
        self._configure()

    @contextlib.contextmanager
    def observing(self, *observers: Observer) -> Iterator[tuple[Observer, ...]]:
        """Observers attached for the duration of a `with` block."""
        for o in observers:
            self.add_observer(o)
        try:
            yield observers
        finally:
            for o in observers:
                self.remove_observer(o)

    # ---- parking: models that take turns on the device (runtime/parking.py)

    @property
    def parked(self) -> bool:
        return self.parking.parked

    @_locked
    def park(self) -> None:
        """Free this module's device memory until its next forward: the resident buffer and slots are given back
        and the non-block tensors move to host memory (one pinned allocation on CUDA, kept for the next park; a
        tensor not written since the last unpark is not copied again); the block tensors stay in the host store.
        The next forward takes everything back first (`unpark`), writes made in between included. Nothing to do
        when parked already or removed."""
        if self.removed or self.parked:
            return
        if self.depth or (self.streamer is not None and self.streamer.bound):
            raise OffloadError("park() was called inside a forward of the offloaded module; park between forwards")
        self.parking.park(self)

    @_locked
    def unpark(self) -> None:
        """Take the device memory back after `park()` (the next forward does this by itself)."""
        self.parking.unpark(self)

    # ---- reporting

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype fp8-stored weights are cast to for the forward (None without fp8 storage)."""
        return self.casting.compute_dtype(self.layouts) if self.casting is not None else None

    def stats(self) -> OffloadStats:
        L = self.layouts
        V = sum(b.nbytes for b in L)
        R = sum(b.resident_bytes for b in L)
        s = self.streamer
        slot = s.slots[0].numel() if s is not None and s.slots else 0
        nb = sum(t.get().numel() * t.get().element_size() for t in self.non_block)
        cast_bytes = self.casting.buffer_bytes() if self.casting is not None and s is not None else 0
        ahead = self.ahead
        decode_bytes = ahead.device_bytes() if ahead is not None and s is not None else 0
        stored, decoded = ahead.stored_and_decoded() if ahead is not None else (0, 0)
        return OffloadStats(
            mode=self.cfg.mode,
            device=str(self.device),
            chunk_bytes=self.cfg.chunk_bytes,
            n_blocks=len(L),
            n_streamed_blocks=sum(b.is_streamed for b in L),
            bytes_offloaded=sum(b.tensor_bytes for b in L),
            host_bytes=self.store.nbytes if self.store is not None else 0,
            pinned_bytes=self.store.pinned_bytes if self.store is not None else 0,
            resident_bytes=R,
            non_block_bytes=nb,
            streamed_bytes_per_step=sum(b.streamed_bytes for b in L),
            d2d_bytes_per_step=sum(b.d2d_bytes for b in L if b.is_streamed),
            target_residency=self.cfg.residency,
            achieved_residency=(R / V) if V else 1.0,
            slot_bytes=slot,
            device_buffer_bytes=(s.resident.numel() + 2 * slot + cast_bytes + decode_bytes) if s is not None else 0,
            forwards=s.forwards if s is not None else 0,
            h2d_bytes_issued=s.bytes_h2d if s is not None else 0,
            blocks_computed=self.runs.computed,
            blocks_skipped=self.runs.skipped,
            skipped_h2d_bytes=self.runs.skipped_h2d_bytes,
            comm_aware=s is not None and s.pacer is not None,
            refreshes=self.refreshes,
            relayouts=self.relayouts,
            reorders=self.reorders,
            weight_dtype=self.cfg.weight_dtype,
            fp8_tensors=self.casting.tensor_count(L) if self.casting is not None else 0,
            cast_buffer_bytes=cast_bytes,
            fp8_cast_kernel=cast_kernel_name(self.device) if self.casting is not None else "",
            decode=self.decode,
            decoded_tensors=ahead.tensor_count() if ahead is not None else 0,
            decoded_stored_bytes=stored,
            decoded_bytes=decoded,
            decode_buffer_bytes=decode_bytes,
            **{k: v for t in self.tiers for k, v in t.stats(L).items()},
            **self.parking.stats(),
        )

    # ---- the end

    @_locked
    def remove(self) -> None:
        """Hooks off, every tensor back on its original device with its values (writes made while offloaded kept),
        host and device memory freed, the module's own class back."""
        if self.removed:
            return
        if self.depth or (self.streamer is not None and self.streamer.bound):
            raise OffloadError("handle.remove() was called inside a forward of the offloaded module (nothing was "
                               "changed); remove it between forwards")
        for t in self.tiers:  # weights read from elsewhere are given back as they are there: unchanged
            t.verify()
        self._teardown(restore=True)

    @_locked
    def discard(self) -> None:
        """End a handle whose module is no longer needed, without putting anything back: hooks off, host stores
        released (no copy of the weights is made, unlike `remove()`), and every tensor of the module left on the
        meta device, so that using it fails loudly. For a program that built the module itself and is done with
        it."""
        if not self.removed:
            self._teardown(restore=False)

    def _teardown(self, restore: bool) -> None:
        """The one way a handle ends: parts closed, then detached, block hooks and streamer gone, host and device
        memory freed, the module's own classes back. restore: every tensor back where it was before offload, with
        its values (remove); else every tensor left on the meta device (discard)."""
        for f in self.features:
            f.close(self, restore)
        self.observers, self.obs = [], None
        store = self._detach(to_host=not restore)
        if restore:
            place(self.non_block, None)
            self._send_new_tensors_home()
        else:
            self._empty_tensors()
            if store is not None:
                store.release()
        for m in self.submodules:
            unhook_part(m)
        self.submodules = []
        unhook_module(self.module)
        self.module.__dict__.pop(HANDLE_KEY, None)
        self.removed = True

    def _send_new_tensors_home(self) -> None:
        """Tensors added while offloaded (e.g. LoRA) go where the module was."""
        for t in all_tensors(self.module):
            cur = t.get()
            if (id(t.owners[0][0]), t.owners[0][1]) not in self._origin and cur.device != self._home:
                if t.is_param:
                    cur.data = cur.data.to(self._home)
                else:
                    t.set_buffer(cur.to(self._home))

    def _empty_tensors(self) -> None:
        """Every tensor of the module on the meta device (same shapes and dtypes, no values)."""
        with torch.no_grad(), torch.inference_mode(False):
            for t in all_tensors(self.module):
                cur = t.get()
                gone = torch.empty(cur.shape, dtype=cur.dtype, device="meta")
                if t.is_param:
                    new = nn.Parameter(gone, requires_grad=False)
                    for m, attr in t.owners:
                        m._parameters[attr] = new
                else:
                    t.set_buffer(gone)


def discard(handle: OffloadHandle) -> None:
    """`handle.discard()`: end the handle, leaving its module without weights (see there)."""
    handle.discard()


def offload(module: nn.Module, config=None, *, plan=None, mode: str | None = None, chunk_size=None,
            residency: float | None = None, comm_aware: bool | None = None, weight_dtype: str | None = None,
            fp8_cast: str | None = None, disk_blocks: int | None = None, codec: str | None = None,
            device: str | torch.device | None = "cuda", blocks=None,
            source: TensorSource | None = None, park_to: str = "host", decode: str | None = None,
            whole_blocks: tuple[int, ...] | None = None) -> OffloadHandle:
    """Stream `module`'s blocks from pinned host memory to `device`, one block ahead, in chunks.

    The setting: `config` (an OffloadConfig, a plan object or `plan.json` path, or a mode name) or `plan=`, and/or
    the keywords `mode` ('none' keeps all on the device, 'layerwise' copies whole blocks, 'chunkflow' copies
    chunks of `chunk_size` and keeps the first `residency` of each block resident), `comm_aware` (chunkflow under
    torch.distributed: keep chunk copies out of the model's collectives; call `init_distributed()` first),
    `weight_dtype` ('bf16', the default: the weights as they are; 'fp8_e4m3': the blocks' linear weights stored in
    float8 and cast back on the device before each block runs, as diffusers' `enable_layerwise_casting` does; lossy,
    halves host memory and copied bytes), `fp8_cast` (with fp8: 'compute', the default, casts each block on the
    compute stream before it runs; 'copy' casts it on the copy stream right after its copies, off the compute
    path, with a second block-sized cast buffer), `disk_blocks` (that many blocks, spread over the forward, keep their
    streamed bytes in the checkpoint's files and are read from disk each forward, runtime/tiers/disk.py; needs a
    loader's `source` that knows the files), `codec` ('none', the default; 'exponent-pack': the streamed tails kept
    encoded in host memory, copied encoded and decoded on the device, bit for bit, runtime/codecs/layer.py; needs a
    loader's `source` as `disk_blocks` does), `park_to` (where the tensors outside the blocks go while the module is
    parked: 'host', the default, a pinned host copy; 'disk', left in the checkpoint's files and read back to the
    device at the next forward, so host memory holds none of them: offload() then returns the module parked, its
    files checked but not read; needs a loader's `source` as `disk_blocks` does), `decode` (blocks holding quantized
    weights, a GGUF or fp8-scaled file's; not given: the setting's or plan's, 'forward' by default): 'forward'
    leaves each layer to dequantize in its forward, as diffusers does; 'ahead' decodes a streamed block's weights
    into the compute dtype on the copy stream right after its copies, with the layer's own function, into a decode
    buffer per slot (resident blocks decode in their forward either way; runtime/codecs/ahead.py), `whole_blocks`
    (chunkflow: blocks, by their index in the order they run, kept wholly on the device, the others at `residency`;
    (0,) under a first-block cache, which runs block 0 every step: a step it skips then copies nothing).
    Keywords override a config or plan. `blocks`: the block modules in execution order (ModuleLists or modules),
    needed to stream or to check a plan (the runtime takes them from its caller: `chunkflow.offload` finds them
    from the catalog or in the module); the first forward's order is checked and the blocks laid out again in the
    order they ran where it differs (runtime/order.py). `device`: 'cuda' (default), 'cuda:1' or 'cpu' (same logic,
    synchronous copies).
    `source`: values for tensors on the meta device (loaders; see TensorSource). A torch.compile wrapper is
    offloaded through the module it wraps.
    """
    if decode is not None:
        check_decode(decode)
    module = unwrap_module(module)
    check_not_offloaded(module)
    cfg = resolve_config(config, plan=plan, module=module, blocks=blocks, mode=mode, chunk_size=chunk_size, residency=residency,
                         comm_aware=comm_aware, weight_dtype=weight_dtype, fp8_cast=fp8_cast, disk_blocks=disk_blocks,
                         codec=codec, decode=decode, whole_blocks=whole_blocks)
    dev = resolve_device(device)
    named = resolve_blocks(module, blocks) if cfg.streams else []
    check_whole_blocks(cfg, named)
    check_parameters(named)
    check_quantized(named, cfg.weight_dtype, cfg.codec)
    if cfg.streams:
        check_no_layerwise_casting(module)
    tiers = tiers_with_codec(cfg, module, len(named), source) if cfg.streams else []
    handle = OffloadHandle(module, cfg, dev, named, tiers, park_home(park_to, source, cfg), cfg.decode)
    try:
        handle._attach(source, first=True)
    except BaseException:
        for t in handle.tiers:  # their threads, files and shared segments go now, not with the garbage collector
            with contextlib.suppress(Exception):
                t.close(handle, restore=True)
        raise
    if cfg.streams:
        hook_module(module, handle, root=True)  # .to() and copies go through the handle
        handle.submodules = [m for m in module.modules() if m is not module]
        for m in handle.submodules:  # ... and a part's own .to() too (refused: the handle owns device and dtypes)
            hook_part(m, handle)
    module.__dict__[HANDLE_KEY] = handle
    if handle.parking.home.starts_held:  # its non-block tensors were never read: parked until its first forward
        handle.park()
    return handle
