"""A pipeline loaded once for a plan, generating as often as wanted: `chunkflow.load(plan, weights=DIR)`.

    with chunkflow.load("plan.json", weights="Wan2.2-TI2V-5B-Diffusers") as session:
        for seed in range(4):
            session.generate("a red fox in the snow", seed=seed).save(f"fox-{seed}.mp4")

The pipeline is built as `chunkflow run --prompt` builds it (every component where the plan placed it; one load,
its progress reported), and each `generate` runs one generation through it (chunkflow.generate), its latents the
ones a fresh process makes with the same seed. A prompt encoded before in the session is not encoded again (the
text encoders' outputs are kept, models/prompt_cache.py). A generation may ask for another size, frame count or step
count than the plan's: it is planned against the loaded placement first (chunkflow_planner/jobs.py) and refused
with the planner's reason if it does not fit, before anything runs. `close()` (or leaving the `with`) frees every
host and device buffer the session holds and takes every hook off.

A step cache (`cache="first-block:0.1"`, as `run --cache` takes it; by default the plan's, `plan --cache`) is
checked on the model's transformer before the load and enabled on the transformers for each generation: its state
reset first (so each generation gives what a fresh process with the same cache gives, one stopped mid-way included),
MagCache's step count the generation's, and what it skipped in `Result.cache`. `generate(..., cache=...)` gives one
generation another cache (or none).
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.pipeline.jobs import Job, JobError, JobFit, fit_job

__all__ = ["Session", "Result", "load"]


class SessionClosed(ChunkflowError):
    """A session used after close()."""


@dataclass
class Result:
    """One generation of a session: its output (frames F x H x W x 3 for a video, images B x H x W x 3, floats in
    [0, 1]), its last latents, its phases measured, and the plan's prediction for it."""

    job: Job
    output: Any
    latents: Any  # torch.Tensor on the CPU, or None
    phases: dict  # phase -> chunkflow.generate.PhaseMeasurement
    step_times_s: list[float]
    seconds: float  # the whole generation (the pipeline's call)
    predicted_s: float | None  # the plan's time for it (None on a device of another kind than the plan's)
    encode_cached: bool  # the prompt was encoded before in the session: no text encoder ran
    host_peak_bytes: int
    is_video: bool
    fps: int | None
    index: int  # the session's generations before this one
    cache: Any = None  # reports.CacheResult: what the step cache skipped in this generation (None: no cache)

    def save(self, path: str | Path) -> Path:
        """Write the output, whole or not at all: a video to .mp4, an image to .png (a batch as stem-0.png, ...)."""
        from chunkflow.media import image_names, write_media

        path = str(Path(path).expanduser())
        if self.is_video:
            return write_media(path, self.output, fps=self.fps or 16)
        if getattr(self.output, "ndim", 0) == 4 and self.output.shape[0] > 1:
            names = image_names(path, self.output.shape[0])
            for name, img in zip(names, self.output):
                write_media(name, img)
            return Path(names[0])
        return write_media(path, self.output)

    @property
    def time_error(self) -> float | None:
        """(measured - predicted) / predicted, where the plan predicts this device."""
        if self.predicted_s is None or not self.predicted_s:
            return None
        return (self.seconds - self.predicted_s) / self.predicted_s


class Session:
    """A plan's pipeline, loaded once (module docstring). Built by `load()`; safe to call from one thread at a
    time (a lock serialises generations)."""

    def __init__(self, plan, weights: str | Path | None = None, *, device: str | None = None,
                 variant: str | None = None, profile: str | None = None, image: bool = False,
                 offload=None, seed: int = 0, transformer: str | Path | None = None,
                 transformer_2: str | Path | None = None,
                 progress: Callable[[str, int | None, int | None], None] | None = None,
                 log: Callable[[str], None] = lambda s: None, cache: Any = "plan") -> None:
        from chunkflow.caches import GenerationCache, check_fits, resolve_cache
        from chunkflow.pipeline_setup import MAX_SEED, setup_pipeline
        from chunkflow.runtime.resolve import resolve_device
        from chunkflow_planner.plan import Plan, check_setting, files_needed, load_plan

        self.plan: Plan = load_plan(plan)
        self.cfg = self.plan.offload if offload is None else offload
        check_setting(self.plan, self.cfg, "offload")
        if not 0 <= seed <= MAX_SEED:
            raise JobError(f"seed must be between 0 and 2**62 ({MAX_SEED}), got {seed}")
        if variant is not None and weights is None:
            raise JobError("variant picks files in a weights folder; give weights=DIR with it")
        files = {k: str(v) for k, v in (("transformer", transformer), ("transformer_2", transformer_2)) if v}
        if files and weights is None:
            raise JobError("transformer=FILE reads the transformer from a file and the rest of the pipeline from "
                           "the folder: give weights=DIR with it")
        from chunkflow.models.transformer_file import check_plan_format

        check_plan_format(self.plan, files)
        why = files_needed(self.plan, self.cfg, how="weights=DIR")
        if why is not None and weights is None:
            raise JobError(why)
        self.cache = resolve_cache(cache, self.plan)  # the cache of each generation that names none
        if self.cache is not None:  # refused on the model built on the meta device, before the load
            from chunkflow_planner.plan import model_of

            check_fits(self.cache, model_of(self.plan), self.plan.workload.steps)
        self._log = log
        self._lock = threading.Lock()
        self._closed = False
        self.generations = 0  # generations run (each after the first pays no start-up)
        self.image = image
        self._setup = setup_pipeline(self.plan, self.cfg, resolve_device(device, hint="device='cpu'"),
                                     weights=None if weights is None else str(weights), variant=variant,
                                     profile=profile, seed=seed, progress=progress, log=log, image=image,
                                     transformers=files)
        self.spec, self.hw, self.device = self._setup.spec, self._setup.hw, self._setup.device
        self._caches = GenerationCache(self._setup.built)

    # -- what the session holds -------------------------------------------------------------------------------
    @property
    def built(self):
        """The BuiltPipeline (models/pipeline_build.py): the diffusers pipeline and its handles."""
        self._check_open()
        return self._setup.built

    @property
    def pipe(self):
        """The diffusers pipeline (its components placed as the plan says)."""
        return self.built.pipe

    @property
    def load_result(self):
        """How the load went, measured against the plan (reports.LoadResult)."""
        return self._setup.load

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def comparable(self) -> bool:
        """The session runs on a GPU as the plan's (its times are the plan's to predict; a CPU plan's times are
        nominal)."""
        return self._setup.comparable and self.device.type == "cuda"

    # -- planning a job --------------------------------------------------------------------------------------
    def job(self, prompt: str | Job, **fields: Any) -> Job:
        """A Job from a prompt and fields (or a Job with the fields given laid over it), checked: JobError says
        which field is wrong. Fields given as None are left as they are."""
        from chunkflow_planner.pipeline.jobs import parse_job

        given = {k: v for k, v in fields.items() if v is not None}
        if isinstance(prompt, Job):
            return parse_job({**prompt.model_dump(exclude_unset=True), **given}) if given else prompt
        return parse_job({"prompt": prompt, **given})

    def fit(self, job: Job, with_image: bool | None = None, cache: Any = "session") -> JobFit:
        """The job planned against the loaded placement: its predicted time and peaks, and why it cannot run here
        (a reason: its shape, an image the pipeline takes none of or needs, a negative prompt it does not use, a
        step cache that can skip none of its steps) or None. `with_image`: whether an image comes with it (default:
        the job names one); `cache`: the generation's (generate's argument)."""
        from chunkflow.models.adapters import needs_image, negative_prompt_refusal

        fit = fit_job(self.plan, self.spec, self.hw, job)
        with_image = job.image is not None if with_image is None else with_image
        cls = type(self._setup.built.pipe)
        if fit.reason is None and with_image and not self.image:
            fit.reason = (f"this session's pipeline ({cls.__name__}) takes no image; load the session with "
                          "image=True (the image pipeline of the model's family)")
        if fit.reason is None and not with_image and needs_image(cls):
            fit.reason = f"{cls.__name__} animates or edits an image: give one with the job"
        if fit.reason is None and job.negative_prompt is not None:
            fit.reason = negative_prompt_refusal(self.spec)
        if fit.reason is None:
            fit.reason = self._cache_refusal(self._cache_of(cache), fit.workload.steps)
        return fit

    @staticmethod
    def _cache_refusal(setting, steps: int) -> str | None:
        """Why the cache would change nothing in a generation of `steps` steps (a few-step schedule), or None."""
        from chunkflow_planner.cache import cache_label
        from chunkflow_planner.stepcache import does_nothing

        why = does_nothing(setting, steps) if setting is not None else None
        return (f"cache {cache_label(setting)}: {why}, so it would change nothing; run more steps, or without it"
                if why else None)

    def predicted_s(self, job: Job, first: bool | None = None) -> float | None:
        """The plan's seconds for the job here, as the session's next generation (`first`: as the process's first
        or a later one); None where the plan does not predict this device or has no pipeline section."""
        if not self.comparable or self.plan.pipeline is None:
            return None
        return self.fit(job).expected_s(self.generations == 0 if first is None else first)

    # -- generating ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Job, *, negative_prompt: str | None = None, seed: int | None = None,
                 guidance: float | None = None, steps: int | None = None, height: int | None = None,
                 width: int | None = None, frames: int | None = None, image: Any = None,
                 on_step: Callable[[int, int], None] | None = None,
                 on_phase: Callable[[str], None] | None = None, cache: Any = "session") -> Result:
        """One generation (a prompt and its fields, or a Job, the fields given laid over it; seed 0 where none is
        given). `image`: a path or a PIL image, for a session
        loaded with image=True. A job that does not fit the loaded placement raises JobError with the planner's
        reason before anything runs; `on_step(i, n)` hears of each denoising step (raising from it stops the
        generation after that step), `on_phase(name)` of each phase. `cache`: "session" the session's step cache,
        None none, or another for this generation (`KIND[:PARAMS]` or a CacheSetting; a bad one raises
        CacheSpecError before anything runs)."""
        from chunkflow.generate import generate

        job = self.job(prompt, negative_prompt=negative_prompt, seed=seed, guidance=guidance, steps=steps,
                       height=height, width=width, frames=frames,
                       image=str(image) if isinstance(image, (str, Path)) else None)
        if image is None and job.image is not None:
            image = job.image
        setting = self._cache_of(cache)
        fit = self.fit(job, with_image=image is not None, cache=setting)
        if fit.reason is not None:
            raise JobError(fit.reason)
        with self._lock:
            self._check_open()
            self._caches.begin(setting, fit.workload.steps, self._log)
            first = self.generations == 0
            predicted = fit.expected_s(first) if self.comparable and self.plan.pipeline is not None else None
            freeze = gc.get_freeze_count() == 0  # the pipeline's objects out of the collector's reach (run_generate)
            if freeze:
                gc.collect()
                gc.freeze()
            try:
                gen = generate(self._setup.built, fit.workload, job.prompt, negative=job.negative_prompt,
                               guidance=job.guidance, steps=fit.workload.steps, seed=job.seed, on_step=on_step,
                               on_phase=on_phase, cfg_batched=self.cfg.cfg_batched, image=image)
            finally:
                if freeze:
                    gc.unfreeze()
                self.generations += 1
            skipped = self._caches.result(fit.workload.steps)
        pipe = self.spec.pipeline
        return Result(job, gen.output, gen.latents, gen.phases, gen.step_times_s, gen.seconds, predicted,
                      gen.encode_cached, gen.host_peak_bytes, self.spec.is_video, pipe.fps if pipe else None,
                      self.generations - 1, skipped)

    def _cache_of(self, cache: Any):
        """A generation's cache argument as a setting ("session": the session's)."""
        from chunkflow.caches import resolve_cache

        if isinstance(cache, str) and cache == "session":
            return self.cache
        return resolve_cache(cache, self.plan)

    # -- closing ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free every host and device buffer the session holds and take every hook off (the pipeline's modules are
        left empty: the session is done with them). A second close does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._caches.end()
            self._caches.built = None  # it held the pipeline
            self._setup.built.discard()
            self._setup = _Closed(self._setup)
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - a broken CUDA install: nothing more to free
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("this session is closed; load the plan again (chunkflow.load) to generate")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.generations} generations"
        return f"<chunkflow Session {self.spec.name} on {self.device}, {state}>"


class _Closed:
    """What a closed session keeps of its setup: the facts, not the pipeline."""

    def __init__(self, setup) -> None:
        self.spec, self.hw, self.device, self.load = setup.spec, setup.hw, setup.device, setup.load
        self.comparable = setup.comparable

    @property
    def built(self):
        raise SessionClosed("this session is closed; load the plan again (chunkflow.load) to generate")


def load(plan, weights: str | Path | None = None, *, device: str | None = None, variant: str | None = None,
         profile: str | None = None, image: bool = False, offload=None, seed: int = 0,
         transformer: str | Path | None = None, transformer_2: str | Path | None = None,
         progress: Callable[[str, int | None, int | None], None] | None = None,
         log: Callable[[str], None] = lambda s: None, cache: Any = "plan") -> Session:
    """Load the plan's pipeline once (a plan file, a dict or a Plan): `weights` a diffusers pipeline folder or a Hub
    id in the local cache (None: random weights), `device` (default: the GPU), `image=True` for the image pipeline
    of the model's family (image-to-video, edit), `offload` an OffloadConfig in place of the plan's, `transformer`
    (and `transformer_2`, a second expert's) a single file the transformer is read from instead of the folder's (a
    GGUF file, checked from its header against the folder's config before anything is read). `progress(phase,
    done, total)` hears of the load's bytes ("load"); `log` of what the load says. `cache`: the step cache of each
    generation, `KIND[:PARAMS]` as `run --cache` takes it (e.g. "first-block:0.1") or a CacheSetting; "plan" (the
    default) the plan's (`plan --cache`), None none; checked before the load (CacheSpecError, one line)."""
    return Session(plan, weights, device=device, variant=variant, profile=profile, image=image, offload=offload,
                   seed=seed, transformer=transformer, transformer_2=transformer_2, progress=progress, log=log,
                   cache=cache)
