"""Whether an exception diffusers (or transformers, torch, numpy inside them) raised is the folder's, not chunkflow's:
said in one line naming the component and its config file, what the library said and what to do (FolderConfigError,
exit 2), where the rule below proves it; anything else stays a bug ("internal error").

Building a component from the folder's config (its class on the meta device, a scheduler from its config) is
checked where it is built (models/components.py, models/folder_parts.py), and every tensor's shape against the
model its config builds before any is read (loading/source.py). What those checks cannot see fails in the call:
values each component takes, that do not fit together or the pipeline (a Sana folder whose transformer's
sample_size is none the pipeline bins sizes for, an Allegro transformer whose heads split its width into parts its
rotary embedding cannot cut in three, a scheduler of 0 training timesteps). For an exception in the call:

1. it is chunkflow's where it was raised in chunkflow's code;
2. where a part of the pipeline (a model, a module inside one, the scheduler) was running when it was raised, the
   failed call into that part is made again without chunkflow (loading/replay.py: the same class from the same
   config, a model's on the meta device, with the same arguments' shapes): the folder's where that raises the same
   exception type at the same place, chunkflow's otherwise (or where the call cannot be made again);
3. where the pipeline's own code raised it, with nothing of chunkflow's below that frame: the folder's where the
   statement, or a condition it ran under, reads the folder's config values (loading/config_reads.py), which are
   named; chunkflow's otherwise (the call's own arguments are chunkflow's, checked before the load).

Before the rules, `wrong_type` (which the CLI also asks of an exception raised anywhere else): an exception inside
a component whose config holds a value of another type than its class's default for it (a scheduler's flow_shift
"x") is the folder's, naming the key and its value.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from chunkflow_planner.checkpoint import CheckpointError

__all__ = ["FolderConfigError", "folder_error", "wrong_type"]

_LIBRARIES = ("diffusers", "transformers", "numpy", "torch", "math", "tokenizers")


class FolderConfigError(CheckpointError):
    """An exception the folder's own configs cause in diffusers; the message names the component and its config
    file, what diffusers said and what to do."""


def _said(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" + ("..." if len(text) > 300 else "")


def _package(frame) -> str:
    return str(frame.f_globals.get("__name__", "")).split(".")[0]


def _config_file(obj: Any) -> str:
    return getattr(type(obj), "config_name", None) or "config.json"


def _parts(pipe) -> dict[int, tuple[str, Any, str]]:
    """id -> (component, the component's object, path inside it) of every model, module inside one, and every
    component with a config (the scheduler) of the pipeline."""
    from torch import nn

    out: dict[int, tuple[str, Any, str]] = {}
    for name, obj in pipe.components.items():
        if isinstance(obj, nn.Module):
            for path, m in obj.named_modules(remove_duplicate=False):
                out.setdefault(id(m), (name, obj, path))
        elif obj is not None and hasattr(type(obj), "from_config") and hasattr(obj, "config"):
            out[id(obj)] = (name, obj, "")
    return out


def _outermost_part(entries, parts) -> Any:
    """The part of the pipeline the outermost traceback entry whose `self` is one is running, or None."""
    for tb in entries:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in parts:
            return owner
    return None


def _replayed(exc: BaseException, entries, parts, part: Any, where: str) -> str | None:
    """Rule 2 (module docstring): the one line where the part's failed call fails the same way without chunkflow."""
    from chunkflow.loading.replay import failed_call, raise_site, replay

    name, owner, path = parts[id(part)]
    call = failed_call(entries, part)
    if call is None:
        return None
    again = replay(call, owner, path)
    if again is None or raise_site(again) != raise_site(exc):
        return None
    cls = getattr(type(owner), "_chunkflow_base", type(owner)).__name__
    config = f"{name}/{_config_file(owner)}"
    return (f"{config} of the folder {where} ({cls}) fails in diffusers itself, without chunkflow: {_said(exc)}; "
            f"a value there is invalid or does not fit the pipeline's other components: fix {config}, or download "
            "the folder again")


def _pipeline_reads(exc: BaseException, entries, pipe, where: str) -> str | None:
    """Rule 3 (module docstring): the one line where the pipeline's own statement that raised reads config values."""
    from chunkflow.loading.config_reads import config_reads

    inner = next((i for i in range(len(entries) - 1, -1, -1) if entries[i].tb_frame.f_locals.get("self") is pipe),
                 None)
    if inner is None or any(_package(tb.tb_frame) == "chunkflow" for tb in entries[inner:]):
        return None
    tb = entries[inner]
    components = pipe.components
    named = []
    for comp, key in config_reads(type(pipe), tb.tb_frame.f_code, tb.tb_lineno):
        cfg = getattr(components.get(comp), "config", None)
        if cfg is not None and (key in cfg if isinstance(cfg, dict) else hasattr(cfg, key)):
            value = cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)
            named.append(f"{comp}/{_config_file(components[comp])} {key} = {value!r}")
    if not named:
        return None
    cls = type(pipe).__name__
    many = len(named) > 1
    return (f"{', '.join(named)} in the folder {where} {'stop' if many else 'stops'} diffusers' {cls} itself, "
            f"without chunkflow: {_said(exc)}; fix {'them' if many else 'it'}, or download the folder again")


def folder_error(exc: BaseException, pipe, folder: Path | None) -> FolderConfigError | None:
    """The FolderConfigError for `exc`, raised by `pipe` (built from `folder`) in its call, where the rule of the
    module docstring says it is the folder's; None for anything else (and for a pipeline of random weights)."""
    from chunkflow.loading.replay import frames_of, raise_site

    if folder is None or not isinstance(exc, Exception):
        return None
    site = raise_site(exc)
    if site is None or site.module.split(".")[0] == "chunkflow":
        return None
    entries, parts = frames_of(exc.__traceback__), _parts(pipe)
    where = repr(str(folder))
    found = _outermost_part(entries, parts)
    try:
        said = wrong_type(exc) or (_replayed(exc, entries, parts, found, where) if found is not None
                                   else _pipeline_reads(exc, entries, pipe, where))
    except Exception:  # noqa: BLE001 - a check that cannot be made proves nothing: the exception stays a bug
        return None
    return FolderConfigError(said) if said is not None else None


# ------------------------------------------------------------------------------------------ a value's type


def wrong_type(exc: BaseException) -> str | None:
    """The one line for an exception diffusers or transformers raised inside a component whose own config holds a
    value of the wrong type for its class (a scheduler's flow_shift "x"): the folder's error, not chunkflow's. Only
    then: the component raising is the deepest object of the traceback with a config, and a value of that config has
    another type than its class's default for it; None for anything else (a bug stays a bug)."""
    tb, culprit, frame = exc.__traceback__, None, None
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if getattr(owner, "config", None) is not None and hasattr(type(owner), "config_name"):
            culprit = owner
        tb = tb.tb_next
    if culprit is None or frame is None or _package(frame) not in _LIBRARIES:
        return None
    try:
        defaults = {k: v.default for k, v in inspect.signature(type(culprit).__init__).parameters.items()
                    if v.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):
        return None
    wrong = []
    for key, value in dict(culprit.config).items():
        default = defaults.get(key)
        if value is None or not isinstance(default, (bool, int, float, str)):
            continue
        both_numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (value, default))
        if type(value) is not type(default) and not both_numbers:
            wrong.append((key, value, default))
    if not wrong:
        return None
    key, value, default = wrong[0]
    name, config = type(culprit).__name__, type(culprit).config_name
    return (f"the folder's {name} ({config}) has {key} = {value!r} where {name} takes a {type(default).__name__} "
            f"(its default is {default!r}); diffusers stopped on it: {type(exc).__name__}: {exc}. Fix {key} in that "
            f"component's {config}, or load another folder")
