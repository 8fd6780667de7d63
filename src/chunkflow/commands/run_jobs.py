"""`chunkflow run --prompts jobs.jsonl --out-dir clips/`: one load, every job of a prompt file in order.

Before the load every line is read and checked (chunkflow_planner/jobs.py): a line that is not a job, an image that
cannot be read, an output name that is not a plain file name of the model's kind or is taken by another job, or a
shape the loaded placement cannot fit (planned against it, the planner's reason given) is refused, said and skipped;
the others run. The pipeline is loaded once (a session, chunkflow.session), the image pipeline of the model's family
where any job gives an image. Each output is written atomically into the output folder as its job finishes; a job
that breaks (NaN latents, an image that became unreadable) is reported and the next one runs. Ctrl-C stops the job
running, writes the report of what was done, and exits 130; an unexpected error writes it too. With --max-job-time a
job whose predicted time (its band's upper end) is over the limit is refused before the load. With a step cache
(`--cache`, or the plan's) every job's generation runs with it, its state reset first, and each job's report says
what it skipped. The report (reports.JobsReport) holds every job measured against the plan's prediction for it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from chunkflow.reports import JobResult, JobsReport
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.pipeline.jobs import Job, JobFit, JobLine, fit_job, read_jobs


class JobsError(ChunkflowError):
    """A prompt file that cannot run at all (no job in it can); the message says why and what to do."""


@dataclass
class PlannedJob:
    """A line of the prompt file, ready to run or refused (`error`)."""

    line: int
    job: Job | None
    out: str | None = None  # file name in the output folder
    fit: JobFit | None = None
    error: str | None = None
    predicted_s: float | None = None  # as it runs in the batch (the first job with the start-up)
    upper_s: float | None = None  # the upper end of its band


def slug(text: str, limit: int = 40) -> str:
    """The prompt's first words as a file-name part: lower-case letters, digits and dashes."""
    words = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return words[:limit].rstrip("-") or "job"


def output_name(job: Job, line: int, video: bool) -> str:
    """The job's file name: its `out` (the model's suffix added where it has none), else the line and the prompt's
    first words; JobsError-free: a wrong suffix is raised as ValueError for the caller to report."""
    suffix = ".mp4" if video else ".png"
    if job.out is None:
        return f"{line:04d}-{slug(job.prompt)}{suffix}"
    given = Path(job.out).suffix.lower()
    if not given:
        return job.out + suffix
    if given != suffix:
        kind = "videos" if video else "images"
        raise ValueError(f"out {job.out!r}: this model makes {kind}; name it {Path(job.out).stem + suffix!r}")
    return job.out


def with_defaults(job: Job, defaults: dict[str, Any]) -> Job:
    """The job with the command's options for the fields its line does not set."""
    update = {k: v for k, v in defaults.items() if v is not None and k not in job.model_fields_set}
    return job.model_copy(update=update) if update else job


def plan_jobs(plan, spec, hw, lines: list[JobLine], defaults: dict[str, Any], out_dir: Path | None = None
              ) -> list[PlannedJob]:
    """Every line checked before the load (module docstring); with `out_dir`, no output may land on a job's image
    (a later job would read the video or image written over it)."""
    from chunkflow.media import load_input_image
    from chunkflow.models.adapters import negative_prompt_refusal
    from chunkflow_planner.files import FileError, check_path

    out: list[PlannedJob] = []
    taken: dict[str, int] = {}
    images = {Path(ln.job.image).resolve(): ln.number for ln in lines if ln.job is not None and ln.job.image}
    for ln in lines:
        if ln.job is None:
            out.append(PlannedJob(ln.number, None, error=ln.error))
            continue
        job = with_defaults(ln.job, defaults)
        p = PlannedJob(ln.number, job)
        out.append(p)
        try:
            p.out = output_name(job, ln.number, spec.is_video)
            if out_dir is not None:  # the whole path too: a name the folder's file system takes, under PATH_MAX
                check_path(out_dir / p.out, f"out {p.out!r} in --out-dir", output=True)
        except (ValueError, FileError) as exc:
            p.error = str(exc)
            continue
        key = p.out.lower()
        if key in taken:
            p.error = f"out {p.out!r} is also line {taken[key]}'s output; give each job its own name"
            continue
        taken[key] = ln.number
        over = images.get((out_dir / p.out).resolve()) if out_dir is not None else None
        if over is not None:
            p.error = f"out {p.out!r} would be written over line {over}'s image; give the output another name"
            continue
        if job.negative_prompt is not None and (refused := negative_prompt_refusal(spec)) is not None:
            p.error = refused
            continue
        if job.image is not None:
            try:
                load_input_image(job.image)  # read and checked now; read again when it runs
            except ChunkflowError as exc:
                p.error = str(exc)
                continue
        p.fit = fit_job(plan, spec, hw, job)
        p.error = p.fit.reason
    return out


# progress(phase, i, n): the load's bytes (phase "load"), a job's steps ("denoise"), a phase begun (i, n None)
ProgressCallback = Callable[[str, int | None, int | None], None]


def run_jobs(plan, cfg, opts, planned: list[PlannedJob], out_dir: Path, prompts_file: str,
             progress: ProgressCallback | None = None,
             on_job: Callable[[int, int, PlannedJob], None] | None = None,
             on_done: Callable[[JobResult], None] | None = None,
             log: Callable[[str], None] = lambda s: None) -> JobsReport:
    """Load once, run every planned job in order, write each output as it finishes; the report. KeyboardInterrupt
    (and SIGTERM) is re-raised after the report is built into the exception's `jobs_report`."""
    t0 = time.perf_counter()
    session = _open_session(plan, cfg, opts, planned, progress, log)
    results: list[JobResult] = []
    interrupted: BaseException | None = None
    try:
        interrupted = _run_all(session, planned, out_dir, results, progress, on_job, on_done, log)
    except BaseException as exc:  # a signal during the load or between jobs, or an error that stops the batch
        interrupted = exc
        _mark_not_run(planned, results, exc)
    finally:
        load = session.load_result
        session.close()
    report = _jobs_report(session, plan, prompts_file, out_dir, load, results, t0, interrupted)
    if interrupted is not None:
        interrupted.jobs_report = report  # type: ignore[attr-defined]
        raise interrupted
    return report


def _open_session(plan, cfg, opts, planned: list[PlannedJob], progress: ProgressCallback | None,
                  log: Callable[[str], None]):
    """The batch's one Session: the image pipeline where any job that runs gives an image."""
    from chunkflow.session import Session

    image = any(p.job is not None and p.job.image is not None and p.error is None for p in planned)
    return Session(plan, opts.weights, device=opts.device, variant=opts.variant, profile=opts.profile,
                   image=image, offload=cfg, transformer=opts.transformer, transformer_2=opts.transformer_2,
                   progress=progress, log=log, cache=opts.cache)


def _run_all(session, planned: list[PlannedJob], out_dir: Path, results: list[JobResult],
             progress: ProgressCallback | None, on_job: Callable[[int, int, PlannedJob], None] | None,
             on_done: Callable[[JobResult], None] | None, log: Callable[[str], None]) -> BaseException | None:
    """Every planned job in order (the pipeline loaded first), each one's result appended to `results`: the
    KeyboardInterrupt or SIGTERM that stopped a job (the jobs after it not run), else None."""
    from chunkflow.models.adapters import needs_image

    runnable = [p for p in planned if p.error is None]
    interrupted: BaseException | None = None
    cls = type(session.pipe)
    k = 0
    for p in planned:
        r = _refused(p)
        if r is None and p.job.image is None and needs_image(cls):
            r = _refused(p, f"{cls.__name__} (this run's pipeline: other jobs give images) animates an image: "
                         "give this job one (\"image\": \"path\"), or run the text-only jobs in a file of their "
                         "own")
        if r is not None:
            results.append(r)
            continue
        if interrupted is not None:
            results.append(_result(p, "not run", error="interrupted before it began"))
            continue
        k += 1
        if on_job is not None:
            on_job(k, len(runnable), p)
        interrupted = _run_job(session, p, out_dir, results, progress, on_done, log)
    return interrupted


def _run_job(session, p: PlannedJob, out_dir: Path, results: list[JobResult], progress: ProgressCallback | None,
             on_done: Callable[[JobResult], None] | None, log: Callable[[str], None]) -> BaseException | None:
    """One job generated and its output written, its result appended to `results`: the KeyboardInterrupt or
    SIGTERM that stopped it, else None. A job that breaks fails alone; an error not the job's is raised."""
    from chunkflow.hostmem import rss_bytes
    from chunkflow.signals import Terminated

    try:
        res = session.generate(p.job, image=p.job.image,
                               on_step=(lambda i, n: progress("denoise", i, n)) if progress else None,
                               on_phase=(lambda name: progress(name, None, None)) if progress else None)
    except (KeyboardInterrupt, Terminated) as exc:
        results.append(_result(p, "interrupted", error="stopped by the user"))
        return exc
    except ChunkflowError as exc:
        results.append(_result(p, "failed", error=str(exc)))
        log(f"line {p.line}: failed: {exc}")
        return None
    except Exception as exc:  # not the job's fault: the batch stops, with the report of what ran
        results.append(_result(p, "failed", error=f"{type(exc).__name__}: {exc}"))
        raise
    try:
        res.save(out_dir / p.out)
    except (ChunkflowError, OSError) as exc:  # this job's output lost (nothing half-written); the next runs
        results.append(_result(p, "failed", error=f"writing {p.out}: {exc}"))
        log(f"line {p.line}: failed: writing {p.out}: {exc}")
        return None
    done = _result(p, "done", res=res, rss=rss_bytes())
    results.append(done)
    if res.cache is not None:
        log(f"line {p.line}: {cache_line(res.cache)}")
    if on_done is not None:
        on_done(done)
    return None


def _mark_not_run(planned: list[PlannedJob], results: list[JobResult], exc: BaseException) -> None:
    """The jobs with no result yet when the batch stopped on `exc` appended as not run, saying why."""
    from chunkflow.signals import Terminated

    why = ("interrupted before it began" if isinstance(exc, (KeyboardInterrupt, Terminated)) else
           f"not run: the batch stopped on {type(exc).__name__}: {exc}")
    seen = {r.line for r in results}
    results.extend(_result(p, "not run", error=why) for p in planned if p.line not in seen)


def _jobs_report(session, plan, prompts_file: str, out_dir: Path, load, results: list[JobResult], t0: float,
                 interrupted: BaseException | None) -> JobsReport:
    """The batch's report: the environment, the load, every job's result, the time since `t0`."""
    from chunkflow.commands.steps import environment
    from chunkflow.signals import Terminated

    env = environment(session.device)
    return JobsReport(date=env["date"], command=env["command"], gpu=env["gpu"], torch=env["torch"],
                      diffusers=env["diffusers"], plan=plan, prompts_file=prompts_file, out_dir=str(out_dir),
                      load=load, jobs=results, total_s=time.perf_counter() - t0,
                      interrupted=isinstance(interrupted, (KeyboardInterrupt, Terminated)))


def _refused(p: PlannedJob, why: str | None = None) -> JobResult | None:
    if p.error is None and why is None:
        return None
    return _result(p, "refused", error=why or p.error)


def _result(p: PlannedJob, state: str, *, error: str | None = None, res=None, rss: int | None = None) -> JobResult:
    from chunkflow.reports import rel_error

    job = p.job
    shape = p.fit.shape if p.fit is not None else None
    if res is None:
        return JobResult(line=p.line, prompt=job.prompt if job else None, seed=job.seed if job else None,
                         state=state, error=error, shape=shape, out=None)
    return JobResult(line=p.line, prompt=job.prompt, seed=job.seed, state=state, out=p.out, error=error, shape=shape,
                     seconds=res.seconds, predicted_s=res.predicted_s,
                     time_error=rel_error(res.seconds, res.predicted_s) if res.predicted_s else None,
                     phases_s={name: m.time_s for name, m in res.phases.items()}, encode_cached=res.encode_cached,
                     host_rss_bytes=rss, cache=res.cache)


def cache_line(c) -> str:
    """What a step cache skipped in one generation (reports.CacheResult), in words."""
    return (f"cache {c.label}: {c.blocks_skipped} of {c.blocks_computed + c.blocks_skipped} block runs skipped, in "
            f"{c.forwards_skipped} of {c.forwards} forwards")
