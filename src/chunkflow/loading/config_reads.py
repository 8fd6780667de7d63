"""Which of a folder's config values a pipeline's own statement reads: read from the pipeline class's source, not
run. For an exception the pipeline's code raised itself (loading/folder_errors.py): the statement its frame was at,
and the conditions it ran under (the tests of every `if` and `while` around it, an `elif` chain's included), are
searched for `self.<component>.config.<key>` (or `.config["key"]`), and for `self.<attribute>` where the class's
`__init__` set that attribute from such a value (`self.vae_scale_factor = 2 ** (len(self.vae.config.
block_out_channels) - 1)`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from types import CodeType

__all__ = ["config_reads"]

_COMPOUND = (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try)


def _tree(fn_or_code) -> tuple[ast.AST, int] | None:
    """(the function's AST, the file line its first line is) or None where its source cannot be read."""
    try:
        lines, first = inspect.getsourcelines(fn_or_code)
        return ast.parse(textwrap.dedent("".join(lines))), max(first, 1)
    except (OSError, TypeError, SyntaxError):
        return None


def _config_key(node: ast.AST) -> tuple[str, str] | None:
    """(component, key) where `node` is `self.<component>.config.<key>` or `self.<component>.config["<key>"]`."""
    if isinstance(node, ast.Attribute):
        owner, key = node.value, node.attr
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value,
                                                                                                  str):
        owner, key = node.value, node.slice.value
    else:
        return None
    if not (isinstance(owner, ast.Attribute) and owner.attr == "config"):
        return None
    comp = owner.value
    if isinstance(comp, ast.Attribute) and isinstance(comp.value, ast.Name) and comp.value.id == "self":
        return comp.attr, key
    return None


def _self_attribute(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _reads(nodes: list[ast.AST]) -> tuple[list[tuple[str, str]], list[str]]:
    """The config keys the expressions read directly, and the `self` attributes they read."""
    keys, attrs = [], []
    for top in nodes:
        for node in ast.walk(top):
            key = _config_key(node)
            if key is not None:
                keys.append(key)
            elif (a := _self_attribute(node)) is not None:
                attrs.append(a)
    return keys, attrs


@functools.cache
def _init_sets(cls: type) -> dict[str, tuple[tuple[str, str], ...]]:
    """attribute -> the config keys `cls.__init__` reads to set `self.<attribute>`."""
    got = _tree(cls.__init__)
    out: dict[str, list[tuple[str, str]]] = {}
    if got is None:
        return {}
    for node in ast.walk(got[0]):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            keys, _ = _reads([node.value] if node.value is not None else [])
            for t in targets:
                name = _self_attribute(t)
                if name is not None and keys:
                    out.setdefault(name, []).extend(keys)
    return {k: tuple(v) for k, v in out.items()}


def _around(tree: ast.AST, line: int) -> list[ast.AST]:
    """The expressions that decide whether line `line` (relative to the function's source) runs and what it does:
    its innermost statement (a compound statement's header only) and the tests of the `if`s and `while`s around
    it."""
    out: list[ast.AST] = []
    node = tree
    while True:
        inner = next((c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)
                      and c.lineno <= line <= (c.end_lineno or c.lineno)), None)
        if inner is None:
            return out
        if isinstance(inner, (ast.If, ast.While)):
            out.append(inner.test)
        if not isinstance(inner, _COMPOUND) and not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return out + [inner]
        body_lines = [s for part in ("body", "orelse", "finalbody", "handlers") for s in getattr(inner, part, [])]
        if not any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in body_lines):  # the header itself
            head = [getattr(inner, f) for f in ("test", "iter", "target") if getattr(inner, f, None) is not None]
            head += [i.context_expr for i in getattr(inner, "items", [])]
            return out + head
        node = inner


def config_reads(cls: type, code: CodeType, line: int) -> list[tuple[str, str]]:
    """(component, key) of the config values that the statement at file line `line` of `code` (a method of
    pipeline class `cls`) reads or runs under (module docstring), first read first, each once."""
    got = _tree(code)
    if got is None:
        return []
    tree, first = got
    keys, attrs = _reads(_around(tree, line - first + 1))
    sets = _init_sets(cls)
    for a in attrs:
        keys += list(sets.get(a, ()))
    return list(dict.fromkeys(keys))
