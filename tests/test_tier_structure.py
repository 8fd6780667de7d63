"""The tier/codec structure (issue 52's design step), read from the source with ast: a tier stores and hands out a
block's bytes and never asks which codec made them; a codec is a layer over any tier; the generic streaming side talks
to a codec through its interface only.

- no Tier, ParkHome or BlockBytes class subclasses another concrete one (only the interfaces of tiers/base.py);
- no tier module imports a codec module or names a codec's words (identifiers and messages; docstrings and comments
  may say what a layer above does);
- codecs/stream.py, codecs/base.py and codecs/layer.py use none of exponent-pack's own names (its chunk fields k and
  n_escapes live in its own Chunk, opaque to them);
- the tier modules import no other tier module (helpers shared by several tiers are not tiers, and import none).
"""

from __future__ import annotations

import ast
from itertools import permutations
from pathlib import Path

import chunkflow

RUNTIME = Path(chunkflow.__file__).parent / "runtime"
TIERS_DIR, CODECS_DIR = RUNTIME / "tiers", RUNTIME / "codecs"
INTERFACES = {"Tier", "ParkHome", "BlockBytes"}  # tiers/base.py: what every tier, park home and byte holder is
# tiers/ modules that are not tiers (the package is the registry)
HELPERS = {"base", "files", "hostcopies", "keyed", "__init__"}
CODEC_WORDS = ("codec", "encod", "decod", "exponent", "escape", "spilled")
EXPONENT_PACK_NAMES = {"k", "n_escapes", "escape", "escapes", "sections", "GROUP", "exponent_pack", "exponent_pack_gpu",
                       "Decode", "decode_into", "Encoded", "MAX_K"}


def _modules(folder: Path) -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(folder.glob("*.py"))}


def _tier_modules() -> dict[str, ast.Module]:
    return {n: t for n, t in _modules(TIERS_DIR).items() if n not in HELPERS}


def _identifiers(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.update((node.asname or node.name).split("."))
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _messages(tree: ast.AST) -> list[str]:
    """The string constants that are not docstrings (messages, keys, f-string parts)."""
    docs = _docstrings(tree)
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))}


def test_no_tier_subclasses_another_tier():
    classes = {node.name: _base_names(node) for folder in (TIERS_DIR, CODECS_DIR)
               for tree in _modules(folder).values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def is_kind(name: str, seen=()) -> bool:
        return name in INTERFACES or any(is_kind(b, (*seen, name)) for b in classes.get(name, ()) if b not in seen)

    concrete = {n for n in classes if n not in INTERFACES and is_kind(n)}
    assert {"HostTier", "DiskTier", "SharedHostTier", "CodedTier", "HostBytes", "SharedBytes", "SpillBytes",
            "HostParking", "DiskParking", "SharedParking"} <= concrete
    bad = {n: bases & concrete for n, bases in classes.items() if bases & concrete}
    assert not bad, bad
    assert "EncodedTier" not in classes and not (TIERS_DIR / "encoded.py").exists()


def test_no_tier_module_imports_a_codec_or_names_one():
    for name, tree in _modules(TIERS_DIR).items():
        assert not {m for m in _imports(tree) if m.startswith("chunkflow.runtime.codecs")}, name
        names = _identifiers(tree)
        words = {i for i in names if any(w in i.lower() for w in CODEC_WORDS)} | ({"stream"} & names)
        assert not words, (name, words)
        said = [m for m in _messages(tree) if any(w in m.lower() for w in CODEC_WORDS)]
        assert not said, (name, said)


def test_the_generic_codec_side_uses_no_exponent_pack_field():
    for name in ("stream", "base", "layer"):
        tree = ast.parse((CODECS_DIR / f"{name}.py").read_text())
        assert not {m for m in _imports(tree) if "exponent_pack" in m}, name
        used = _identifiers(tree) & EXPONENT_PACK_NAMES
        assert not used, (name, used)
    layer = ast.parse((CODECS_DIR / "layer.py").read_text())
    assert not {m for m in _imports(layer) if m.startswith("chunkflow.runtime.tiers.") and m.rsplit(".", 1)[-1]
                in ("host", "shared")}, "the layer asks a tier for its bytes holder (hold_bytes), not for its class"


def test_tier_modules_import_no_other_tier_module():
    modules = _modules(TIERS_DIR)
    tiers = set(_tier_modules())
    assert tiers == {"host", "disk", "shared"}
    pairs = [(a, b) for a, b in permutations(tiers, 2) if f"chunkflow.runtime.tiers.{b}" in _imports(modules[a])]
    assert len(pairs) == 0, pairs
    for helper in HELPERS - {"__init__"}:  # the helpers import no tier (no cycle through them)
        assert not {f"chunkflow.runtime.tiers.{t}" for t in tiers} & _imports(modules[helper]), helper
