"""chunkflow's planner: an analytical model of layerwise offload for diffusion transformers.

Pure Python: nothing here imports torch, so `chunkflow plan` answers in well under a second.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
