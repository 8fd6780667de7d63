"""The VAE of `calibrate --weights FOLDER` when the catalog does not have it: its decodes timed like a catalog VAE's,
so plans of that folder price the decode (time, peak and the allocator's slack) from this GPU, not from operator
shapes or a borrowed fit (models/derive.py)."""

from __future__ import annotations

from typing import Callable

from chunkflow_planner.errors import ChunkflowError

# a workload for the derivation alone: the VAE does not depend on it, and a folder whose pipeline has no default
# size must not stop the calibration
_ANY_WORKLOAD = dict(height=512, width=512, frames=17, steps=2, text_len=64)


def folder_vae_owner(weights: str | None, measured: set[str], log: Callable[[str], None]):
    """The model derived from pipeline folder `weights` (ModelSpec), where this calibration does not already time its
    VAE (`measured`: the VAEs it times by name); None without --weights, or where the folder cannot be derived
    (said in `log`: the rest of the calibration goes on)."""
    if weights is None:
        return None
    from chunkflow.models.derive import derive_model
    from chunkflow.weights import resolve_weights

    try:
        spec = derive_model(str(resolve_weights(weights)), dict(_ANY_WORKLOAD))
    except (ChunkflowError, OSError) as exc:
        log(f"--weights {weights}: its VAE is not timed ({exc})")
        return None
    if spec.pipeline is None or spec.pipeline.vae.name in measured:
        return None
    return spec
