"""chunkflow's own context-parallel plans, for diffusers classes that ship without one, by the name models.yaml
gives in `diffusers.cp_plan`: (the `_cp_plan` dict, the attention processor class that must replace the class's
own, or None)."""

from __future__ import annotations


def own_cp_plan(name: str):
    """(cp_plan, processor class) for a models.yaml `diffusers.cp_plan` name; KeyError for an unknown one."""
    if name == "hunyuan_video":
        from chunkflow.models import hunyuan_video

        return hunyuan_video.cp_plan(), hunyuan_video.processor_class()
    raise KeyError(f"no context-parallel plan named {name!r} in chunkflow.models.context_parallel")
