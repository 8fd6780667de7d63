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


# ------------------------------------------------------------------------------------------ pipeline calls
#
# How a pipeline is called is read from its class: which pipeline class a run makes (the folder's, or its image
# sibling for `--image`), which keyword arguments its `__call__` takes. A family's knowledge that its signature
# does not say is one entry of FAMILY_CALLS, keyed by the catalog's `pipeline.adapter`; an uncatalogued pipeline
# has none and is called by its signature alone.

import inspect  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from chunkflow_planner.errors import ChunkflowError  # noqa: E402


class PipelineClassError(ChunkflowError):
    """The pipeline class a run would make does not fit what it was given (an image, or none); the message says
    what to do."""


@dataclass(frozen=True)
class FamilyCall:
    """What a family's call takes that its signature does not say."""

    max_sequence_length: bool = True  # pass the last text encoder's planned tokens as max_sequence_length


FAMILY_CALLS: dict[str, FamilyCall] = {
    # Qwen-Image's and HunyuanVideo's max_sequence_length cap a templated prompt: their defaults are what the plan
    # counted (the planned tokens are the template's and the prompt's together)
    "qwen_image": FamilyCall(max_sequence_length=False),
    "hunyuan_video": FamilyCall(max_sequence_length=False),
}


def diffusers_pipeline_class(name: str) -> type:
    import diffusers

    cls = getattr(diffusers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise PipelineClassError(f"diffusers {diffusers.__version__} has no pipeline class {name!r}; upgrade "
                                 "diffusers, or point --weights at a diffusers pipeline folder")
    return cls


def call_parameters(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls.__call__).parameters)


def takes_image(cls: type) -> bool:
    return "image" in call_parameters(cls)


def needs_image(cls: type) -> bool:
    p = call_parameters(cls).get("image")
    return p is not None and p.default is inspect.Parameter.empty


def check_masks(cls: type) -> None:
    """A pipeline that paints into the masked part of an image (FluxFillPipeline, the inpainting ones: their
    `__call__` takes `mask_image`) is refused: chunkflow gives no mask, and the call would fail in the middle of the
    run. Asked after the folder's own checks, so a broken folder says so first."""
    if "mask_image" in call_parameters(cls):
        raise PipelineClassError(f"{cls.__name__} paints into the masked part of an image (its mask_image), and "
                                 "chunkflow gives no mask: it cannot run this pipeline; point --weights at a folder "
                                 "of a pipeline that takes none")


def hands_out_latents(cls: type) -> bool:
    """Whether a call of `cls` hands its step callback the latents (`callback_on_step_end` taking "latents", or an
    older class's `callback(step, timestep, latents)`, PixArt's): what `run --latents` saves them from."""
    params = call_parameters(cls)
    if "callback_on_step_end" not in params:
        return "callback" in params and "callback_steps" in params
    return "latents" in (getattr(cls, "_callback_tensor_inputs", None) or ["latents"])


def _init_parameters(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}


def image_family(cls: type) -> list[type]:
    """The pipelines of `cls`'s diffusers family (its subpackage, e.g. diffusers.pipelines.wan) that take an image
    and are made of everything `cls` is made of (its components and settings): what the same folder can run given
    an image (WanPipeline: WanImageToVideoPipeline; FluxPipeline: FluxImg2ImgPipeline, FluxKontextPipeline, ...)."""
    import importlib

    package = importlib.import_module(cls.__module__.rsplit(".", 1)[0])
    structure = getattr(package, "_import_structure", None)  # diffusers' lazy modules: submodule -> names
    names = sorted({n for ns in structure.values() for n in ns} if isinstance(structure, dict) else dir(package))
    base = _init_parameters(cls)
    out = []
    for name in (n for n in names if n.endswith("Pipeline")):
        try:
            other = getattr(package, name)
        except Exception:  # a lazily imported pipeline whose dependencies are missing here
            continue
        if (isinstance(other, type) and other is not cls and takes_image(other)
                and base <= _init_parameters(other)):
            out.append(other)
    return out


def _runs_alone(cls: type, base: type) -> bool:
    """Whether `cls` needs no component beyond `base`'s (its other components optional): the same folder runs it."""
    optional = set(getattr(cls, "_optional_components", None) or [])
    params = inspect.signature(cls.__init__).parameters
    need = {k for k in _init_parameters(cls) if params[k].default is inspect.Parameter.empty and k not in optional}
    return need <= _init_parameters(base)


def _wan_image_to_video(spec, settings: dict) -> str | None:
    """Wan image-to-video without expand_timesteps (Wan2.1-I2V) gives its transformer the latents, a mask (one
    channel per frame of a latent frame) and the image's latents: 2 z + 4 channels; a text-to-video transformer takes
    z. With expand_timesteps (Wan2.2-TI2V) the image's latents replace the first frame's: z channels."""
    if settings.get("expand_timesteps"):
        return None
    z = spec.pipeline.vae.config.get("z_dim", spec.latent_channels)
    want = 2 * z + (spec.vae_temporal or 4)
    have = spec.diffusers.config.get("in_channels")
    if have == want:
        return None
    return (f"{spec.name}'s transformer takes {have} input channels, a Wan image-to-video transformer {want} (the "
            "latents, the first frame's mask and the image's latents): it is a text-to-video model; plan an "
            "image-to-video one (Wan2.1-I2V, or Wan2.2-TI2V, whose expand_timesteps animates an image)")


# what an image pipeline needs of the plan's model that its signature does not say, by the pipeline class
IMAGE_CHECKS = {"WanImageToVideoPipeline": _wan_image_to_video}


def _check_imports(cls: type) -> None:
    """The packages the pipeline's prompt cleaning needs are installed: diffusers imports some only where they are
    (ftfy) and some pipelines call them regardless (Wan image-to-video's basic_clean), which would fail in the
    middle of the run. Tried on a word, before anything is loaded."""
    import sys

    clean = getattr(sys.modules.get(cls.__module__), "basic_clean", None)
    if not callable(clean):
        return
    try:
        clean("a")
    except NameError as exc:
        name = getattr(exc, "name", None) or str(exc)
        raise PipelineClassError(f"{cls.__name__} cleans its prompts with the Python package {name}, which is not "
                                 f"installed: pip install {name}") from None


def run_class(planned: str, folder_cls: str | None, image: bool, where: str = "the folder", spec=None,
              settings: dict | None = None) -> type:
    """The diffusers pipeline class a run makes: the plan's (`planned`), or the folder's (`folder_cls`, its
    model_index.json's `_class_name`) where that is one of the plan's image family and an image is given (a FLUX
    Kontext folder for a FLUX plan); given an image and a class that takes none, its one image sibling the same
    components run (WanPipeline -> WanImageToVideoPipeline, as Wan2.2-TI2V-5B's folder is used for image-to-video).
    PipelineClassError says what to do where none fits."""
    base = diffusers_pipeline_class(planned)
    cls = base
    if folder_cls is not None and folder_cls != planned:
        family = image_family(base)
        found = next((c for c in family if c.__name__ == folder_cls), None)
        if found is None:
            from chunkflow_planner.checkpoint import CheckpointError, shown

            raise CheckpointError(f"{where} holds a {shown(folder_cls)} (model_index.json), but the plan's model "
                                  f"runs a {planned}; point --weights at that model's pipeline folder, or plan the "
                                  "folder's model")
        cls = found
    if image and not takes_image(cls):
        family = [c for c in image_family(cls) if _runs_alone(c, cls)]
        if len(family) != 1:
            what = (f"its image pipelines ({', '.join(c.__name__ for c in family)}) take more than its folder holds "
                    "or differ in what they do: give a folder whose model_index.json names one" if family else
                    "leave --image out (it generates from the prompt alone), or plan an image-to-video or edit model")
            raise PipelineClassError(f"{cls.__name__} takes no image; {what}")
        cls = family[0]
    if not image and needs_image(cls):
        raise PipelineClassError(f"{cls.__name__} animates or edits an image: give it with --image PATH")
    check = IMAGE_CHECKS.get(cls.__name__) if image and spec is not None else None
    why = check(spec, settings if settings is not None else dict(spec.pipeline.config)) if check else None
    if why:
        raise PipelineClassError(why)
    _check_imports(cls)
    return cls


def call_kwargs(spec, pipe_cls: type, w, prompt: str, negative: str | None, guidance: float | None, steps: int,
                generator, image=None) -> dict:
    """The keyword arguments of one call of `pipe_cls` for workload `w`: what chunkflow sets (prompt, sizes, frames,
    steps, guidance, generator, the image), each only where the class's `__call__` takes it. Guidance: true CFG
    (`true_cfg_scale` where the class has it, else `guidance_scale`, and the negative prompt) where the plan counts
    two passes a step; embedded guidance (`guidance_scale`) otherwise."""
    pipe = spec.pipeline
    params = call_parameters(pipe_cls)
    cfg = spec.default_workload.cfg_passes == 2
    g = pipe.guidance if guidance is None else guidance
    family = FAMILY_CALLS.get(getattr(pipe, "adapter", None), FamilyCall())
    if negative is not None and not takes_negative_prompt(spec, pipe_cls):
        raise ValueError(f"{spec.name}'s pipeline takes no negative prompt")
    kw = dict(prompt=prompt, height=w.height, width=w.width, num_inference_steps=steps, generator=generator,
              output_type="np", num_frames=w.frames if spec.is_video else None, image=image,
              video_length=w.frames if spec.is_video else None)  # Latte's name for num_frames
    if cfg and "true_cfg_scale" in params:  # true CFG only with a negative prompt (Qwen-Image): " " by default
        kw.update(true_cfg_scale=g, negative_prompt=negative if negative is not None else " ")
    else:
        kw.update(guidance_scale=g, negative_prompt=negative)
    if pipe.guidance_2 is not None:
        kw["guidance_scale_2"] = pipe.guidance_2 if guidance is None else guidance
    batch = "num_videos_per_prompt" if "num_videos_per_prompt" in params else "num_images_per_prompt"
    if w.batch != 1:
        kw[batch] = w.batch
    if family.max_sequence_length:
        kw["max_sequence_length"] = pipe.text_encoders[-1].tokens
    return {k: v for k, v in kw.items() if k in params and v is not None}


def takes_negative_prompt(spec, pipe_cls: type | None = None) -> bool:
    """Whether the plan's pipeline, called as chunkflow calls it, uses a negative prompt: its class takes one and
    the plan counts two transformer passes a step (true CFG: Wan, Qwen-Image; FLUX and HunyuanVideo embed their
    guidance instead)."""
    if pipe_cls is None:
        pipe_cls = diffusers_pipeline_class(spec.pipeline.cls)
    return spec.default_workload.cfg_passes == 2 and "negative_prompt" in call_parameters(pipe_cls)


def negative_prompt_refusal(spec, negative: str = "negative_prompt", guidance: str = "guidance") -> str | None:
    """Why the plan's pipeline refuses a negative prompt (`negative` and `guidance` name the fields or flags the
    caller knows them by), or None where it takes one."""
    if takes_negative_prompt(spec):
        return None
    how = "distilled into the model" if getattr(spec.pipeline, "adapter", None) == "flux" else "embedded"
    return f"{spec.name}'s pipeline takes no negative prompt (its guidance is {how}: {guidance} sets it); leave " \
           f"{negative} out"
