"""A module's blocks: the catalog's lists for its class, else found in the module (models/discover.py).

No per-model code: every catalog entry whose `diffusers.cls` is the module's class contributes its
`blocks[*].diffusers_list` attributes, in order; a text encoder class (`pipeline.text_encoders[*].cls`) its
`block_list` (a dotted path, e.g. encoder.block). For a catalog class the lists found in the module are a check on
the catalog's: where they differ, a warning names both (the catalog's lists are used). Any other class's blocks are
the lists found, in attribute order; the runtime checks that order on the first forward (runtime/order.py).
"""

from __future__ import annotations

from torch import nn


def block_list_names(cls_name: str, specs=None) -> list[str]:
    """Ordered block-list attributes for a diffusers class, from the catalog (or the given specs)."""
    if specs is None:
        try:
            from chunkflow_planner.catalog import load_models

            specs = list(load_models().values())
        except Exception:  # catalog missing or unreadable: no adapter, the caller asks for blocks=
            specs = []
    names: list[str] = []
    for spec in specs:
        if spec.diffusers.cls == cls_name:
            for g in spec.blocks:
                if g.diffusers_list not in names:
                    names.append(g.diffusers_list)
        for te in (spec.pipeline.text_encoders if spec.pipeline is not None else []):
            if te.cls == cls_name and te.block_list not in names:  # a text encoder's layers (dotted path)
                names.append(te.block_list)
    return names


def _attr(module: nn.Module, dotted: str):
    """The submodule at a dotted path; `a.b|c.d` tries each path in turn (the layouts of different transformers
    versions, e.g. CLIP's `encoder.layers` in transformers 5, `text_model.encoder.layers` before)."""
    for path in dotted.split("|"):
        found = module
        for part in path.split("."):
            found = getattr(found, part, None)
            if found is None:
                break
        if found is not None:
            return found
    return None


def find_blocks(module: nn.Module, specs=None) -> list[nn.Module]:
    """The module's blocks in their declared order (the catalog's, else the module's attribute order); LookupError
    (with what to do) when neither names any."""
    from chunkflow.models.discover import block_lists, discover_blocks

    cls = type(module).__name__
    names = block_list_names(cls, specs)
    if not names:
        return discover_blocks(module)
    out: list[nn.Module] = []
    for n in names:
        lst = _attr(module, n)
        if not isinstance(lst, nn.ModuleList):
            raise LookupError(f"{cls} has no ModuleList attribute {n!r} named by the catalog; pass blocks=[...]")
        out.extend(lst)
    _check_catalog(module, names, block_lists(module))
    return out


def _check_catalog(module: nn.Module, names: list[str], found: dict[str, nn.ModuleList]) -> None:
    """Warn where the block lists found in the module are not the catalog's (by object: a dotted alternative
    `a|b` names whichever the module has)."""
    listed = {id(_attr(module, n)) for n in names}
    if found and {id(lst) for lst in found.values()} != listed:
        from chunkflow.runtime.errors import warn_user

        warn_user(f"chunkflow: the catalog lists {type(module).__name__}'s blocks as {', '.join(names)}, but the "
                  f"module's block lists are {', '.join(found)}; the catalog's are used (pass blocks=[...] to choose)")
