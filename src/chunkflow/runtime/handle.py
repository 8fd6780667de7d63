"""`offload()` and `OffloadHandle`: the one way to attach chunkflow to a module; `remove()` undoes it.

`offload(module, config)` takes an OffloadConfig, a plan (object or file) or keywords, lays the module's blocks
out, writes their bytes into one host store, places everything else on the device and starts the ring. Model
builders and loaders go through the same call, with a TensorSource that fills tensors a module holds on the meta
device. Every check runs before the module is touched, so a bad argument leaves it exactly as it was.

An offloaded module stays a normal module: block tensors are views of the host store outside their forward
(runtime/params.py), writes are seen and carried to the device at the next forward (runtime/writes.py), a dtype
change is applied to the store (the blocks are laid out again), and a device change is refused.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from torch import nn

from chunkflow.runtime.comm import CollectiveTap, CommPacer, dist_active
from chunkflow.runtime.errors import OffloadError
from chunkflow.runtime.fp8cast import cast_kernel_name
from chunkflow.runtime.hooks import BlockHook, hook_module, hook_part, unhook_module, unhook_part
from chunkflow.runtime.layout import BlockLayout, block_layouts, block_spans, store_bytes
from chunkflow.runtime.observe import Observer, Observers
from chunkflow.runtime.params import bind_data, raw_data
from chunkflow.runtime.resolve import resolve_blocks, resolve_config, resolve_device
from chunkflow.runtime.storage import (
    Fp8RoundedWeightsWarning,
    ResidentCasting,
    cast_layers,
    cast_tensors,
    check_fits,
    check_no_layerwise_casting,
    storage_dtype,
)
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.streamer import CpuBackend, CudaBackend, Streamer, bind, current
from chunkflow.runtime.tensors import ModuleTensor, TensorSource, all_tensors, check_values, fill, home, place
from chunkflow.runtime.writes import WriteWatch
from chunkflow_planner.offload import OffloadConfig

__all__ = ["offload", "take_turns", "OffloadHandle", "OffloadError", "OffloadStats", "TensorSource", "resolve_device"]

_MARK = "_chunkflow_handle"
FP8_NO_NEW_MODULES = (
    "cannot add, replace or remove {name!r} while chunkflow stores this module's weights in fp8: a LoRA would be "
    "created in fp8 (peft gives adapters the dtype of the layer they wrap), silently losing precision, and other "
    "module surgery is not supported on fp8 storage; nothing was changed. Load and fuse LoRAs (or make such changes) "
    "before offloading, or offload with weight_dtype bf16.")


@dataclass(frozen=True)
class OffloadStats:
    mode: str
    device: str
    chunk_bytes: int | None  # None: whole block per copy (layerwise) or no streaming (none)
    n_blocks: int
    n_streamed_blocks: int
    bytes_offloaded: int  # the blocks' tensor bytes kept in the host store
    host_bytes: int  # host store size (tensor bytes plus alignment padding)
    pinned_bytes: int  # page-locked bytes (0 without CUDA)
    resident_bytes: int  # sum R_l: blocks' bytes kept on the device for good
    non_block_bytes: int  # non-block parameters and buffers on the device
    streamed_bytes_per_step: int  # H2D bytes per full forward: sum (V_l - R_l)
    d2d_bytes_per_step: int  # straddling tensors' resident bytes copied into slots per forward
    target_residency: float
    achieved_residency: float  # sum R_l / sum V_l
    slot_bytes: int  # one streaming slot
    device_buffer_bytes: int  # resident buffer plus both slots
    forwards: int  # forwards seen by the ring so far
    h2d_bytes_issued: int  # H2D bytes enqueued so far
    comm_aware: bool = False  # chunks are paced around collectives now (chunkflow mode, collectives seen)
    refreshes: int = 0  # forwards that re-copied blocks to the device after writes while offloaded
    relayouts: int = 0  # times the blocks were laid out again (new tensors, a dtype change)
    weight_dtype: str = "bf16"  # storage of the blocks' weights: bf16 (as the model holds them) or fp8_e4m3
    fp8_tensors: int = 0  # block tensors stored in fp8 (cast to their compute dtype at each block's forward)
    cast_buffer_bytes: int = 0  # device bytes the fp8 -> compute-dtype cast writes into: one block's worth; with
    # fp8_cast "copy" one per slot, and one more where some blocks do not stream (they are cast on the compute stream)
    fp8_cast_kernel: str = ""  # with fp8 storage on a device: the kernel that casts, triton or torch (runtime/fp8cast.py)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        from chunkflow_planner.units import format_bytes

        if self.mode == "none":
            return f"not streamed: every tensor on {self.device} ({format_bytes(self.non_block_bytes)})"
        return (f"{self.mode} on {self.device}: {self.n_streamed_blocks} of {self.n_blocks} blocks streamed"
                + (f" in {format_bytes(self.chunk_bytes)} chunks" if self.chunk_bytes else "")
                + f", {format_bytes(self.streamed_bytes_per_step)} a forward; {format_bytes(self.resident_bytes)} "
                f"resident ({self.achieved_residency:.0%}); {format_bytes(self.host_bytes)} in host memory"
                + (f" ({format_bytes(self.pinned_bytes)} pinned)" if self.pinned_bytes else "")
                + f"; {format_bytes(self.device_buffer_bytes + self.non_block_bytes)} on the device; "
                f"{self.forwards} forwards so far")


def _locked(method):
    """The method under the handle's lock (it waits for a forward running in another thread to end)."""
    import functools

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return run


class ResidencyRoundedWarning(UserWarning):
    """The residency kept differs from the one asked: each block keeps whole chunks on the device."""


def _warn_rounded(cfg: OffloadConfig, layouts: list[BlockLayout]) -> None:
    """Say so where whole chunks make the kept residency far from the one asked (small blocks, big chunks)."""
    V = sum(b.nbytes for b in layouts)
    if cfg.mode != "chunkflow" or not V or cfg.residency in (0.0, 1.0):
        return
    kept = sum(b.resident_bytes for b in layouts) / V
    if abs(kept - cfg.residency) > 0.05:
        import warnings

        from chunkflow_planner.units import format_bytes

        block = max(b.nbytes for b in layouts)
        warnings.warn(f"chunkflow: residency {cfg.residency:.0%} asked, {kept:.0%} kept: each block keeps whole chunks "
                      f"({format_bytes(cfg.chunk_bytes)}) on the device and the largest block here is "
                      f"{format_bytes(block)}; a chunk_size well under the block keeps residency closer",
                      ResidencyRoundedWarning, stacklevel=4)


class OffloadHandle:
    """State of one offloaded module. Made by `offload()`; undo with `remove()`."""

    def __init__(self, module: nn.Module, cfg: OffloadConfig, device: torch.device,
                 blocks: list[tuple[str, nn.Module]]):
        self.module = module
        self.cfg = cfg
        self.device = device
        self.blocks = blocks
        self.layouts: list[BlockLayout] = []
        self.store: HostStore | None = None
        self.streamer: Streamer | None = None
        self.hooks: list[BlockHook] = []
        self.pacer: CommPacer | None = None  # paces chunks around collectives (chunkflow, comm_aware, SP)
        self.tap: CollectiveTap | None = None  # the collective wrappers this handle owns while it lives
        self.observers: list[Observer] = []
        self.writes = WriteWatch()
        self.refreshes = 0
        self.relayouts = 0
        self.removed = False
        self._obs: Observer | None = None
        self._non_block: list[ModuleTensor] = []
        self._origin: dict[tuple[int, str], torch.device] = {}  # (id(owner), attr) -> device before offload
        self._home: torch.device = torch.device("cpu")  # where tensors new since offload go at remove()
        self._resume: torch.utils.hooks.RemovableHandle | None = None  # while parked: the forward pre-hook
        self._park_store: HostStore | None = None  # host homes of the non-block tensors while parked
        self._park_versions: list[tuple[int, int]] | None = None  # (version, data_ptr) at the last unpark
        self._resident_cast: ResidentCasting | None = None  # fp8 storage of the layers outside the blocks
        # one forward at a time (two threads sharing the module would share its slots): held through the root's
        # call (hooks._root_call), around each block's, and by park, unpark, apply and remove; `take_turns` gives
        # the modules taking turns one lock. `depth`: forwards of the module running in the thread holding it
        self.lock = threading.RLock()
        self.depth = 0
        self.parts: list[nn.Module] = []  # the modules inside it whose class was swapped (hooks.hook_part)

    def __repr__(self) -> str:
        state = "removed" if self.removed else "parked" if self.parked else "on " + str(self.device)
        return f"<OffloadHandle {type(self.module).__name__} {self.cfg.label}, {state}>"

    # ---- attach and detach (start-up, remove, laying out again)

    def _attach(self, source: TensorSource | None = None, first: bool = False) -> None:
        """Lay the blocks out, fill a new host store and the device, start streaming and watching writes. The
        first time, note where every tensor was (remove() puts it back there)."""
        tensors = all_tensors(self.module)
        check_values(tensors, source)
        if first:
            self._origin = {(id(t.owners[0][0]), t.owners[0][1]): home(t.device) for t in tensors}
            self._home = home(tensors[0].device) if tensors else torch.device("cpu")
        fp8 = storage_dtype(self.cfg.weight_dtype)
        cast = cast_tensors(self.module, self.blocks, fp8)
        inside = {id(m) for _, b in self.blocks for m in b.modules()}
        outside = [m for m in cast_layers(self.module) if id(m) not in inside] if fp8 is not None else []
        if first and fp8 is not None:  # refuse weights fp8 cannot hold before anything is written (loaders' values
            every = {**cast, **{id(t): fp8 for m in outside for _, t in ResidentCasting.tensors(m)}}  # in fill)
            for t in tensors:
                cur = t.get()
                if id(cur) in every and cur.device.type != "meta" and (source is None or not source.provides(t.name)):
                    check_fits(t.name, cur, every[id(cur)])
        layouts = block_layouts(self.module, self.blocks, self.cfg.chunk_bytes, self.cfg.residency, cast)
        if first:
            _warn_rounded(self.cfg, layouts)
        with torch.inference_mode(False):
            # page-locked span by span while the blocks are written (a loader's reads overlap the locking)
            store = HostStore(store_bytes(layouts), pin=self.device.type == "cuda",
                              ranges=block_spans(layouts)) if self.cfg.streams else None
            try:
                self._non_block = fill(layouts, store, tensors, self.device, source)
                if store is not None:
                    store.wait()
            except BaseException:
                if store is not None:
                    store.release()
                raise
            self._park_versions = None
            place(self._non_block, self.device)
            if outside:  # their values were checked above (first) or come from fp8 (a re-layout)
                self._resident_cast = ResidentCasting(outside, fp8)
            if self.device.type == "cuda" and source is not None:
                torch.cuda.synchronize(self.device)
            self.layouts, self.store = layouts, store
            if self.cfg.streams:
                if cast and self.device.type == "cuda":
                    cast_kernel_name(self.device)  # pick (and compile) the cast kernel now, not in the first forward
                backend = CudaBackend(self.device) if self.device.type == "cuda" else CpuBackend()
                self.streamer = Streamer(layouts, store, self.device, backend,
                                         cast_on_copy=self.cfg.fp8_cast == "copy")
                self.streamer.fill_resident_and_start()
                self.hooks = [BlockHook(self, b.index, b.module) for b in layouts]
                self.writes.watch(layouts, self.streamer.host_views)
                fp8_anywhere = bool(cast) or bool(outside)
                self.writes.refuse_new = FP8_NO_NEW_MODULES if fp8_anywhere else None
                self.writes.refuse_in = {id(m) for m in self.module.modules()} if fp8_anywhere else set()
        self._configure()

    def _detach(self, to_host: bool) -> HostStore | None:
        """Stop streaming and watching. to_host: block tensors stay what they are between forwards (views of the
        old store, which is returned and must outlive them, or whatever replaced them since); else each goes back
        where it was before offload, with its current values, and the store is released."""
        if self._resident_cast is not None:  # the layers outside the blocks get their own dtype back first
            self._resident_cast.undo()
            self._resident_cast = None
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.writes.unwatch()
        if self.streamer is not None:
            self.streamer.release()
        self.streamer = None
        self.pacer = None
        if not to_host:
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
                import warnings

                warnings.warn(f"chunkflow: remove() could not give back {', '.join(lost[:5])}"
                              f"{' and more' if len(lost) > 5 else ''}: replaced while offloaded by tensors without "
                              "values; they are left as they are", stacklevel=3)
        store, self.store, self.layouts = self.store, None, []
        if to_host:
            return store
        if store is not None:
            store.release()
        return None

    def _origin_of(self, t) -> torch.device:
        return self._origin.get((id(t.owners[0][0]), t.owners[0][1]), self._home)

    def _block_compute_dtypes(self) -> dict[int, torch.dtype]:
        """id(tensor) -> compute dtype, for the block tensors stored in fp8 now."""
        return {id(current(e)): e.compute_dtype for b in self.layouts for e in b.tensors if e.compute_dtype}

    def _relayout(self, dtypes: dict[torch.dtype, torch.dtype] | None = None, device: torch.device | None = None
                  ) -> None:
        """Lay the blocks out again from the module as it is now (new tensors included), with `dtypes` applied to
        every tensor if given, on `device` if given. Host memory holds the old store and the new one for the time
        of the copy."""
        compute = self._block_compute_dtypes()
        with torch.inference_mode(False), torch.no_grad():
            old = self._detach(to_host=True)
            if device is not None:
                self.device = device
            if dtypes or compute:  # fp8-stored tensors become their compute dtype again (then stored anew)
                dtypes = dtypes or {}
                for t in all_tensors(self.module):
                    cur = t.get()
                    own = compute.get(id(cur), cur.dtype)
                    new = cur.to(dtypes.get(own, own))
                    if t.is_param:
                        bind_data(cur, new)
                    else:
                        t.set_buffer(new)
            self._attach()
            if old is not None:
                old.release()
        self.relayouts += 1

    # ---- forwards (the block hooks call these)

    def enter_block(self, l: int) -> None:
        if l == 0:  # a forward starts: carry writes made since the last one to the device
            self.sync()
        self.streamer.enter(l)

    def exit_block(self, l: int) -> None:
        self.streamer.exit(l)

    def sync(self) -> None:
        """Bring the device copies up to date with writes to the blocks since the last forward (writes.py)."""
        relayout, dirty = self.writes.collect()
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
        compute.update(self._resident_cast.compute if self._resident_cast is not None else {})
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
        if target is not None and target.type == "meta":
            discard(self)
            return self.module
        if target is not None:
            self._relayout(mapping, device=target)
            self._origin = {k: target for k in self._origin}  # remove() leaves it where it was moved
            self._home = target
            if self._park_store is not None:
                self._park_store.release()
                self._park_store = None
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
        """Pacer, collective wrappers and observers as the config and the attached observers ask."""
        s = self.streamer
        obs = None if not self.observers else (self.observers[0] if len(self.observers) == 1
                                                else Observers(self.observers))
        if s is not None:
            s.obs = obs
        self._obs = obs
        pace = (s is not None and self.cfg.mode == "chunkflow" and self.cfg.comm_aware and bool(s.ring)
                and dist_active())
        if pace and (self.pacer is None or self.pacer.s is not s):
            self.pacer = CommPacer(s)
        elif not pace:
            self.pacer = None
        if s is not None:
            s.pacer = self.pacer
        want_tap = dist_active() and (self.pacer is not None or obs is not None)
        if want_tap and self.tap is None:
            self.tap = CollectiveTap(self)
            self.tap.install()
        elif not want_tap and self.tap is not None:
            self.tap.remove()
            self.tap = None

    def collective_start(self, name: str) -> None:
        """Told by the tap before a collective: the pacer fences its chunks, then observers hear of it."""
        if self.pacer is not None:
            self.pacer.collective_start(name)
        if self._obs is not None:
            self._obs.collective_start(name)

    def collective_end(self, name: str) -> None:
        if self._obs is not None:
            self._obs.collective_end(name)
        if self.pacer is not None:
            self.pacer.collective_end(name)

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

    # ---- parking: models that take turns on the device (e.g. the two experts of Wan2.2-A14B)

    @property
    def parked(self) -> bool:
        return self._resume is not None

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
        if self.streamer is not None:
            self.streamer.release_device()
        views = self._park_views()
        with torch.no_grad(), torch.inference_mode(False):
            for t, host, version in zip(self._non_block, views, self._park_versions or [None] * len(views)):
                cur = t.get()
                if version is None or (cur._version, cur.data_ptr()) != version or cur.device == host.device:
                    host.copy_(cur.detach())
                if t.is_param:
                    cur.data = host
                else:
                    t.set_buffer(host)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._resume = self.module.register_forward_pre_hook(_unpark_before_forward)
        if "_hf_hook" not in self.module.__dict__:  # tell diffusers where this module's inputs go while parked
            self.module.__dict__["_hf_hook"] = ExecutionDevice(self.device)

    def _park_views(self) -> list[torch.Tensor]:
        """Host homes of the non-block tensors while parked: views of one host allocation (pinned on CUDA)."""
        sizes = [t.get().numel() * t.get().element_size() for t in self._non_block]
        offsets, total = [], 0
        for n in sizes:
            total = -(-total // 256) * 256
            offsets.append(total)
            total += n
        if self._park_store is None or self._park_store.nbytes != total:
            if self._park_store is not None:
                self._park_store.release()
            self._park_store = HostStore(total, pin=self.device.type == "cuda")
            self._park_versions = None
        out = []
        for t, off, n in zip(self._non_block, offsets, sizes):
            cur = t.get()
            out.append(self._park_store.view(off, n).view(cur.dtype).view(cur.shape))
        return out

    @_locked
    def unpark(self) -> None:
        """Take the device memory back after `park()` (the next forward does this by itself)."""
        if self._resume is None:
            return
        self._resume.remove()
        self._resume = None
        if isinstance(self.module.__dict__.get("_hf_hook"), ExecutionDevice):
            del self.module.__dict__["_hf_hook"]
        versions = []
        with torch.no_grad(), torch.inference_mode(False):
            for t in self._non_block:
                cur = t.get()
                dev = cur.detach().to(self.device, non_blocking=self.device.type == "cuda", copy=True)
                if t.is_param:
                    cur.data = dev
                else:
                    t.set_buffer(dev)
                versions.append((t.get()._version, t.get().data_ptr()))
        self._park_versions = versions
        if self.streamer is not None:
            with torch.inference_mode(False):  # a forward under inference_mode may unpark: normal tensors still
                self.streamer.acquire_device()

    # ---- reporting

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype fp8-stored weights are cast to for the forward (None without fp8 storage)."""
        if self.cfg.weight_dtype == "bf16":
            return None
        for b in self.layouts:
            for t in b.cast_tensors():
                return t.compute_dtype
        if self._resident_cast is not None and self._resident_cast.own:
            return next(iter(self._resident_cast.own.values()))
        return None

    def stats(self) -> OffloadStats:
        L = self.layouts
        V = sum(b.nbytes for b in L)
        R = sum(b.resident_bytes for b in L)
        s = self.streamer
        slot = s.slots[0].numel() if s is not None and s.slots else 0
        nb = sum(t.get().numel() * t.get().element_size() for t in self._non_block)
        cast_bytes = (s.cast_buffer.numel() + sum(b.numel() for b in s.slot_casts)) if s is not None else 0
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
            device_buffer_bytes=(s.resident.numel() + 2 * slot + cast_bytes) if s is not None else 0,
            forwards=s.forwards if s is not None else 0,
            h2d_bytes_issued=s.bytes_h2d if s is not None else 0,
            comm_aware=s is not None and s.pacer is not None,
            refreshes=self.refreshes,
            relayouts=self.relayouts,
            weight_dtype=self.cfg.weight_dtype,
            fp8_tensors=sum(len(b.cast_tensors()) for b in L) + (len(self._resident_cast.own)
                                                                 if self._resident_cast is not None else 0),
            cast_buffer_bytes=cast_bytes,
            fp8_cast_kernel=cast_kernel_name(self.device) if self.cfg.weight_dtype != "bf16" else "",
        )

    # ---- undo

    @_locked
    def remove(self) -> None:
        """Hooks off, every tensor back on its original device with its values (writes made while offloaded kept),
        host and device memory freed, the module's own class back."""
        if self.removed:
            return
        if self.depth or (self.streamer is not None and self.streamer.bound):
            raise OffloadError("handle.remove() was called inside a forward of the offloaded module (nothing was "
                               "changed); remove it between forwards")
        self.unpark()
        if any(b.cast_tensors() for b in self.layouts) or self._resident_cast is not None:
            import warnings

            warnings.warn("chunkflow: the weights were stored in fp8 while offloaded; remove() gives them back in "
                          "their own dtype with the fp8-rounded values (the originals were not kept). Load the "
                          "checkpoint again for the exact weights.", Fp8RoundedWeightsWarning, stacklevel=2)
        if self.tap is not None:  # the original collective functions back, exactly
            self.tap.remove()
        self.tap = self.pacer = None
        self.observers = []
        self.writes.uninstall()
        self._detach(to_host=False)
        place(self._non_block, None)
        if self._park_store is not None:
            self._park_store.release()
            self._park_store = None
        for t in all_tensors(self.module):  # tensors added while offloaded (e.g. LoRA) go where the module was
            cur = t.get()
            if (id(t.owners[0][0]), t.owners[0][1]) not in self._origin and cur.device != self._home:
                if t.is_param:
                    cur.data = cur.data.to(self._home)
                else:
                    t.set_buffer(cur.to(self._home))
        for m in self.parts:
            unhook_part(m)
        self.parts = []
        unhook_module(self.module)
        self.module.__dict__.pop(_MARK, None)
        self.removed = True


class ExecutionDevice:
    """Where a parked module's inputs must go, said the way diffusers asks (`get_module_execution_device` and a
    pipeline's `_execution_device` read `module._hf_hook.execution_device`, the attribute accelerate's offloading
    hooks carry): its weights sit in host memory until its forward takes them back. A plain marker: `detach_hook`
    lets accelerate's `remove_hook_from_module` take it off."""

    def __init__(self, device: torch.device):
        self.execution_device = device

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module


@torch.compiler.disable
def _unpark_before_forward(module: nn.Module, args) -> None:
    module.__dict__[_MARK].unpark()


def take_turns(*handles: OffloadHandle) -> "TurnTaking":
    """Let offloaded modules take turns on the device: before one runs a forward, the others are parked, so the
    device holds one of them at a time (its resident bytes, slots and non-block tensors) while host memory holds
    all. For models used one after the other, such as Wan2.2-A14B's two experts. They share one lock: a forward
    of one (parking the others first) waits for a forward of any of them in another thread. `.remove()` ends it."""
    shared = threading.RLock()
    for h in handles:
        h.lock = shared
    return TurnTaking(list(handles))


class TurnTaking:
    """The forward pre-hooks of `take_turns`."""

    def __init__(self, handles: list[OffloadHandle]):
        self.handles = handles
        self.hooks = [h.module.register_forward_pre_hook(self._before(h), prepend=True) for h in handles]

    def _before(self, mine: OffloadHandle):
        @torch.compiler.disable
        def park_others(module, args) -> None:
            for h in self.handles:
                if h is not mine:
                    h.park()

        return park_others

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for h in self.handles:  # each its own lock again
            h.lock = threading.RLock()


def discard(handle: OffloadHandle) -> None:
    """End a handle whose module is no longer needed, without putting anything back: hooks off, host stores
    released (no copy of the weights is made, unlike `remove()`), and every tensor of the module left on the meta
    device, so that using it fails loudly. For a program that built the module itself and is done with it."""
    if handle.removed:
        return
    if handle.tap is not None:
        handle.tap.remove()
    handle.tap = handle.pacer = None
    handle.writes.uninstall()
    handle.writes.unwatch()
    if handle._resume is not None:
        handle._resume.remove()
        handle._resume = None
    if handle._resident_cast is not None:
        handle._resident_cast.undo()
        handle._resident_cast = None
    if isinstance(handle.module.__dict__.get("_hf_hook"), ExecutionDevice):
        del handle.module.__dict__["_hf_hook"]
    for h in handle.hooks:
        h.remove()
    handle.hooks = []
    if handle.streamer is not None:
        handle.streamer.release()
        handle.streamer = None
    with torch.no_grad(), torch.inference_mode(False):
        for t in all_tensors(handle.module):
            cur = t.get()
            gone = torch.empty(cur.shape, dtype=cur.dtype, device="meta")
            if t.is_param:
                new = nn.Parameter(gone, requires_grad=False)
                for m, attr in t.owners:
                    m._parameters[attr] = new
            else:
                t.set_buffer(gone)
    for store in (handle.store, handle._park_store):
        if store is not None:
            store.release()
    handle.store = handle._park_store = None
    handle.layouts = []
    for m in handle.parts:
        unhook_part(m)
    handle.parts = []
    unhook_module(handle.module)
    handle.module.__dict__.pop(_MARK, None)
    handle.removed = True


def check_not_offloaded(module: nn.Module) -> None:
    if module.__dict__.get(_MARK) is not None:
        raise OffloadError("this module is already offloaded; call handle.remove() before offloading it again")


def _unwrap(module) -> nn.Module:
    """The module to offload: a torch.compile wrapper (OptimizedModule) is offloaded through its _orig_mod."""
    if not isinstance(module, nn.Module):
        hint = ("; offload its transformer: chunkflow.offload(pipe.transformer, ...)"
                if isinstance(getattr(module, "transformer", None), nn.Module) else "")
        raise OffloadError(f"offload() takes an nn.Module, got {type(module).__name__}{hint}")
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "OptimizedModule" else module


def _check_parameters(blocks: list[tuple[str, nn.Module]]) -> None:
    """Block parameters must be plain nn.Parameters (quantized or other parameter types cannot be streamed)."""
    for name, b in blocks:
        for pname, p in b.named_parameters(recurse=True):
            if type(p) is not nn.Parameter:
                raise OffloadError(f"parameter {name}.{pname} is a {type(p).__name__}, which chunkflow cannot stream "
                                   "(only plain nn.Parameter); offload a module without quantized or custom "
                                   "parameters")


def offload(module: nn.Module, config=None, *, plan=None, mode: str | None = None, chunk_size=None,
            residency: float | None = None, comm_aware: bool | None = None, weight_dtype: str | None = None,
            fp8_cast: str | None = None, device: str | torch.device | None = "cuda", blocks=None,
            source: TensorSource | None = None) -> OffloadHandle:
    """Stream `module`'s blocks from pinned host memory to `device`, one block ahead, in chunks.

    The setting: `config` (an OffloadConfig, a plan object or `plan.json` path, or a mode name) or `plan=`, and/or
    the keywords `mode` ('none' keeps all on the device, 'layerwise' copies whole blocks, 'chunkflow' copies
    chunks of `chunk_size` and keeps the first `residency` of each block resident), `comm_aware` (chunkflow under
    torch.distributed: keep chunk copies out of the model's collectives; call `init_distributed()` first),
    `weight_dtype` ('bf16', the default: the weights as they are; 'fp8_e4m3': the blocks' linear weights stored in
    float8 and cast back on the device before each block runs, as diffusers' `enable_layerwise_casting` does; lossy,
    halves host memory and copied bytes), `fp8_cast` (with fp8: 'compute', the default, casts each block on the
    compute stream before it runs; 'copy' casts it on the copy stream right after its copies, off the compute
    path, with a second block-sized cast buffer).
    Keywords override a config or plan. `blocks`: the block modules in execution order (default: from the catalog
    for the module's class). `device`: 'cuda' (default), 'cuda:1' or 'cpu' (same logic, synchronous copies).
    `source`: values for tensors on the meta device (loaders; see TensorSource). A torch.compile wrapper is
    offloaded through the module it wraps.
    """
    module = _unwrap(module)
    check_not_offloaded(module)
    cfg = resolve_config(config, plan=plan, module=module, mode=mode, chunk_size=chunk_size, residency=residency,
                         comm_aware=comm_aware, weight_dtype=weight_dtype, fp8_cast=fp8_cast)
    dev = resolve_device(device)
    named = resolve_blocks(module, blocks) if cfg.streams else []
    _check_parameters(named)
    if cfg.streams:
        check_no_layerwise_casting(module)
    handle = OffloadHandle(module, cfg, dev, named)
    handle._attach(source, first=True)
    if cfg.streams:
        hook_module(module, handle, root=True)  # .to() and copies go through the handle
        handle.parts = [m for m in module.modules() if m is not module]
        for m in handle.parts:  # ... and a part's own .to() too (refused: the handle owns device and dtypes)
            hook_part(m, handle)
        handle.writes.install()
    module.__dict__[_MARK] = handle
    return handle
