"""What calibrate times a model at: the same architecture with one block per list, and the workloads spanning the
useful range (shared by the measurements, measure.py, and the cold-process start-up probe, startup.py)."""

from __future__ import annotations

from chunkflow_planner.catalog import ModelSpec, Workload

__all__ = ["one_block_spec", "default_points"]


def one_block_spec(spec: ModelSpec) -> ModelSpec:
    """The same architecture with one block per block list (config layer counts set to 1)."""
    config = dict(spec.diffusers.config)
    for key in ("num_layers", "num_single_layers"):
        if key in config:
            config[key] = 1
    blocks = [g.model_copy(update={"count": 1}) for g in spec.blocks]
    return spec.model_copy(update={"diffusers": spec.diffusers.model_copy(update={"config": config}), "blocks": blocks})


def default_points(spec: ModelSpec, cpu: bool = False) -> list[Workload]:
    """Workloads spanning the useful range: frames 5..121 (video) or batch 1..8 (image) at the default size."""
    d = spec.default_workload
    if cpu:
        values = [5, 9, 17] if spec.is_video else [1, 2, 4]
    else:
        values = [5, 21, 41, 81, 121] if spec.is_video else [1, 2, 4, 8]
    out = []
    for v in values:
        if spec.is_video:
            out.append(Workload(batch=1, frames=v, height=d.height, width=d.width, steps=1))
        else:
            out.append(Workload(batch=v, frames=1, height=d.height, width=d.width, steps=1))
    return out
