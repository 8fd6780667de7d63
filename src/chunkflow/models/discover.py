"""Blocks found, not listed: a module's repeated block lists, read from the module itself.

A block list is an `nn.ModuleList` that is a direct child of the module or one level below it (diffusers nests a
few, e.g. a text encoder's `encoder.block`), outside any other block list; where no list is that shallow, at any
depth (CLIP's text towers keep theirs at `text_model.encoder.layers`). Its entries are two or more modules of one
class holding parameters. Of those, the lists whose blocks are large (each entry at least `MIN_BLOCK_SHARE` of
the largest entry found) are the blocks: they hold the bulk of a DiT's parameters, while a list of small
projections or norms (Chroma's approximator, a norm list) stays on the device with the rest.

Their order is the attribute order (the order the class registered them); the runtime checks it against the order
the first forward enters them and lays the blocks out again where they differ (runtime/order.py). Model-agnostic:
nothing here knows a class by name.
"""

from __future__ import annotations

from torch import nn

MIN_BLOCK_SHARE = 0.25  # a list's entries are blocks when each is at least this share of the largest entry found
MAX_DEPTH = 2  # a list's attribute path has at most this many parts (`blocks`, `encoder.block`)


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _homogeneous(lst: nn.ModuleList) -> bool:
    return len(lst) >= 2 and len({type(b) for b in lst}) == 1 and all(_params(b) > 0 for b in lst)


def block_lists(module: nn.Module) -> dict[str, nn.ModuleList]:
    """The module's block lists by attribute path, in attribute order (see the module's docstring)."""
    return _lists_within(module, MAX_DEPTH) or _lists_within(module, None)


def _lists_within(module: nn.Module, max_depth: int | None) -> dict[str, nn.ModuleList]:
    """The block lists whose attribute path has fewer than `max_depth` dots (None: any depth)."""
    found: dict[str, nn.ModuleList] = {}
    for name, sub in module.named_modules():
        if not name or (max_depth is not None and name.count(".") >= max_depth) or not isinstance(sub, nn.ModuleList):
            continue
        if any(name.startswith(n + ".") for n in found) or not _homogeneous(sub):
            continue
        found[name] = sub
    if not found:
        return {}
    largest = max(_params(lst[0]) for lst in found.values())
    return {n: lst for n, lst in found.items() if _params(lst[0]) >= MIN_BLOCK_SHARE * largest}


def discover_blocks(module: nn.Module) -> list[nn.Module]:
    """The module's blocks in attribute order; LookupError (saying what to do) when it has no block list."""
    lists = block_lists(module)
    if not lists:
        raise LookupError(
            f"found no block list in this {type(module).__name__} (an nn.ModuleList of two or more modules of one "
            "class holding parameters); pass blocks=[...] (e.g. blocks=[model.blocks])")
    return [b for lst in lists.values() for b in lst]
