"""Jobs for a loaded pipeline: one line of a prompt file (`chunkflow run --prompts`), one call of a session's
`generate`, one request to `chunkflow serve`; and whether a job fits the plan's loaded placement.

A job may ask for another shape (height, width, frames) or step count than the plan's. The pipeline stays as it was
loaded (every component where the plan placed it, the transformer's offload setting unchanged), so the job is
planned against that placement: the same phase model the planner used (pipeline/phases.estimate) at the job's
workload, its GPU peak in every phase held to the plan's GPU budget and its host peak to the plan's host budget,
each less the margin the plan kept. A job that does not fit is refused with the reason, before it runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.units import format_bytes
from chunkflow_planner.versioned import field_errors
from chunkflow_planner.workload import MAX_STEPS, WorkloadError, make_workload

MAX_PROMPT_CHARS = 4000  # the longest prompt a job takes (T5's 512 tokens are about 2000 characters of English)
MAX_JOBS = 10_000  # lines a prompt file may hold
MAX_NAME_BYTES = 251  # an output name's length in UTF-8 bytes: a file name holds 255 (NAME_MAX), less ".mp4"
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range
MAX_JOBS_FILE_BYTES = 16 * 2**20


class JobError(ChunkflowError):
    """A job that cannot run: malformed, or not fitting the loaded placement; the message says why."""


class Job(BaseModel):
    """One generation: a line of a prompt file, a call of Session.generate, a request to the server."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="what to generate")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description="what to steer away from "
                                        "(models with classifier-free guidance)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="the generator's seed, as "
                      "torch.Generator(device).manual_seed(seed)")
    guidance: float | None = Field(None, gt=0, le=100, description="guidance scale (default: the model's)")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="denoising steps (default: the plan's)")
    height: int | None = Field(None, ge=1, le=16384, description="default: the plan's")
    width: int | None = Field(None, ge=1, le=16384, description="default: the plan's")
    frames: int | None = Field(None, ge=1, le=4096, description="video models; default: the plan's")
    image: str | None = Field(None, max_length=4096, description="the image to animate or edit: a file path in a "
                              "prompt file (relative to the file's folder); the server takes an upload instead")
    out: str | None = Field(None, max_length=MAX_NAME_BYTES, description="the output's file name (no folder); "
                            "default: the job's number and the prompt's first words")

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _words(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty; give the words")
        return v

    @field_validator("guidance")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("out")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\x00" in v or v.startswith("."):
            raise ValueError(f"{v!r} is not a plain file name; give a name such as 'fox.mp4' (no folder: outputs go "
                             "to the output folder)")
        from chunkflow_planner.files import FileError, check_path

        try:
            check_path(v, "out", output=True)  # no control character, no NUL, valid text
        except FileError as exc:
            raise ValueError(str(exc).removeprefix("out ")) from None
        n = len(v.encode("utf-8"))
        if n > MAX_NAME_BYTES:
            raise ValueError(f"is {n} bytes long in UTF-8 ({len(v)} characters), over the {MAX_NAME_BYTES} an "
                             "output name may have (a file name holds 255 bytes, the suffix included; an emoji is "
                             "4); give a shorter name")
        return v

    @field_validator("image")
    @classmethod
    def _image_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from chunkflow_planner.files import FileError, check_path

        try:
            check_path(v, "image")  # a NUL byte, a name over NAME_MAX bytes: no file system can look it up
        except FileError as exc:
            raise ValueError(str(exc).removeprefix("image ")) from None
        return v

    def label(self, limit: int = 48) -> str:
        """The prompt, shortened for a table or a bar."""
        text = " ".join(self.prompt.split())
        return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class JobLine:
    """One line of a prompt file: its job, or why it is not one."""

    number: int  # 1-based line number
    job: Job | None
    error: str | None = None


class JobJSONError(JobError):
    """Text that is not JSON a job can be read from (malformed, nested too deeply, a number too long)."""


def load_json(text: str | bytes) -> object:
    """The JSON value of `text`; JobJSONError says why there is none (never a RecursionError or an integer
    conversion's ValueError: a hostile line or request body is bad input, not a crash)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobJSONError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError:
        raise JobJSONError("not valid JSON (not UTF-8, UTF-16 or UTF-32 text)") from None
    except RecursionError:
        raise JobJSONError("not valid JSON for a job (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise JobJSONError(f"not valid JSON for a job ({exc})") from None


def parse_job(data: object, strict: bool = False) -> Job:
    """A Job from a decoded JSON value (`strict`: as JSON gives it, no coercion: "5" is not a seed, true is not a
    step count) or from Python values; JobError with every bad field named."""
    if not isinstance(data, dict):
        raise JobError(f"a job is a JSON object with at least \"prompt\", not {type(data).__name__}")
    try:
        return Job.model_validate(data, strict=strict)
    except ValidationError as exc:
        raise JobError(field_errors(exc)) from None


def parse_jobs(text: str) -> list[JobLine]:
    """Each non-blank line of a prompt file: JSON (a line starting with "{" or "[": a job is an object) or a plain
    prompt; lines starting with "#" are comments."""
    out: list[JobLine] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(out) >= MAX_JOBS:
            raise JobError(f"the prompt file holds more than {MAX_JOBS} jobs; split it")
        try:
            if line[0] in "{[":
                job = parse_job(load_json(line), strict=True)
            else:
                job = parse_job({"prompt": line})
            out.append(JobLine(number, job))
        except JobError as exc:
            out.append(JobLine(number, None, str(exc)))
    return out


def read_jobs(path: str | Path) -> list[JobLine]:
    """The jobs of a prompt file (parse_jobs), read as UTF-8 text; an image path relative to the file's folder."""
    from chunkflow_planner.files import read_text

    p = Path(path).expanduser()
    lines = parse_jobs(read_text(p, "prompt file", MAX_JOBS_FILE_BYTES))
    for line in lines:
        if line.job is not None and line.job.image is not None:
            image = Path(line.job.image).expanduser()
            if not image.is_absolute():
                line.job = line.job.model_copy(update={"image": str(p.parent / image)})
    if not any(line.job is not None for line in lines) and not any(line.error for line in lines):
        raise JobError(f"prompt file {str(p)!r} holds no job: give one prompt a line, or one JSON object a line "
                       "(e.g. {\"prompt\": \"a red fox in the snow\", \"seed\": 1})")
    return lines


@dataclass
class JobFit:
    """A job against the loaded placement: its workload, its predicted time and peaks, and why it cannot run (None
    when it fits)."""

    workload: Workload
    time_s: float  # predicted, a process's first generation (start-up included)
    startup_s: float  # the part of time_s a later generation does not pay
    gpu_need_bytes: int
    host_bytes: int
    reason: str | None

    @property
    def shape(self) -> str:
        """Its size, frames and steps in words ("832x480 x49 frames, 8 steps")."""
        w = self.workload
        return f"{w.width}x{w.height}" + (f" x{w.frames} frames" if w.frames > 1 else "") + f", {w.steps} steps"

    def expected_s(self, first: bool) -> float:
        """The predicted seconds of the job as the process's first generation or a later one."""
        return self.time_s if first else self.time_s - self.startup_s


def job_workload(plan, spec: ModelSpec, job: Job) -> Workload:
    """The plan's workload with the job's shape and steps; WorkloadError where the model cannot run that shape."""
    w = plan.workload
    return make_workload(spec, batch=w.batch, frames=job.frames or w.frames, height=job.height or w.height,
                         width=job.width or w.width, steps=job.steps or w.steps, cfg_passes=w.cfg_passes)


def placement_estimate(plan, spec: ModelSpec, hw: HardwareSpec, w: Workload):
    """The plan's placement (its components' placements, its transformer offload setting) at workload `w`:
    pipeline/phases.estimate, as the planner made the plan's own prediction (its SP degree's ranks, host memory
    shared as its offload setting says)."""
    from chunkflow_planner.pipeline.phases import estimate
    from chunkflow_planner.pipeline.placement import Placements
    from chunkflow_planner.policy import Problem

    comps = {c.name: c for c in plan.pipeline.components}
    pipe = spec.pipeline
    experts = tuple(c.placement for c in plan.pipeline.components if c.kind == "transformer")
    pl = Placements.of(tuple(comps[te.component].placement for te in pipe.text_encoders), experts,
                       comps[pipe.vae.component].placement, plan.pipeline.vae_tiling)
    problem = Problem(spec, w, hw, plan.parallel.sp_degree)
    point = problem.evaluate(plan.offload)
    disk_point = problem.evaluate(plan.offload.with_overrides(disk_blocks=spec.n_blocks)) if pl.mixed else None
    return estimate(spec, w, hw, pl, point, None, disk_point, ranks=plan.parallel.sp_degree,
                    share_host=plan.offload.share_host)


def fit_job(plan, spec: ModelSpec, hw: HardwareSpec, job: Job) -> JobFit:
    """The job planned against the plan's loaded placement (module docstring). A plan without a pipeline section
    (planned --transformer-only) is checked for its shape only: its other components have no prediction."""
    from chunkflow_planner.explain import MarginKept

    if not spec.is_video and job.frames not in (None, 1):
        return JobFit(plan.workload.to_workload(), 0.0, 0.0, 0, 0,
                      f"frames: {spec.name} makes images, not videos; leave frames out")
    try:
        w = job_workload(plan, spec, job)
    except WorkloadError as exc:
        return JobFit(plan.workload.to_workload(), 0.0, 0.0, 0, 0, str(exc))
    if plan.pipeline is None or spec.pipeline is None:
        return JobFit(w, 0.0, 0.0, 0, 0, None)
    e = placement_estimate(plan, spec, hw, w)
    startup = sum(ph.startup_s for ph in e.phases.values())
    fit = JobFit(w, e.generation_time, startup, e.gpu_need, e.host_memory, None)
    same = (w.height, w.width, w.frames) == (plan.workload.height, plan.workload.width, plan.workload.frames)
    if same:
        return fit  # the plan's own shape: what was loaded for it (other steps change no peak)
    redo = (f"plan for it (`chunkflow plan --height {w.height} --width {w.width}"
            + (f" --frames {w.frames}" if spec.is_video else "") + " ...`) and load that plan")
    budget = plan.memory_budget_bytes
    if budget is not None:
        usable = MarginKept(budget, plan.memory_margin or 0.0).usable
        if e.gpu_need > usable:
            kept = f" ({format_bytes(usable)} after the {plan.memory_margin:.0%} the plan keeps for the memory " \
                   "model's error)" if plan.memory_margin else ""
            fit.reason = (f"{fit.shape} needs {format_bytes(e.gpu_need)} of {e.hw_word} memory at its peak "
                          f"({e.binding_phase}) with the loaded placement, over the plan's "
                          f"{format_bytes(budget)} budget{kept}: give a smaller size, or {redo}")
            return fit
    host = plan.host_memory_budget_bytes
    if host is not None:
        usable = int(host / (1 + (plan.host_memory_margin or 0.0)))
        if e.host_memory > usable:
            fit.reason = (f"{fit.shape} needs {format_bytes(e.host_memory)} of host memory with the loaded "
                          f"placement, over the plan's {format_bytes(host)} host budget"
                          + (f" ({format_bytes(usable)} after its margin)" if usable < host else "")
                          + f": give a smaller size, or {redo}")
    return fit
