"""The layers hold: no import circle anywhere in src/ (function-local imports included, annotation-only ones not),
and the planner never imports torch or the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The src modules `path` imports at run time, wherever the import statement is."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_src():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    assert _circles(graph) == []


def test_the_planner_imports_neither_torch_nor_the_runtime():
    for path in (SRC / "chunkflow_planner").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"torch", "chunkflow", "diffusers", "transformers"}, path


def _floor(module: str) -> str:
    for prefix in ("chunkflow.commands", "chunkflow.runtime", "chunkflow.models", "chunkflow.loading"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return module


def test_nothing_imports_upward():
    """The command layer is imported by nothing but the entry point; the runtime receives its blocks and imports
    neither the model adapters, the loaders nor the commands."""
    modules = _modules()
    for name, path in modules.items():
        found = {_floor(m) for m in _imports(path, modules)}
        if not name.startswith("chunkflow.commands") and name not in ("chunkflow.entry", "chunkflow.__main__"):
            assert "chunkflow.commands" not in found, name
        if name.startswith("chunkflow.runtime"):
            assert not found & {"chunkflow.models", "chunkflow.loading", "chunkflow.commands"}, (name, found)


PIPELINE = "chunkflow_planner.pipeline"
COMPOSER = "chunkflow_planner.planner"  # make_plan: the one module that puts the core and the extension together


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_planner_core_never_imports_the_pipeline_extension():
    """The transformer-streaming core (every chunkflow_planner module but the pipeline package and the planner that
    composes the two) imports nothing of chunkflow_planner.pipeline; the extension builds on the core and never on
    the composer."""
    modules = _modules()
    planner = {m: p for m, p in modules.items() if _in(m, "chunkflow_planner")}
    assert PIPELINE in planner and COMPOSER in planner
    for name, path in planner.items():
        found = _imports(path, modules)
        if _in(name, PIPELINE):
            assert COMPOSER not in found, name
        elif name != COMPOSER:
            assert not {m for m in found if _in(m, PIPELINE)}, (name, found)
