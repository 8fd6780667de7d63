"""The default workload of a model entry derived from a folder (models/derive.py): its patch sizes, height, width,
frames, steps, text length and guidance passes, from the transformer's config.json, the pipeline class's `__call__`
defaults and the `chunkflow plan` flags given. Plain dictionaries in, values out; no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chunkflow.models.families import Family

if TYPE_CHECKING:
    from chunkflow_planner.components import PipelineSpec

# what a video pipeline's call names its frame count: most `num_frames`, Latte `video_length`
FRAME_PARAMS = ("num_frames", "video_length")


def patch_sizes(config: dict[str, Any], fam: Family) -> tuple[Any, Any]:
    """(temporal, spatial) patch size of the transformer's tokens, from its config.json and the family's packing."""
    p = config.get("patch_size", 1)
    p = p[-1] if isinstance(p, (list, tuple)) else p
    pt = config.get("patch_size_t") or (config["patch_size"][0] if isinstance(config.get("patch_size"), (list, tuple))
                                        else 1)
    if fam.packed:
        p = 2  # the pipeline packs 2x2 latent patches (FLUX's patch_size 1) or the class patches 2x2 (Qwen-Image's 2)
    return pt, p


def default_workload(config: dict[str, Any], defaults: dict[str, Any], overrides: dict[str, int], fam: Family,
                     vae_spatial: int, vae_temporal: int | None) -> dict[str, Any]:
    """height, width, frames and steps: the flags given, else the pipeline's call defaults, else the transformer's
    sample size x the VAE (None where none of them says)."""
    sample = config.get("sample_size")
    sample = sample[0] if isinstance(sample, (list, tuple)) else sample
    want: dict[str, Any] = {}
    for key, alt in (("height", config.get("sample_height") or sample),
                     ("width", config.get("sample_width") or sample)):
        v = overrides.get(key) or defaults.get(key)
        alt = alt if isinstance(alt, int) else fam.sample_size
        if not isinstance(v, int) and isinstance(alt, int):
            v = alt * vae_spatial
        want[key] = v
    if vae_temporal:
        v = overrides.get("frames") or next((defaults[k] for k in FRAME_PARAMS if k in defaults), None)
        sf = config.get("sample_frames")
        if not isinstance(v, int) and isinstance(sf, int):
            v = sf if fam.sample_frames_out else (sf - 1) * vae_temporal + 1
        want["frames"] = v
    else:
        want["frames"] = 1
    want["steps"] = overrides.get("steps") or defaults.get("num_inference_steps")
    return want


def default_text_len(config: dict[str, Any], defaults: dict[str, Any], overrides: dict[str, int]) -> Any:
    """The text tokens: the flag given, else the pipeline's max_sequence_length, else the transformer's config."""
    return overrides.get("text_len") or defaults.get("max_sequence_length") or config.get("max_text_seq_length") \
        or config.get("max_sequence_length") or config.get("text_len")


def missing_inputs(want: dict[str, Any], text_len: Any) -> list[tuple[str, str]]:
    """(what, the `chunkflow plan` flag that gives it) of each part of the workload nothing said."""
    missing = [(k, f"--{k}") for k in ("height", "width", "frames", "steps") if not isinstance(want.get(k), int)]
    if not isinstance(text_len, int):
        missing.append(("text length", "--text-len"))
    return missing


def cfg_passes(pipeline: PipelineSpec | None, config: dict[str, Any], notes: list[str]) -> int:
    """Forwards a step: two with guidance (a transformer folder's pipeline assumed guided, said in `notes`), one for
    a guidance-distilled transformer (guidance_embeds)."""
    if pipeline is not None:
        guided = pipeline.guidance > 1
    else:
        guided = True
        notes.append("two guidance passes a step assumed (a transformer folder does not say its pipeline's guidance)")
    return 2 if guided and not config.get("guidance_embeds") else 1
