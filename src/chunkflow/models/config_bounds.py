"""A folder's config checked to build nothing larger than the plan's model before anything is built from it.

A text encoder's or VAE's module is built from its folder's config.json (its settings are the folder's, as with
`from_pretrained`), then its parameters are counted against the catalog's (models/components.py). What a config
builds grows with its integers (layer counts, widths, vocabularies) and its lists (one block per entry): a config
of ten million layers makes the config object and the module run for minutes and take the machine's memory
before any count. So first, from the JSON alone: every integer in the folder's config is at most the largest one
the reference (the catalog's config over the class's defaults) holds under the same name, anywhere in it, and every
list at most as long; a name the reference does not know is held to the reference's largest integer and longest
list (or UNKNOWN_LIST entries). Smaller values pass (the count after the build says whether the model is the
plan's); floats, strings and booleans never size a model and are left to the class.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from chunkflow_planner.checkpoint import CheckpointError, shown

__all__ = ["reference_config", "check_config_size", "init_defaults"]

UNKNOWN_LIST = 64  # entries of a list under a name the reference holds no list under (`architectures`: one)


def _is_int(v: object) -> bool:
    """An integer that is not a boolean (True sizes nothing)."""
    return isinstance(v, int) and not isinstance(v, bool)


def reference_config(defaults: dict[str, Any], catalog: dict[str, Any]) -> dict[str, Any]:
    """`catalog` over `defaults`, nested dicts merged the same way: the config the catalog's model is built from."""
    out = dict(defaults)
    for k, v in catalog.items():
        out[k] = reference_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def init_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of `cls.__init__` (what diffusers' `from_config` uses for a key a config leaves out)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: (list(p.default) if isinstance(p.default, tuple) else p.default) for p in params
            if p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}


@dataclass
class _Limits:
    """The largest integer and the longest list under each name of a config, and over all of it."""

    ints: dict[str, int] = field(default_factory=dict)
    lens: dict[str, int] = field(default_factory=dict)
    max_int: int = 0
    max_len: int = 0

    def add(self, name: str, value: object) -> None:
        if _is_int(value):
            self.ints[name] = max(self.ints.get(name, value), value)  # type: ignore[type-var]
            self.max_int = max(self.max_int, value)  # type: ignore[type-var]
        elif isinstance(value, (list, tuple)):
            self.lens[name] = max(self.lens.get(name, 0), len(value))
            self.max_len = max(self.max_len, len(value))
            for v in value:
                self.add(name, v)
        elif isinstance(value, dict):
            for k, v in value.items():
                self.add(str(k), v)


def _where(where: str) -> str:
    """A key's path as errors show it: plain when it is a short dotted name, else quoted and cut short."""
    return where if len(where) <= 80 and where.replace(".", "").replace("[", "").replace("]", "").replace(
        "_", "").isalnum() and where.isascii() else shown(where)


def _over(cfg: dict[str, Any], limits: _Limits) -> str | None:
    """The first integer or list of `cfg` over its limit, said as 'key: catalog limit, file value', or None."""
    stack: list[tuple[str, str, object]] = [(str(k), str(k), v) for k, v in reversed(cfg.items())]
    while stack:
        where, name, value = stack.pop()
        if _is_int(value):
            known = name in limits.ints
            limit = limits.ints.get(name, limits.max_int)
            if value > limit:  # type: ignore[operator]
                return f"{_where(where)}: catalog {'' if known else 'at most '}{limit:,}, file {value:,}"
        elif isinstance(value, (list, tuple)):
            limit = limits.lens.get(name, max(limits.max_len, UNKNOWN_LIST))
            if len(value) > limit:
                return f"{_where(where)}: catalog {limit:,} entries at most, file {len(value):,}"
            stack += [(f"{where}[{i}]", name, v) for i, v in reversed(list(enumerate(value)))]
        elif isinstance(value, dict):
            stack += [(f"{where}.{k}", str(k), v) for k, v in reversed(value.items())]
    return None


def check_config_size(cfg: dict[str, Any], reference: dict[str, Any], what: str, cls: str) -> None:
    """Refuse `cfg` (a folder's config.json) when an integer or a list in it is larger than the reference allows
    (module docstring), naming the first such key."""
    limits = _Limits()
    for k, v in reference.items():
        limits.add(str(k), v)
    over = _over(cfg, limits)
    if over is not None:
        raise CheckpointError(f"{what}: its config.json would build a larger {cls} than the plan's model ({over}); "
                              "the folder holds another model: point --weights at the pipeline the plan was made for")
