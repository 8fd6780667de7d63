"""Offloaders a bench compares chunkflow with, applied to the same model: `diffusers-group` is diffusers' group
offloading at block level, one block per group, with streams (what users of diffusers reach for today)."""

from __future__ import annotations

BASELINES = ("diffusers-group",)


def check_baseline(name: str) -> None:
    """ValueError naming what is missing, before any model is built."""
    import importlib.util

    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    if importlib.util.find_spec("accelerate") is None:
        raise ValueError("the diffusers-group baseline needs accelerate (diffusers' group offloading imports it): "
                         "pip install accelerate")


def apply_baseline(name: str, model, device) -> None:
    """Offload `model` (every weight on `device` now) with baseline `name`. It stays applied: run it last."""
    import torch
    from diffusers.hooks import apply_group_offloading

    check_baseline(name)
    cuda = device.type == "cuda"
    apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=cuda, record_stream=cuda)
