"""Batched classifier-free guidance: a step's conditional and unconditional transformer forwards as one forward of
the doubled batch, so an offloaded transformer streams each block once a step instead of once per guidance pass.

Two ways in:
- `stack_passes` / `split_passes`: for code that builds the passes' inputs itself (`chunkflow run`'s synthetic
  steps): the per-pass keyword arguments concatenated along the batch, the output split back.
- `batch_cfg(pipe)`: for a diffusers pipeline that calls its transformer once per guidance pass (WanPipeline,
  QwenImagePipeline, ...). It records the tensors the pipeline's `encode_prompt` returns for the positive and the
  negative prompt (embeddings, and pooled embeddings, masks or ids where the pipeline has them); when the
  transformer is called with one prompt's, it runs both passes in one forward (each of this prompt's tensors
  replaced by the other prompt's; texts of different lengths are zero-padded and masked, for models that take
  `encoder_hidden_states_mask`) and keeps the other half. The other pass's call gets that half only if it goes to
  the same transformer with exactly the arguments it was computed with (tensors compared by value, and unchanged
  in place since); any other call runs normally. So a pipeline that does something else between its passes is slower, never wrong. A transformer with
a diffusers hook that keeps state (caching, with `enable_cache` or `diffusers.hooks.apply_*`) is not batched; one
under diffusers' stateless hooks (context parallelism: `chunkflow run --prompt` under torchrun) is, through them.

Batched kernels may round differently from batch-1 kernels in the last bits; padded text goes through masked
attention. docs/levers.md states the measured difference; the tests hold tiny pipelines to it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from chunkflow_planner.errors import ChunkflowError

TEXT_KEYS = ("encoder_hidden_states", "encoder_hidden_states_mask")


class CfgBatchingError(ChunkflowError):
    """A pipeline or call batched CFG cannot serve; the message says why."""


# ---------------------------------------------------------------------------------------------- kwargs


def _equal(a: Any, b: Any) -> bool:
    """Values equal: tensors by identity (a change in place is the snapshot's to see), else shape, dtype, device
    and elements; containers element-wise."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==: unequal unless identical
        return False


def stack_passes(passes: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The keyword arguments of one forward that evaluates every pass: tensors whose first dimension is the batch
    (and lists of one entry per sample) concatenated in pass order; everything else must be equal across passes."""
    out: dict[str, Any] = {}
    for key in passes[0]:
        values = [p[key] for p in passes]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == batch:
            if any(not isinstance(v, torch.Tensor) or v.shape[1:] != first.shape[1:] for v in values):
                raise CfgBatchingError(f"{key} differs in shape between the guidance passes; cannot batch them")
            out[key] = torch.cat(values, dim=0)
        elif isinstance(first, list) and len(first) == batch and batch > 0:
            out[key] = [x for v in values for x in v]
        else:
            if any(not _equal(v, first) for v in values[1:]):
                raise CfgBatchingError(f"{key} differs between the guidance passes and has no batch dimension")
            out[key] = first
    return out


def split_passes(output: Any, n: int) -> list[Any]:
    """A batched forward's output as n per-pass outputs: the sample (a tuple's first item, or `.sample`) split along
    the batch; other items kept as they are."""
    if isinstance(output, torch.Tensor):
        return list(output.chunk(n, dim=0))
    if isinstance(output, tuple):
        return [(part, *output[1:]) for part in output[0].chunk(n, dim=0)]
    if dataclasses.is_dataclass(output) and hasattr(output, "sample"):
        return [dataclasses.replace(output, sample=part) for part in output.sample.chunk(n, dim=0)]
    raise CfgBatchingError(f"cannot split a transformer output of type {type(output).__name__} by guidance pass")


def _pad_text(embeds: list[torch.Tensor], masks: list[torch.Tensor | None]) -> tuple[list, list]:
    """Texts of different lengths zero-padded at the end to the longest, with masks marking the real tokens."""
    longest = max(e.shape[1] for e in embeds)
    out_e, out_m = [], []
    for e, m in zip(embeds, masks):
        n = e.shape[1]
        mask = m if m is not None else torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
        if n < longest:
            e = torch.cat([e, e.new_zeros(e.shape[0], longest - n, *e.shape[2:])], dim=1)
            mask = torch.cat([mask, mask.new_zeros(mask.shape[0], longest - n)], dim=1)
        out_e.append(e)
        out_m.append(mask)
    return out_e, out_m


# ---------------------------------------------------------------------------------------------- pipelines


def _tensors_in(value: Any):
    """Every tensor inside a keyword value (tensors, lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


class _Snapshot:
    """The state of a call's tensors, and of the model's weights, when a half was computed for it: version counters
    (a clone for inference-mode inputs, which have none) and storage, so that a change made in place since then is
    seen even on the very same object."""

    def __init__(self, kwargs: dict[str, Any], module: nn.Module):
        self.items = [(t, t.detach().clone() if t.is_inference() else t._version)
                      for v in kwargs.values() for t in _tensors_in(v)]
        self.weights = self._weights(module)
        self.module = module

    @staticmethod
    def _weights(module: nn.Module) -> list[tuple[int, int, int]]:
        out = []
        for t in list(module.parameters()) + list(module.buffers()):
            out.append((id(t), -1 if t.is_inference() else t._version, t.data_ptr()))
        return out

    def unchanged(self) -> bool:
        for t, seen in self.items:
            if isinstance(seen, torch.Tensor):
                if not (t.shape == seen.shape and bool(torch.equal(t, seen))):
                    return False
            elif t._version != seen:
                return False
        return self._weights(self.module) == self.weights


@dataclass
class _Pending:
    module: nn.Module  # the transformer that computed it (Wan2.2-A14B has two)
    kwargs: dict[str, Any]  # the call its half answers
    snapshot: _Snapshot
    output: Any

    def answers(self, module: nn.Module, kwargs: dict[str, Any]) -> bool:
        return module is self.module and self.snapshot.unchanged() and _equal(self.kwargs, kwargs)


@dataclass
class CfgStats:
    batched_forwards: int = 0  # forwards that evaluated both passes
    served: int = 0  # calls answered with the other half of a batched forward
    unbatched: int = 0  # calls that ran as they were (no known partner, or arguments that did not match)
    discarded: int = 0  # halves computed but not asked for as computed


def _stateful_hooks(module: nn.Module) -> bool:
    """Whether diffusers' caching is on, or any diffusers hook that keeps state sits on the model (applied with
    `enable_cache` or straight with `diffusers.hooks.apply_*`): its state advances per call, so a batched forward
    would change what it computes."""
    if getattr(module, "is_cache_enabled", False):
        return True
    for m in module.modules():
        registry = m.__dict__.get("_diffusers_hook")
        hooks = getattr(registry, "hooks", None)
        if hooks and any(getattr(h, "_is_stateful", True) for h in hooks.values()):
            return True
    return False


def _diffusers_hooked(module: nn.Module, forward: Any) -> bool:
    """Whether the instance's `forward` is the one diffusers' hooks installed on it (a HookRegistry's: context
    parallelism's split and gather, `enable_parallelism`): batch_cfg wraps it, so a batched forward goes through
    those hooks as either pass would (the batch dimension is not the one they split); a stateful one is left
    unbatched at each call (`_stateful_hooks`)."""
    registry = module.__dict__.get("_diffusers_hook")
    return (registry is not None and bool(getattr(registry, "hooks", None)) and isinstance(forward, functools.partial)
            and bool(forward.args) and forward.args[0] is module)


def _installer(forward: Any) -> str:
    """Who put an instance `forward` there, in words: the function behind it (a partial's too) and its module."""
    func = forward.func if isinstance(forward, functools.partial) else forward
    name = getattr(func, "__qualname__", type(func).__name__)
    where = getattr(func, "__module__", None) or type(func).__module__
    return f"{where}.{name}" if where else name


def _accelerate_hook(module: nn.Module, forward: Any) -> Any:
    """accelerate's hook on the module (model or sequential CPU offload, a device map: an `accelerate.hooks.ModelHook`
    in `_hf_hook`, with the forward `add_hook_to_module` installed), else None. `_hf_hook` alone is not enough: it may
    hold chunkflow's parking marker (runtime/parking.ExecutionDevice, which only tells diffusers a parked module's
    execution device and replaces no forward), beside diffusers' own hooks (context parallelism), which batch_cfg
    goes through."""
    hook = module.__dict__.get("_hf_hook")
    if forward is None or hook is None:
        return None
    ours = any(c.__module__.split(".")[0] == "accelerate" for c in type(hook).__mro__)
    return hook if ours else None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return a.shape == b.shape and bool(torch.equal(a.to(b.device, b.dtype), b))


@dataclass
class CfgBatching:
    """`batch_cfg(pipe)`'s state; `remove()` puts the pipeline's transformer(s) and `encode_prompt` back."""

    pipe: Any
    modules: list[nn.Module]
    prompts: list[list[torch.Tensor]] = field(default_factory=list)  # per prompt: the tensors encode_prompt gave
    stats: CfgStats = field(default_factory=CfgStats)
    wrappers: dict[int, Any] = field(default_factory=dict)  # id(module) -> the forward batch_cfg installed
    previous: dict[int, Any] = field(default_factory=dict)  # id(module) -> its instance forward before (or None)
    encode: Any = None  # the encode_prompt batch_cfg installed
    _pending: _Pending | None = None
    _since_encode: bool = False  # a transformer forward ran since the last encode_prompt (a new generation next)
    _removed: bool = False
    _takes: dict[int, set[str]] = field(default_factory=dict)

    # ---- encode_prompt: the two prompts' tensors

    def _record(self, result: Any) -> None:
        """One encode_prompt call: either both prompts' embeddings at once (WanPipeline: positive, negative) or one
        prompt's tensors (embeddings, pooled embeddings, mask, ids: FluxPipeline, QwenImagePipeline, ...)."""
        items = list(result) if isinstance(result, (tuple, list)) else [result]
        tensors = [t for t in items if isinstance(t, torch.Tensor)]
        if self._since_encode:
            self.prompts, self._pending, self._since_encode = [], None, False
        embeds = [t for t in tensors if t.is_floating_point() and t.dim() == 3]
        if len(embeds) > 1:
            self.prompts.extend([e] for e in embeds)
        elif embeds:
            self.prompts.append(tensors)
        self.prompts = self.prompts[-2:]  # the pipeline's own last calls (a caller may have encoded others before)

    def _pair(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(this call's kwargs, the other prompt's kwargs) when the call's text embeddings are one of two recorded
        prompts: every keyword equal to one of this prompt's tensors takes the other prompt's tensor in its place."""
        embeds = kwargs.get("encoder_hidden_states")
        if not isinstance(embeds, torch.Tensor) or len(self.prompts) != 2:
            return None
        for i, mine in enumerate(self.prompts):
            if not any(_same(t, embeds) for t in mine if t.shape == embeds.shape):
                continue
            theirs = self.prompts[1 - i]
            if len(theirs) != len(mine):
                return None
            other = dict(kwargs)
            for key, value in kwargs.items():
                if not isinstance(value, torch.Tensor):
                    continue
                hit = next((j for j, t in enumerate(mine) if t is value), None)
                if hit is None:
                    hit = next((j for j, t in enumerate(mine) if _same(t, value)), None)
                if hit is not None:
                    other[key] = theirs[hit].to(value.device, value.dtype if value.is_floating_point() else None)
            return kwargs, other
        return None

    # ---- the transformer's forward

    def forward(self, module: nn.Module, original, args: tuple, kwargs: dict[str, Any]) -> Any:
        self._since_encode = True
        if args or self._removed or _stateful_hooks(module):
            # positional calls, and models with a diffusers hook that keeps state (caches: per guidance pass) run as
            # they are
            self.stats.unbatched += 1
            return original(*args, **kwargs)
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending.answers(module, kwargs):
                self.stats.served += 1
                return pending.output
            self.stats.discarded += 1
        pair = self._pair(kwargs)
        hidden = kwargs.get("hidden_states")
        if pair is None or not isinstance(hidden, torch.Tensor):
            self.stats.unbatched += 1
            return original(**kwargs)
        mine, other = pair
        takes = self._takes.setdefault(id(module), set(inspect.signature(original).parameters))
        batched_in = [dict(mine), dict(other)]
        lengths = {k["encoder_hidden_states"].shape[1] for k in batched_in}
        masks = [k.get("encoder_hidden_states_mask") for k in batched_in]
        if len(lengths) > 1 or (any(m is not None for m in masks) and any(m is None for m in masks)):
            if "encoder_hidden_states_mask" not in takes:  # texts of other lengths need a mask to be batched
                self.stats.unbatched += 1
                return original(**kwargs)
            e, m = _pad_text([k["encoder_hidden_states"] for k in batched_in], masks)
            for k, ei, mi in zip(batched_in, e, m):
                k["encoder_hidden_states"], k["encoder_hidden_states_mask"] = ei, mi
        try:
            stacked = stack_passes(batched_in, hidden.shape[0])
        except CfgBatchingError:
            self.stats.unbatched += 1
            return original(**kwargs)
        snapshot = _Snapshot(other, module)
        mine_out, other_out = split_passes(original(**stacked), 2)
        self.stats.batched_forwards += 1
        self._pending = _Pending(module, other, snapshot, other_out)
        return mine_out

    def remove(self) -> None:
        """The pipeline as it was: its transformers' forwards and its encode_prompt (each only if it is still the
        one batch_cfg installed)."""
        if self._removed:
            return
        for m in self.modules:
            if m.__dict__.get("forward") is self.wrappers.get(id(m)):
                previous = self.previous.get(id(m))
                if previous is None:
                    del m.__dict__["forward"]
                else:
                    m.__dict__["forward"] = previous
        if self.pipe.__dict__.get("encode_prompt") is self.encode:
            del self.pipe.__dict__["encode_prompt"]
        self.prompts, self._pending, self._removed = [], None, True

    def __enter__(self) -> "CfgBatching":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def batch_cfg(pipe: Any) -> CfgBatching:
    """Make `pipe(...)` evaluate both guidance passes of each step in one transformer forward (see the module
    docstring). Works on the catalog's CFG pipelines (Wan, Wan2.2-A14B's two experts, Qwen-Image) and any diffusers
    pipeline that encodes its prompts with `encode_prompt` and calls its transformer once per pass with keyword
    arguments. Undo with `.remove()`, or use it as a context manager."""
    encode = getattr(pipe, "encode_prompt", None)
    if not callable(encode):
        raise CfgBatchingError(f"{type(pipe).__name__} has no encode_prompt; batch_cfg needs a diffusers pipeline "
                               "that encodes its prompts with it")
    modules = [m for name in ("transformer", "transformer_2") if isinstance(m := getattr(pipe, name, None), nn.Module)]
    if not modules:
        raise CfgBatchingError(f"{type(pipe).__name__} has no transformer to batch")
    for m in modules:
        forward = m.__dict__.get("forward")
        if getattr(forward, "_chunkflow_batch_cfg", False):
            raise CfgBatchingError(f"batch_cfg is already on for this pipeline's {type(m).__name__}; call .remove() on "
                                   "the earlier one first")
        hook = _accelerate_hook(m, forward)
        if hook is not None:
            raise CfgBatchingError(
                f"the pipeline's {type(m).__name__} runs under accelerate's hook ({type(hook).__name__}: "
                "enable_model_cpu_offload, enable_sequential_cpu_offload or a device map), which diffusers puts back "
                "after every call, dropping batch_cfg's; nothing was changed. Place the components with chunkflow "
                "instead (chunkflow.offload(..., 'none') and handle.park(), or `chunkflow run`), or call batch_cfg "
                "without model offload")
        if forward is not None and not _diffusers_hooked(m, forward):
            raise CfgBatchingError(f"{type(m).__name__}.forward is replaced on this instance by something else "
                                   f"({_installer(forward)}); batch_cfg wraps the module's own forward: remove that "
                                   "first (nothing was changed)")
    state = CfgBatching(pipe, modules)

    def recording_encode(*args, **kwargs):
        result = encode(*args, **kwargs)
        state._record(result)
        return result

    pipe.__dict__["encode_prompt"] = state.encode = recording_encode
    for m in modules:
        original = m.forward
        state.previous[id(m)] = m.__dict__.get("forward")  # diffusers' hooks' forward, put back by remove()

        def forward(*args, _m=m, _orig=original, **kwargs):
            return state.forward(_m, _orig, args, kwargs)

        forward._chunkflow_batch_cfg = True
        m.__dict__["forward"] = state.wrappers[id(m)] = forward
    return state
