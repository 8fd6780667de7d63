"""A workload (resolution, frames or batch, steps) and its token count S, with validation."""

from __future__ import annotations

from chunkflow_planner.catalog import ModelSpec, Workload
from chunkflow_planner.errors import ChunkflowError

__all__ = ["MAX_BATCH", "MAX_STEPS", "MAX_TOKENS", "Workload", "WorkloadError", "make_workload", "tokens",
           "tokens_per_latent_frame", "latent_frames", "per_forward"]


# Bounds of a workload, far beyond any real generation (`plan` refuses more; so does `run`, of a plan edited past them)
MAX_STEPS = 100_000  # denoising steps: pipelines use 4-100
MAX_BATCH = 1024  # samples of one forward
# tokens of one sample: Wan 720x1280 x 81 frames is 75,600, HunyuanVideo 720p x 129 frames 118,800 (before the
# text); 2**22 is 35 times more
MAX_TOKENS = 2**22


class WorkloadError(ChunkflowError):
    """A workload the model cannot run; the message names the nearest valid values."""


def tokens_per_latent_frame(spec: ModelSpec, height: int, width: int) -> int:
    """Tokens of one latent frame after VAE downsampling and patchification: (H/(s*ph)) * (W/(s*pw))."""
    _, ph, pw = spec.patch
    return (height // (spec.vae_spatial * ph)) * (width // (spec.vae_spatial * pw))


def latent_frames(spec: ModelSpec, frames: float) -> float:
    """Latent frames of a video of `frames` frames: ((n - 1) / vae_t + 1) / pt; 1 for image models."""
    if spec.vae_temporal is None:
        return 1.0
    return ((frames - 1) / spec.vae_temporal + 1) / spec.patch[0]


def tokens(spec: ModelSpec, w: Workload) -> int:
    """Global sequence length S of one sample (facts.md: S = (H/(s p)) (W/(s p)) ((n-1)/t + 1))."""
    return int(round(tokens_per_latent_frame(spec, w.height, w.width) * latent_frames(spec, w.frames)))


def per_forward(w: Workload, cfg_batched: bool) -> tuple[Workload, int]:
    """One transformer forward of a step and how many run: the guidance passes as `cfg_passes` forwards of the
    batch, or (batched CFG) one forward of `cfg_passes` times the batch."""
    if cfg_batched and w.cfg_passes > 1:
        return w.model_copy(update={"batch": w.batch * w.cfg_passes, "cfg_passes": 1}), 1
    return w, w.cfg_passes


def nearest_valid_frames(spec: ModelSpec, frames: float) -> tuple[int, int]:
    """The valid frame counts (1 mod the VAE's temporal factor) just below and just above `frames`."""
    t = spec.vae_temporal or 1
    low = max(1, int((frames - 1) // t) * t + 1)
    return low, low + t


def validate(spec: ModelSpec, w: Workload) -> None:
    """Raise WorkloadError if the model cannot run `w`, saying what would be valid instead."""
    step_h = spec.vae_spatial * spec.patch[1]
    step_w = spec.vae_spatial * spec.patch[2]
    for what, value, step in (("height", w.height, step_h), ("width", w.width, step_w)):
        if value % step:
            low = max(step, value // step * step)
            raise WorkloadError(
                f"{spec.name} needs {what} divisible by {step} (VAE x{spec.vae_spatial}, patch "
                f"x{step // spec.vae_spatial}); {value} is not. Nearest valid: {low} or {low + step}."
            )
    if spec.vae_temporal is None:
        if w.frames != 1:
            raise WorkloadError(f"{spec.name} is an image model: use --batch, not --frames ({w.frames} given).")
        return
    t = spec.vae_temporal
    if (w.frames - 1) % t:
        low, high = nearest_valid_frames(spec, w.frames)
        raise WorkloadError(
            f"{spec.name} needs frames = 1 mod {t} (its VAE compresses time {t}x); {w.frames} is not. "
            f"Nearest valid: {low} or {high}."
        )


def make_workload(
    spec: ModelSpec,
    *,
    batch: int | None = None,
    frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    steps: int | None = None,
    cfg_passes: int | None = None,
) -> Workload:
    """The model's default workload with the given fields replaced, validated."""
    d = spec.default_workload
    fields = {
        "batch": d.batch if batch is None else batch,
        "frames": d.frames if frames is None else frames,
        "height": d.height if height is None else height,
        "width": d.width if width is None else width,
        "steps": d.steps if steps is None else steps,
        "cfg_passes": d.cfg_passes if cfg_passes is None else cfg_passes,
    }
    for key, value in fields.items():
        if value < 1 and key != "cfg_passes":
            raise WorkloadError(f"--{key} must be at least 1, got {value}")
    if fields["cfg_passes"] not in (1, 2):
        raise WorkloadError(f"cfg passes must be 1 or 2, got {fields['cfg_passes']}")
    if fields["steps"] > MAX_STEPS:
        raise WorkloadError(f"--steps must be at most {MAX_STEPS} (pipelines use 4-100), got {fields['steps']}")
    if fields["batch"] > MAX_BATCH:
        raise WorkloadError(f"--batch must be at most {MAX_BATCH}, got {fields['batch']}")
    w = Workload(**fields)
    validate(spec, w)
    if tokens(spec, w) > MAX_TOKENS:
        raise WorkloadError(f"{w.width}x{w.height}" + (f" x{w.frames} frames" if spec.is_video else "") + f" is "
                            f"{tokens(spec, w)} tokens a sample for {spec.name}, more than {MAX_TOKENS}: give a "
                            "smaller size")
    return w
