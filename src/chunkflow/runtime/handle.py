"""`offload()` and `OffloadHandle`: validate, lay out, fill the host store, start the ring; `remove()` undoes it.

Every check runs before the module is touched, so a bad argument leaves it exactly as it was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from chunkflow.runtime.comm import CollectiveTap, CommPacer, EventLog, dist_active
from chunkflow.runtime.hooks import BlockHook
from chunkflow.runtime.layout import BlockLayout, block_layouts, store_bytes
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.streamer import ChunkCopy, CpuBackend, CudaBackend, Gate, Streamer, bind, current, never_wait

MODES = ("none", "layerwise", "chunkflow")
_MARK = "_chunkflow_handle"


class OffloadError(ValueError):
    """A request chunkflow cannot carry out; the message says what was wrong and what to do."""


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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HandleConfig:
    """What one handle was asked for, validated: mode, chunk bytes, residency, device, communication awareness."""

    mode: str
    chunk_bytes: int | None
    residency: float
    device: torch.device
    comm_aware: bool = True  # chunkflow: pace chunks around collectives (ignored without torch.distributed)


# ----------------------------------------------------------------------------------------- validation


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OffloadError(f"device {device!r} is not a torch device ({exc}); use 'cuda', 'cuda:1' or 'cpu'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(
                f"device {str(device)!r} requested but CUDA is not available on this machine; "
                "pass device='cpu' to run the same logic on host memory"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise OffloadError(f"device {str(device)!r} is not supported; use 'cuda' or 'cpu'")
    return dev


def parse_chunk(chunk_size) -> int:
    from chunkflow_planner.units import parse_size

    if isinstance(chunk_size, bool) or chunk_size is None:
        raise OffloadError(f"chunk size {chunk_size!r} is not a size; give bytes or a string like '16MB'")
    try:
        n = parse_size(chunk_size)
    except (ValueError, TypeError) as exc:
        raise OffloadError(f"chunk size {chunk_size!r} cannot be parsed ({exc}); give bytes or e.g. '16MB'") from None
    if n <= 0:
        raise OffloadError(f"chunk size {chunk_size!r} must be positive; 4MB-64MB is a good range")
    return int(n)


def make_config(mode: str, chunk_size, residency, device, plan=None, module: nn.Module | None = None,
                comm_aware: bool = True) -> HandleConfig:
    if plan is not None:
        mode, chunk_size, residency, comm_aware = _from_plan(plan, module)
    if mode not in MODES:
        raise OffloadError(f"mode {mode!r} is unknown; use one of {', '.join(MODES)}")
    try:
        r = float(residency)
    except (TypeError, ValueError):
        raise OffloadError(f"residency {residency!r} is not a number; give a fraction in [0, 1]") from None
    if not 0.0 <= r <= 1.0:
        raise OffloadError(f"residency {residency!r} is outside [0, 1]; 0 streams every byte, 1 keeps all on the device")
    chunk: int | None = None
    if mode == "chunkflow":
        chunk = parse_chunk(chunk_size)
    elif mode == "layerwise" and r != 0.0:
        raise OffloadError("layerwise mode streams whole blocks with no residency; use mode='chunkflow' for residency")
    return HandleConfig(mode, chunk, r if mode == "chunkflow" else (1.0 if mode == "none" else 0.0),
                         resolve_device(device), bool(comm_aware))


def _from_plan(plan, module):
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.plan import load_plan

    try:
        p = load_plan(plan if not isinstance(plan, (str, Path)) else Path(plan))
    except ValueError as exc:
        raise OffloadError(str(exc)) from None
    try:
        spec = get_model(p.model.name)
    except ValueError as exc:
        raise OffloadError(f"the plan's model {p.model.name!r} is not in the catalog: {exc}") from None
    cls = type(module).__name__
    if spec.diffusers.cls != cls:
        raise OffloadError(
            f"the plan is for {p.model.name} ({spec.diffusers.cls}) but the module is a {cls}; "
            "write a plan for this model with `chunkflow plan`"
        )
    if p.offload.mode == "chunkflow" and p.offload.chunk_bytes is None:
        raise OffloadError("the plan's offload.mode is chunkflow but offload.chunk_bytes is missing; re-plan")
    return p.offload.mode, p.offload.chunk_bytes, p.offload.residency, getattr(p.offload, "comm_aware", True)


def resolve_blocks(module: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """(name, block) pairs in execution order, from `blocks=` or the catalog adapter."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    if blocks is None:
        from chunkflow.models.adapters import find_blocks

        try:
            blocks = find_blocks(module)
        except LookupError as exc:
            raise OffloadError(str(exc)) from None
    flat: list[nn.Module] = []
    for b in blocks:
        flat.extend(b if isinstance(b, nn.ModuleList) else [b])
    out = []
    seen: set[int] = set()
    for b in flat:
        if not isinstance(b, nn.Module):
            raise OffloadError(f"blocks must be nn.Modules (or ModuleLists); got {type(b).__name__}")
        if id(b) not in names or b is module:
            raise OffloadError("every block must be a submodule of the offloaded module (and not the module itself)")
        if id(b) in seen:
            raise OffloadError(f"block {names[id(b)]!r} is listed twice")
        seen.add(id(b))
        out.append((names[id(b)], b))
    if not out:
        raise OffloadError("no blocks to offload; pass blocks=[...] with the transformer's block modules")
    inner = {id(m) for _, b in out for m in list(b.modules())[1:]}
    for n, b in out:
        if id(b) in inner:
            raise OffloadError(f"block {n!r} is inside another listed block; list disjoint blocks")
    return out


def _all_tensors(module: nn.Module):
    """Each distinct tensor of the module once: (tensor, owners, is_param)."""
    found: dict[int, tuple[torch.Tensor, list, bool]] = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), (p, [], True))[1].append((m, attr))
        for attr, b in m._buffers.items():
            if b is not None:
                found.setdefault(id(b), (b, [], False))[1].append((m, attr))
    return list(found.values())


# ----------------------------------------------------------------------------------------- the handle


class OffloadHandle:
    """State of one offloaded module. Build with `offload()` (or `models.build`); undo with `remove()`."""

    def __init__(self, module: nn.Module, cfg: HandleConfig, layouts: list[BlockLayout], store: HostStore | None,
                 gate: Gate | None = None, record_chunks: bool = False, record_events: bool = False):
        self.module = module
        self.cfg = cfg
        self.layouts = layouts
        self.store = store
        self.chunk_log: list[ChunkCopy] | None = [] if record_chunks else None
        self.hooks: list[BlockHook] = []
        self.streamer: Streamer | None = None
        self._gate = gate or never_wait
        self.event_log: EventLog | None = EventLog(cfg.device.type == "cuda") if record_events else None
        self.pacer: CommPacer | None = None  # listener of the tap: paces chunks (aware) and/or logs collectives
        self.tap: CollectiveTap | None = None  # the collective wrappers this handle owns while it lives
        block_ids = {id(current(t)) for b in layouts for t in b.tensors}
        # Non-block tensors: everything else, moved to the device and resident. Remember where each was.
        self._non_block = [(t, owners, is_param, t.device) for t, owners, is_param in _all_tensors(module)
                           if id(t) not in block_ids]
        self._block_orig_device = {id(t): current(t).device for b in layouts for t in b.tensors}
        self.removed = False

    # ---- start-up, called once by offload() or the builder

    def _place_non_block(self, original: bool = False) -> None:
        """Non-block tensors to the offload device (start-up) or back where each was (remove)."""
        for _, owners, is_param, orig in self._non_block:
            m0, a0 = owners[0]
            cur = m0._parameters[a0] if is_param else m0._buffers[a0]
            dev = orig if original else self.cfg.device
            if is_param:
                cur.data = cur.data.to(dev)
            else:
                moved = cur.to(dev)
                for m, attr in owners:
                    m._buffers[attr] = moved

    def _start(self) -> None:
        self._place_non_block()
        if self.cfg.mode != "none":
            backend = CudaBackend(self.cfg.device) if self.cfg.device.type == "cuda" else CpuBackend()
            self.streamer = Streamer(self.layouts, self.store, self.cfg.device, backend, self._gate, self.chunk_log)
            self.streamer.fill_resident_and_start()
            self.hooks = [BlockHook(self.streamer, b.index, b.module) for b in self.layouts if b.is_streamed]
            self.streamer.events = self.event_log
            self._configure_comm()
        setattr(self.module, _MARK, True)

    # ---- communication awareness (runtime/comm.py)

    def _configure_comm(self) -> None:
        """Pacer and collective wrappers as the config and the event log ask; none without torch.distributed."""
        s = self.streamer
        if s is None:
            return
        aware = self.cfg.comm_aware and self.cfg.mode == "chunkflow" and bool(s.ring)
        want = dist_active() and (aware or self.event_log is not None)
        if not want:
            if self.tap is not None:
                self.tap.remove()
            self.tap = self.pacer = None
            s.pacer = None
            return
        if self.pacer is None:
            self.pacer = CommPacer(s, aware, self.event_log)
        self.pacer.aware = aware
        self.pacer.log = self.event_log
        s.pacer = self.pacer if aware else None
        if self.tap is None:
            self.tap = CollectiveTap(self.pacer)
            self.tap.install()

    def set_comm_aware(self, aware: bool) -> None:
        """Switch communication awareness (chunkflow mode); takes effect at the next block boundary."""
        from dataclasses import replace

        self.cfg = replace(self.cfg, comm_aware=bool(aware))
        self._configure_comm()

    def set_event_log(self, on: bool) -> EventLog | None:
        """Start (a fresh) or stop the event log of copies, collectives and stream waits; returns it."""
        self.event_log = EventLog(self.cfg.device.type == "cuda") if on else None
        if self.streamer is not None:
            self.streamer.events = self.event_log
            self.streamer.free_mark = [-1, -1]  # marks belong to one log; older ones precede this log
        if self.pacer is not None and self.pacer.need_wait is not None:
            self.pacer.need_wait = (self.pacer.need_wait[0], -1)
        self._configure_comm()
        return self.event_log

    # ---- yield point

    def set_gate(self, gate: Gate | None) -> None:
        """gate(block, start, end) -> event or None, asked before each H2D chunk (the yield point)."""
        self._gate = gate or never_wait
        if self.streamer is not None:
            self.streamer.issuer.gate = self._gate

    # ---- reporting

    def stats(self) -> OffloadStats:
        L = self.layouts
        V = sum(b.nbytes for b in L)
        R = sum(b.resident_bytes for b in L)
        s = self.streamer
        slot = s.slots[0].numel() if s is not None and s.slots else 0
        nb = 0
        for t, owners, is_param, _ in self._non_block:
            m, attr = owners[0]
            cur = m._parameters[attr] if is_param else m._buffers[attr]
            nb += cur.numel() * cur.element_size()
        return OffloadStats(
            mode=self.cfg.mode,
            device=str(self.cfg.device),
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
            device_buffer_bytes=(s.resident.numel() + 2 * slot) if s is not None else 0,
            forwards=s.forwards if s is not None else 0,
            h2d_bytes_issued=s.issuer.bytes_h2d if s is not None else 0,
            comm_aware=s is not None and s.pacer is not None,
        )

    # ---- undo

    def remove(self) -> None:
        """Hooks off, every tensor back on its original device with its values, host and device memory freed."""
        if self.removed:
            return
        if self.tap is not None:  # the original collective functions back, exactly
            self.tap.remove()
        self.tap = self.pacer = None
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.streamer is not None:
            self.streamer.release()
        for b in self.layouts:
            for t in b.tensors:
                dev = self._block_orig_device[id(t)]
                dev = torch.device("cpu") if dev.type == "meta" else dev
                src = self.store.view(b.host_offset + t.offset, t.nbytes).view(t.dtype).view(t.shape)
                bind(t, src.to(dev, copy=True))
        self._place_non_block(original=True)
        if self.store is not None:
            self.store.release()
        self.streamer = None
        if hasattr(self.module, _MARK):
            delattr(self.module, _MARK)
        self.removed = True


def check_not_offloaded(module: nn.Module) -> None:
    if getattr(module, _MARK, False):
        raise OffloadError("this module is already offloaded; call handle.remove() before offloading it again")


def offload(module: nn.Module, mode: str = "chunkflow", chunk_size="16MB", residency: float = 0.0,
            device: str | torch.device = "cuda", blocks=None, plan=None, gate: Gate | None = None,
            record_chunks: bool = False, comm_aware: bool = True, record_events: bool = False) -> OffloadHandle:
    """Stream `module`'s blocks from pinned host memory to `device`, one block ahead, in chunks.

    mode: 'none' (all on the device), 'layerwise' (whole block per copy) or 'chunkflow' (chunks of `chunk_size`,
    the first `residency` of each block kept on the device). `plan` (a path or Plan) sets mode, chunk size and
    residency. `blocks`: the block modules in execution order (default: from the catalog for the module's class).
    comm_aware (chunkflow mode, under torch.distributed): keep chunk copies out of the model's collectives by
    pacing them into the compute windows between them (runtime/comm.py); the plan's `offload.comm_aware`
    overrides it. Call `init_distributed()` before offloading. record_events: keep an EventLog
    (`handle.event_log`) of copies, collectives and stream waits, for tests and evidence.
    """
    if not isinstance(module, nn.Module):
        raise OffloadError(f"offload() takes an nn.Module, got {type(module).__name__}")
    check_not_offloaded(module)
    cfg = make_config(mode, chunk_size, residency, device, plan, module, comm_aware)
    named = resolve_blocks(module, blocks) if cfg.mode != "none" else []
    if any(t.device.type == "meta" for t, *_ in _all_tensors(module)):
        raise OffloadError("the module has tensors on the meta device (no values); "
                           "build it with chunkflow.models.build.build_transformer or load real weights first")
    layouts = block_layouts(module, named, cfg.chunk_bytes, cfg.residency)
    store = None
    if cfg.mode != "none":
        store = HostStore(store_bytes(layouts), pin=cfg.device.type == "cuda")
    handle = OffloadHandle(module, cfg, layouts, store, gate, record_chunks, record_events)
    if store is not None:
        for b in layouts:  # copy each block tensor into the store, then drop the original
            for t in b.tensors:
                cur = current(t)
                store.view(b.host_offset + t.offset, t.nbytes).view(t.dtype).view(t.shape).copy_(cur.detach())
                bind(t, torch.empty(0, dtype=t.dtype))
    handle._start()
    return handle
