"""The model entry a plan runs: the one place the runtime asks for it."""

from __future__ import annotations


def model_of(plan):
    """The ModelSpec `plan` was made for. Today the catalog's entry of its name; once plans embed the entry the
    planner derives from a folder, `chunkflow_planner.plan.model_of(plan)` (the catalog's or the embedded one) is
    called here instead."""
    from chunkflow_planner.catalog import get_model

    return get_model(plan.model.name)
