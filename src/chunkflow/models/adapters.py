"""Catalog-driven block discovery: a class name -> its ordered block lists, read from models.yaml.

No per-model code: every catalog entry whose `diffusers.cls` is the module's class contributes its
`blocks[*].diffusers_list` attributes, in order; a text encoder class (`pipeline.text_encoders[*].cls`) its
`block_list` (a dotted path, e.g. encoder.block).
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
    """The module's blocks in execution order; LookupError (with what to do) when they can't be found."""
    cls = type(module).__name__
    names = block_list_names(cls, specs)
    if not names:
        raise LookupError(
            f"no catalog entry for class {cls}, so its blocks are unknown; pass blocks=[...] "
            "(e.g. blocks=[model.blocks] or [model.transformer_blocks, model.single_transformer_blocks])"
        )
    out: list[nn.Module] = []
    for n in names:
        lst = _attr(module, n)
        if not isinstance(lst, nn.ModuleList):
            raise LookupError(f"{cls} has no ModuleList attribute {n!r} named by the catalog; pass blocks=[...]")
        out.extend(lst)
    return out
