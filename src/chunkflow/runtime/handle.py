"""`offload()` and `OffloadHandle`: the one way to attach chunkflow to a module; `remove()` undoes it.

`offload(module, config)` takes an OffloadConfig, a plan (object or file) or keywords, lays the module's blocks
out, writes their bytes into one host store, places everything else on the device and starts the ring. Model
builders and loaders go through the same call, with a `TensorSource` that fills tensors a module holds on the meta
device. Every check runs before the module is touched, so a bad argument leaves it exactly as it was.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Iterator, Protocol

import torch
from torch import nn

from chunkflow.runtime.comm import CollectiveTap, CommPacer, dist_active
from chunkflow.runtime.hooks import BlockHook
from chunkflow.runtime.layout import BlockLayout, block_layouts, store_bytes
from chunkflow.runtime.observe import Observer, Observers
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.streamer import CpuBackend, CudaBackend, Streamer, bind, current
from chunkflow_planner.offload import MODES, OffloadConfig, OffloadConfigError

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


class TensorSource(Protocol):
    """Values for a module whose tensors are (partly) on the meta device: what loaders give `offload(source=...)`.

    `provides(name)`: whether the source has a value for the tensor of that dotted name (it then overrides the
    module's own value; a meta tensor must be provided). `fill(name, module, attr, out)` writes it into `out`,
    a tensor of the final shape and dtype in its final home (host store or device)."""

    def provides(self, name: str) -> bool: ...

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None: ...


# ----------------------------------------------------------------------------------------- validation


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch.device to offload to; None: the current CUDA device if there is one, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OffloadError(f"device {device!r} is not a torch device ({exc}); use 'cuda', 'cuda:1' or 'cpu'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(f"device {str(device)!r} requested but CUDA is not available on this machine; "
                               "use device 'cpu' to run the same logic on host memory")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise OffloadError(f"device {str(device)!r} is not supported; use 'cuda' or 'cpu'")
    return dev


def _plan_config(plan, module: nn.Module) -> OffloadConfig:
    """A plan's offload setting, after checking that the plan was made for this module's model."""
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.plan import Plan, load_plan

    try:
        p = plan if isinstance(plan, Plan) else load_plan(plan)
    except (ValueError, TypeError) as exc:
        raise OffloadError(str(exc)) from None
    try:
        spec = get_model(p.model.name)
    except ValueError as exc:
        raise OffloadError(f"the plan's model {p.model.name!r} is not in the catalog: {exc}") from None
    cls = type(module).__name__
    if spec.diffusers.cls != cls:
        raise OffloadError(f"the plan is for {p.model.name} ({spec.diffusers.cls}) but the module is a {cls}; "
                           "write a plan for this model with `chunkflow plan`")
    return p.offload


def resolve_config(config=None, *, plan=None, module: nn.Module | None = None, mode: str | None = None,
                   chunk_size=None, residency: float | None = None,
                   comm_aware: bool | None = None) -> OffloadConfig:
    """The OffloadConfig to run: `config` (an OffloadConfig, a plan or plan file, or a mode name) or `plan`, with
    any keyword laid over it; keywords alone build one. Plans are checked against `module`."""
    if config is not None and plan is not None:
        raise OffloadError("give the offload setting once: a config or plan as the second argument, or plan=")
    if isinstance(config, str) and config in MODES:
        config, mode = None, mode or config
    source = config if config is not None else plan
    try:
        if isinstance(source, OffloadConfig):
            base = source
        elif source is not None:
            base = _plan_config(source, module)
        else:
            return OffloadConfig(mode or "chunkflow", chunk_size, residency,
                                 True if comm_aware is None else comm_aware)
        return base.with_overrides(mode, chunk_size, residency, comm_aware)
    except OffloadConfigError as exc:
        raise OffloadError(str(exc)) from None


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


@dataclass
class _Tensor:
    """One distinct tensor of the module: its first dotted name, every (module, attribute) holding it, its kind and
    the device it was on before offload."""

    name: str
    owners: list[tuple[nn.Module, str]]
    is_param: bool
    device: torch.device

    def get(self) -> torch.Tensor:
        m, attr = self.owners[0]
        return m._parameters[attr] if self.is_param else m._buffers[attr]

    def set_buffer(self, value: torch.Tensor) -> None:
        for m, attr in self.owners:
            m._buffers[attr] = value


def _all_tensors(module: nn.Module) -> list[_Tensor]:
    """Each distinct tensor of the module once, in module order (parameters, then buffers, of each module)."""
    found: dict[int, _Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), _Tensor(f"{prefix}.{attr}" if prefix else attr, [], True, p.device))
                found[id(p)].owners.append((m, attr))
        for attr, b in m._buffers.items():
            if b is not None:
                found.setdefault(id(b), _Tensor(f"{prefix}.{attr}" if prefix else attr, [], False, b.device))
                found[id(b)].owners.append((m, attr))
    return list(found.values())


def _check_values(tensors: list[_Tensor], source: TensorSource | None) -> None:
    """Every meta tensor must get its values from the source."""
    missing = [t.name for t in tensors if t.device.type == "meta" and (source is None or not source.provides(t.name))]
    if missing:
        raise OffloadError(f"the module has tensors on the meta device (no values), e.g. {', '.join(missing[:3])}; "
                           "load real weights first, or build it with chunkflow.models.build.build_transformer")


# ----------------------------------------------------------------------------------------- the handle


class OffloadHandle:
    """State of one offloaded module. Made by `offload()`; undo with `remove()`."""

    def __init__(self, module: nn.Module, cfg: OffloadConfig, device: torch.device, layouts: list[BlockLayout],
                 store: HostStore | None, non_block: list[_Tensor], block_devices: dict[int, torch.device]):
        self.module = module
        self.cfg = cfg
        self.device = device
        self.layouts = layouts
        self.store = store
        self._non_block = non_block
        self._block_orig_device = block_devices
        self.hooks: list[BlockHook] = []
        self.streamer: Streamer | None = None
        self.pacer: CommPacer | None = None  # paces chunks around collectives (chunkflow, comm_aware, SP)
        self.tap: CollectiveTap | None = None  # the collective wrappers this handle owns while it lives
        self.observers: list[Observer] = []
        self._obs: Observer | None = None
        self.removed = False

    def _start(self) -> None:
        if self.cfg.streams:
            backend = CudaBackend(self.device) if self.device.type == "cuda" else CpuBackend()
            with torch.inference_mode(False):
                self.streamer = Streamer(self.layouts, self.store, self.device, backend)
                self.streamer.fill_resident_and_start()
            self.hooks = [BlockHook(self.streamer, b.index, b.module) for b in self.layouts if b.is_streamed]
        self._configure()
        setattr(self.module, _MARK, True)

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
        if pace and self.pacer is None:
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

    # ---- reporting

    def stats(self) -> OffloadStats:
        L = self.layouts
        V = sum(b.nbytes for b in L)
        R = sum(b.resident_bytes for b in L)
        s = self.streamer
        slot = s.slots[0].numel() if s is not None and s.slots else 0
        nb = sum(t.get().numel() * t.get().element_size() for t in self._non_block)
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
            device_buffer_bytes=(s.resident.numel() + 2 * slot) if s is not None else 0,
            forwards=s.forwards if s is not None else 0,
            h2d_bytes_issued=s.bytes_h2d if s is not None else 0,
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
        self.observers = []
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.streamer is not None:
            self.streamer.release()
        for b in self.layouts:
            for t in b.tensors:
                dev = self._block_orig_device[id(t)]
                src = self.store.view(b.host_offset + t.offset, t.nbytes).view(t.dtype).view(t.shape)
                bind(t, src.to(dev, copy=True))
        _place(self._non_block, None)
        if self.store is not None:
            self.store.release()
        self.streamer = None
        if hasattr(self.module, _MARK):
            delattr(self.module, _MARK)
        self.removed = True


def _home(device: torch.device) -> torch.device:
    """Where a tensor goes back to at remove(): its original device, the CPU for one that had no values (meta)."""
    return torch.device("cpu") if device.type == "meta" else device


def _place(tensors: list[_Tensor], device: torch.device | None) -> None:
    """Non-block tensors to `device` (start-up), or back where each was (None: remove)."""
    for t in tensors:
        cur = t.get()
        dev = _home(t.device) if device is None else device
        if t.is_param:
            cur.data = cur.data.to(dev)
        else:
            t.set_buffer(cur.to(dev))


def check_not_offloaded(module: nn.Module) -> None:
    if getattr(module, _MARK, False):
        raise OffloadError("this module is already offloaded; call handle.remove() before offloading it again")


def _unwrap(module) -> nn.Module:
    """The module to offload: a torch.compile wrapper (OptimizedModule) is offloaded through its _orig_mod."""
    if not isinstance(module, nn.Module):
        raise OffloadError(f"offload() takes an nn.Module, got {type(module).__name__}")
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "OptimizedModule" else module


def _real_parameter(t: _Tensor) -> None:
    """Give a meta Parameter a real (empty) one in its place, for every owner, so its data can be bound."""
    old = t.get()
    new = nn.Parameter(torch.empty(0, dtype=old.dtype), requires_grad=old.requires_grad)
    for m, attr in t.owners:
        m._parameters[attr] = new


def _fill(module: nn.Module, layouts: list[BlockLayout], store: HostStore | None, tensors: list[_Tensor],
          device: torch.device, source: TensorSource | None) -> list[_Tensor]:
    """Write every tensor into its home, in module order: block tensors into the host store, the rest onto the
    device. Values come from `source` where it provides them, else from the tensor. Returns the non-block tensors."""
    where = {id(current(e)): (b, e) for b in layouts for e in b.tensors}
    non_block: list[_Tensor] = []
    with torch.no_grad(), torch.inference_mode(False):
        for t in tensors:
            cur = t.get()
            m0, a0 = t.owners[0]
            from_source = source is not None and (cur.device.type == "meta" or source.provides(t.name))
            if t.is_param and cur.device.type == "meta":
                _real_parameter(t)
            hit = where.get(id(cur))
            if hit is not None:
                b, e = hit
                dst = store.view(b.host_offset + e.offset, e.nbytes).view(e.dtype).view(e.shape)
                if from_source:
                    source.fill(t.name, m0, a0, dst)
                else:
                    dst.copy_(cur.detach())
                bind(e, torch.empty(0, dtype=e.dtype))
                continue
            non_block.append(t)
            if from_source:
                real = torch.empty(cur.shape, dtype=cur.dtype, device=device)
                source.fill(t.name, m0, a0, real)
                if t.is_param:
                    t.get().data = real
                else:
                    t.set_buffer(real)
    return non_block


def offload(module: nn.Module, config=None, *, plan=None, mode: str | None = None, chunk_size=None,
            residency: float | None = None, comm_aware: bool | None = None,
            device: str | torch.device | None = "cuda", blocks=None,
            source: TensorSource | None = None) -> OffloadHandle:
    """Stream `module`'s blocks from pinned host memory to `device`, one block ahead, in chunks.

    The setting: `config` (an OffloadConfig, a plan object or `plan.json` path, or a mode name) or `plan=`, and/or
    the keywords `mode` ('none' keeps all on the device, 'layerwise' copies whole blocks, 'chunkflow' copies
    chunks of `chunk_size` and keeps the first `residency` of each block resident), `comm_aware` (chunkflow under
    torch.distributed: keep chunk copies out of the model's collectives; call `init_distributed()` first).
    Keywords override a config or plan. `blocks`: the block modules in execution order (default: from the catalog
    for the module's class). `device`: 'cuda' (default), 'cuda:1' or 'cpu' (same logic, synchronous copies).
    `source`: values for tensors on the meta device (loaders; see TensorSource).
    """
    module = _unwrap(module)
    check_not_offloaded(module)
    cfg = resolve_config(config, plan=plan, module=module, mode=mode, chunk_size=chunk_size, residency=residency,
                         comm_aware=comm_aware)
    dev = resolve_device(device)
    named = resolve_blocks(module, blocks) if cfg.streams else []
    tensors = _all_tensors(module)
    _check_values(tensors, source)
    layouts = block_layouts(module, named, cfg.chunk_bytes, cfg.residency)
    block_devices = {id(e): _home(current(e).device) for b in layouts for e in b.tensors}
    with torch.inference_mode(False):
        store = HostStore(store_bytes(layouts), pin=dev.type == "cuda") if cfg.streams else None
    non_block = _fill(module, layouts, store, tensors, dev, source)
    _place(non_block, dev)
    if dev.type == "cuda" and source is not None:
        torch.cuda.synchronize(dev)
    handle = OffloadHandle(module, cfg, dev, layouts, store, non_block, block_devices)
    handle._start()
    return handle
