"""A failed call into one part of a pipeline (a model, a module inside one, the scheduler) made again without
chunkflow: the same class built from the same config, a model's on the meta device (nothing allocated, nothing
computed) and called with meta tensors of the same shapes and dtypes, a scheduler fresh from its config with copies
of the arguments. What loading/folder_errors.py asks to tell the folder's error from chunkflow's.

The arguments are the ones the failed call was given, read from the traceback's frames, never guessed: a module's
call from torch's `Module.__call__` frame (`args` and `kwargs` as its forward got them, after any pre-hooks); a
method's from its own frame where its body never rebinds a parameter (read in its bytecode), else from its caller's
frame, by the call expression the caller was executing (its exact source position) where that expression's
arguments are names, attributes and constants only (nothing is called to read them).
"""

from __future__ import annotations

import ast
import copy
import dis
import inspect
import textwrap
import warnings
from dataclasses import dataclass, field
from types import CodeType, FrameType, TracebackType
from typing import Any

import torch
from torch import nn

__all__ = ["FailedCall", "Site", "failed_call", "frames_of", "plain_model", "raise_site", "replay"]

_MODULE_CALLS = {nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__}
_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}


@dataclass(frozen=True)
class Site:
    """Where an exception was raised: its type and the innermost frame outside torch (meta tensors raise from
    torch's own Python where other devices raise from C++, so torch's frames are left out on both sides)."""

    kind: type
    module: str  # the frame's module (`diffusers.models.embeddings`)
    file: str
    function: str
    line: int


@dataclass
class FailedCall:
    """A call into `part`: `method` None for calling the module itself, else the method's name."""

    part: Any
    method: str | None
    args: tuple
    kwargs: dict = field(default_factory=dict)


def frames_of(tb: TracebackType | None) -> list[TracebackType]:
    """The traceback's entries, outermost first."""
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def _package(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", "")).split(".")[0]


def raise_site(exc: BaseException) -> Site | None:
    """The exception's Site, or None where it has no frame outside torch."""
    for tb in reversed(frames_of(exc.__traceback__)):
        if _package(tb.tb_frame) != "torch":
            code = tb.tb_frame.f_code
            return Site(type(exc), str(tb.tb_frame.f_globals.get("__name__", "")), code.co_filename, code.co_name,
                        tb.tb_lineno)
    return None


# ---------------------------------------------------------------------------------------------- the arguments


def _rebinds_a_parameter(code: CodeType) -> bool:
    """Whether the function's body assigns to or deletes one of its parameters (its frame then no longer holds what
    it was called with)."""
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) \
        + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    params = set(code.co_varnames[:n])
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("STORE_", "DELETE_")):
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if params & set(names):
                return True
    return False


def _own_arguments(frame: FrameType) -> tuple[tuple, dict]:
    """The call's arguments from the callee's own frame (its parameters never rebound), `self` left out."""
    code, local = frame.f_code, frame.f_locals
    positional = code.co_varnames[1:code.co_argcount]  # [0] is self
    keyword = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    n = code.co_argcount + code.co_kwonlyargcount
    args = tuple(local[p] for p in positional)
    kwargs = {k: local[k] for k in keyword}
    if code.co_flags & inspect.CO_VARARGS:
        args += tuple(local[code.co_varnames[n]])
        n += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[code.co_varnames[n]])
    return args, kwargs


def _call_node(tb: TracebackType) -> ast.Call | None:
    """The call expression `tb`'s frame was executing, found by its exact source position."""
    pos = inspect.getframeinfo(tb).positions
    try:
        lines, first = inspect.getsourcelines(tb.tb_frame.f_code)
    except (OSError, TypeError):
        return None
    source = "".join(lines)
    dedented = textwrap.dedent(source)
    shift = len(lines[0]) - len(dedented.splitlines(keepends=True)[0])
    try:
        tree = ast.parse(dedented)
    except SyntaxError:
        return None
    first = max(first, 1)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (node.lineno + first - 1, node.end_lineno + first - 1,
                                           node.col_offset + shift, node.end_col_offset + shift) == \
                (pos.lineno, pos.end_lineno, pos.col_offset, pos.end_col_offset):
            return node
    return None


class _NotPlain(Exception):
    """An argument expression that would have to call something to be read."""


def _read(node: ast.expr, frame: FrameType) -> Any:
    """The value of a names-attributes-constants expression in `frame`, nothing called (`_NotPlain` otherwise)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if node.id in scope:
                return scope[node.id]
        raise _NotPlain(node.id)
    if isinstance(node, ast.Attribute):
        owner = _read(node.value, frame)
        if isinstance(inspect.getattr_static(type(owner), node.attr, None), property):
            raise _NotPlain(node.attr)  # a property runs code
        return getattr(owner, node.attr)
    if isinstance(node, (ast.Tuple, ast.List)):
        values = [_read(e, frame) for e in node.elts]
        return values if isinstance(node, ast.List) else tuple(values)
    raise _NotPlain(type(node).__name__)


def _caller_arguments(caller: TracebackType, part: Any) -> tuple[tuple, dict] | None:
    """The call's arguments as the caller's frame wrote them (a leading `part` itself left out: `method(self, ...)`
    in a decorator's wrapper), or None where an argument is more than names, attributes and constants."""
    node = _call_node(caller)
    if node is None:
        return None
    frame = caller.tb_frame
    try:
        args: list = []
        for a in node.args:
            args += list(_read(a.value, frame)) if isinstance(a, ast.Starred) else [_read(a, frame)]
        kwargs: dict = {}
        for k in node.keywords:
            kwargs.update(_read(k.value, frame) if k.arg is None else {k.arg: _read(k.value, frame)})
    except (_NotPlain, AttributeError, TypeError):
        return None
    if args and args[0] is part:
        args = args[1:]
    return tuple(args), kwargs


def _method_name(part: Any, code: CodeType) -> str | None:
    """The name under which `part`'s class has the function `code` is the body of (through decorators)."""
    cls = type(part)
    for klass in inspect.getmro(getattr(cls, "_chunkflow_base", cls)):
        fn = klass.__dict__.get(code.co_name)
        if fn is not None and getattr(inspect.unwrap(fn), "__code__", None) is code:
            return code.co_name
    return None


def failed_call(entries: list[TracebackType], part: Any) -> FailedCall | None:
    """The call into `part` the failure happened in, with the arguments it was given (module docstring): from the
    outermost of `part`'s frames inward (`entries`: the whole traceback, outermost first), the first whose arguments
    can be read; None where none can."""
    for i, tb in enumerate(entries):
        frame = tb.tb_frame
        if frame.f_locals.get("self") is not part:
            continue
        if frame.f_code in _MODULE_CALLS:
            return FailedCall(part, None, tuple(frame.f_locals["args"]), dict(frame.f_locals["kwargs"]))
        name = _method_name(part, frame.f_code)
        if name is None:
            continue
        if not _rebinds_a_parameter(frame.f_code):
            return FailedCall(part, name, *_own_arguments(frame))
        got = _caller_arguments(entries[i - 1], part) if i else None
        if got is not None:
            return FailedCall(part, name, *got)
    return None


# -------------------------------------------------------------------------------------------------- the replay


def _as_meta(value: Any) -> Any:
    """Tensors as meta tensors of the same shape and dtype, inside tuples, lists and dicts; the rest as it is."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_as_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_meta(v) for k, v in value.items()}
    return value


def _copied(value: Any) -> Any:
    """Tensors cloned and generators copied with their state, so a replay changes nothing of the failed call's."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.Generator):
        g = torch.Generator(value.device)
        g.set_state(value.get_state())
        return g
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def plain_model(model: nn.Module) -> nn.Module:
    """`model`'s own class (not chunkflow's swapped one) built from its config on the meta device, each parameter
    and buffer in the dtype `model` computes it in (fp8 storage counts as the compute dtype)."""
    import transformers

    from chunkflow.models.meta import params_on_meta

    cls = getattr(type(model), "_chunkflow_base", type(model))
    with warnings.catch_warnings(), params_on_meta(), torch.device("cpu"):
        warnings.simplefilter("ignore")
        if isinstance(model, transformers.PreTrainedModel):
            plain = cls(copy.deepcopy(model.config))
        else:
            plain = cls.from_config(dict(model.config))
    compute = getattr(model, "dtype", torch.bfloat16)
    live = {n: t.dtype for n, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)]}
    for name, owner in plain.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for attr, t in list(table.items()):
                if t is None:
                    continue
                dtype = live.get(f"{name}.{attr}" if name else attr, t.dtype)
                meta = torch.empty(t.shape, dtype=compute if dtype in _FP8 else dtype, device="meta")
                table[attr] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    return plain.eval()


def replay(call: FailedCall, owner: Any, path: str) -> BaseException | None:
    """`call` made again on a plain copy of `owner` (the pipeline's component `call.part` belongs to, at `path`
    inside it): the exception it raises, or None where it returns."""
    if isinstance(owner, nn.Module):
        plain = plain_model(owner)
        target = plain.get_submodule(path) if path else plain
        args, kwargs = _as_meta(call.args), _as_meta(call.kwargs)
    else:
        plain = target = type(owner).from_config(owner.config)
        args, kwargs = _copied(call.args), _copied(call.kwargs)
    fn = target if call.method is None else getattr(target, call.method)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - what the plain class raises is what is compared
        return exc
    return None
