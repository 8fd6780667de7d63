"""A prompt already encoded is not encoded again in the same process: the pipeline's own `encode_prompt`, wrapped.

Every catalog pipeline (Wan, FLUX, Qwen-Image, HunyuanVideo) computes its text embeddings in `encode_prompt` and the
rest of its `__call__` only reads them, so caching that one call's outputs keeps a generation bit-identical to one
that encodes again, as long as the key holds everything the embeddings depend on. It holds:
- every argument the call was given, bound to its signature with the defaults filled in (prompt and negative
  prompt, whether guidance is on, the prompts per call, the sequence length, device and dtype, the LoRA scale, the
  prompt template);
- each text encoder's tensors as they are now: every parameter and buffer by object, storage address, layout, dtype,
  device and version counter. `param.data = new` keeps the parameter and its counter but moves its storage; an
  in-place write bumps the counter; a new parameter is a new object;
- each encoder module's mode (`training`) and adapter state (peft layers: active and merged adapters, disabled,
  scales), and its config's settings (attention implementation, ...);
- each tokenizer's and processor's settings (padding and truncation side, maximum length, special tokens, ...: its
  attributes, small containers by value, large ones such as a vocabulary by object and length, and its length with
  added tokens), and the pipeline's own plain settings (a prompt template, a maximum length).
What it cannot see: bytes written past the version counter (`param.data.copy_(x)`, `.data` being a tensor autograd
does not track), hooks and replaced forward methods, and a tokenizer's backend changed in place: after such a change
call `clear()`. A call given tensors (`prompt_embeds=`) is not cached. The key costs one pass over the encoders'
tensors and modules, no read of their values. The outputs are kept as clones on their device and handed out as
clones, the `size` newest ones.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections import OrderedDict
from typing import Any

import torch


class PromptCache:
    """Installed on a pipeline instance (its `encode_prompt` attribute); `remove()` takes it off."""

    def __init__(self, pipe, encoders: list[str], size: int = 8):
        self.pipe, self.encoders, self.size = pipe, list(encoders), size
        self.entries: OrderedDict[tuple, Any] = OrderedDict()
        self.hits = self.misses = 0
        self._encode = pipe.encode_prompt  # the bound method of its class
        self._sig = inspect.signature(self._encode)
        pipe.encode_prompt = self._call

    def _state(self) -> tuple | None:
        """What the embeddings depend on besides the arguments (the module's docstring); None: not cacheable (a
        tensor without a version counter, made under inference mode, can change unseen)."""
        out = []
        for name in self.encoders:
            module = getattr(self.pipe, name, None)
            if module is None:
                continue
            parts = []  # one walk over the modules: each one's own tensors, mode and adapter state
            for m in module.modules():
                for t in itertools.chain(m._parameters.values(), m._buffers.values()):
                    if t is None:
                        continue
                    if t.is_inference():
                        return None
                    parts.append((id(t), _address(t), t._version, t.dtype, t.device, t.shape, t.stride()))
                parts.append((m.training, _adapters(m) if _is_tuner_layer(type(m)) else None))
            config = getattr(module, "config", None)
            out.append((name, id(module), tuple(parts), _settings(config) if config is not None else None))
        for name, value in vars(self.pipe).items():
            if ("tokenizer" in name or "processor" in name) and value is not None:
                out.append((name, id(value), _settings(value)))
                inner = getattr(value, "tokenizer", None)  # a processor's own tokenizer
                if inner is not None:
                    out.append((name + ".tokenizer", id(inner), _settings(inner)))
            elif not name.startswith("_") and isinstance(value, _PLAIN):
                out.append((name, value))
        return tuple(out)

    def _key(self, args, kwargs) -> tuple | None:
        bound = self._sig.bind(*args, **kwargs)
        bound.apply_defaults()
        key = []
        for name, value in bound.arguments.items():
            if isinstance(value, torch.Tensor):
                return None  # embeddings given: nothing to encode
            key.append((name, _frozen(value)))
        state = self._state()
        return None if state is None else tuple(key) + state

    def _call(self, *args, **kwargs):
        key = self._key(args, kwargs)
        if key is None:
            return self._encode(*args, **kwargs)
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return _cloned(self.entries[key])
        self.misses += 1
        out = self._encode(*args, **kwargs)
        self.entries[key] = _cloned(out)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return out

    def clear(self) -> None:
        self.entries.clear()

    def remove(self) -> None:
        self.entries.clear()
        if self.pipe.__dict__.get("encode_prompt") == self._call:
            del self.pipe.__dict__["encode_prompt"]


_PLAIN = (type(None), bool, int, float, str, bytes)
_SMALL = 64  # containers up to this many items are keyed by value, larger ones (a vocabulary) by object and length
_VOLATILE = {"deprecation_warnings", "_in_target_context_manager"}  # a tokenizer's bookkeeping, not its settings


def _settings(obj) -> tuple:
    """An object's own attributes as a key (a tokenizer's, a processor's, a config's): plain values as they are,
    small containers by value, anything else by object (and length)."""
    kind = type(obj)  # asked of the class: a diffusers config object raises KeyError for a missing attribute
    state = [("len", len(obj))] if hasattr(kind, "__len__") and hasattr(kind, "get_vocab") else []  # added tokens
    return tuple(state) + tuple((k, _value(v)) for k, v in sorted(getattr(obj, "__dict__", {}).items())
                                if k not in _VOLATILE)


def _value(v, depth: int = 0):
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (torch.device, torch.dtype)):
        return str(v)
    if isinstance(v, (list, tuple, set, frozenset, dict)) and len(v) <= _SMALL and depth < 3:
        if isinstance(v, dict):
            return ("dict",) + tuple((_value(k, depth + 1), _value(x, depth + 1)) for k, x in v.items())
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return (type(v).__name__,) + tuple(_value(x, depth + 1) for x in items)
    return (type(v).__name__, id(v), len(v) if hasattr(v, "__len__") else None)


def _address(t: torch.Tensor):
    """Where a tensor's first element is (its storage's address plus offset); a tensor without storage (a wrapper
    subclass) by its object alone."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


@functools.cache
def _is_tuner_layer(cls: type) -> bool:
    """Whether a module class is a peft adapter layer (its `active_adapters` a property; a transformers model's own
    is a method: the layers hold the state)."""
    return isinstance(getattr(cls, "active_adapters", None), property) and hasattr(cls, "disable_adapters")


def _adapters(module) -> tuple:
    """A peft adapter layer's state: which adapters are active, merged or disabled, and their scales."""
    return (tuple(module.active_adapters), tuple(getattr(module, "merged_adapters", ())),
            bool(module.disable_adapters), _value(getattr(module, "scaling", None)))


def _frozen(value):
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (torch.device, torch.dtype)):
        return str(value)
    return value


def _cloned(out):
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_cloned(v) for v in out)
    return out
