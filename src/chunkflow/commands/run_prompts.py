"""`chunkflow run --prompts FILE`: the options checked, the jobs read and planned before the load (the refused ones
said), a bar for the jobs and one for the current job's phases, a table of every job at the end (commands.run_jobs
does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkflow.commands.app import UserError, _say, console, err_console
from chunkflow.commands.terminal import shown
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from chunkflow.commands.run_jobs import PlannedJob
    from chunkflow_planner.catalog import ModelSpec


def run_prompts(p, cfg, plan_path: str, prompts: str, out_dir: str | None, report: str, *, device, weights, variant,
                profile, seed: int, negative_prompt, guidance, steps, others: dict[str, Any],
                transformers: dict[str, str | None] | None = None, imports_s: float | None = None,
                max_job_s: float | None = None, cache=None) -> None:
    """Every job of `prompts` on one load of the plan's pipeline; `transformers` (--transformer FILE,
    --transformer-2 FILE): the same files for every job, checked with the folder before any job is read. `cache`:
    the step cache every job's generation runs with (a CacheSetting, checked; None: none)."""
    from chunkflow.commands.steps import RunOptions
    from chunkflow_planner.files import check_distinct, check_output_dir, check_output_file
    from chunkflow_planner.pipeline.jobs import read_jobs

    spec = _check_flags(p, others, guidance)
    files = {k: v for k, v in (transformers or {}).items() if v}
    opts = RunOptions(device=device, weights=weights, variant=variant, profile=profile, seed=seed, steps=steps,
                      warmup=0, transformer=files.get("transformer"), transformer_2=files.get("transformer_2"),
                      cache=cache)
    opts.check()
    _check_weights_needed(p, weights)
    lines = read_jobs(prompts)  # the file read and checked before any output is
    folder = check_output_dir(out_dir if out_dir is not None else "outputs", "--out-dir")
    check_output_file(report, "--report")
    check_distinct({"--report": report}, {"--plan": plan_path, "--prompts": prompts})
    resolved = _resolve_weights(weights, opts)
    _check_files(p, spec, resolved, files)
    defaults = {"seed": seed if seed else None, "negative_prompt": negative_prompt, "guidance": guidance,
                "steps": steps}
    planned = _plan_file(p, spec, lines, defaults, folder, resolved, profile, max_job_s)
    runnable = _runnable(planned, prompts)
    if weights is not None:
        from chunkflow.models.pipeline_build import check_folder

        check_folder(spec, resolved, image=any(j.job.image is not None for j in runnable))
    _make(folder)
    _say(f"{len(runnable)} job{'s' if len(runnable) != 1 else ''} to run"
         + (f", {len(planned) - len(runnable)} skipped" if len(runnable) < len(planned) else "")
         + f"; outputs to {folder}/")
    _run_and_report(p, cfg, opts, planned, folder, prompts, len(runnable), report, imports_s)


def _check_flags(p, others: dict[str, Any], guidance: float | None) -> ModelSpec:
    """The options --prompts refuses (`others`: flag -> value, those given), torchrun, a plan with no pipeline and
    a guidance that is not positive, refused before anything is read; the plan's model."""
    from chunkflow.launch import torchrun_world
    from chunkflow_planner.plan import model_of

    given = [flag for flag, v in others.items() if v is not None]
    if given:
        raise UserError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not go with --prompts: each job "
                        "of the file is one generation (its image and output name are fields of its line)")
    if torchrun_world() > 1:
        raise UserError("--prompts runs on one GPU; leave torchrun out")
    spec = model_of(p)
    if spec.pipeline is None:
        raise UserError(f"{spec.name} has no pipeline to generate with; --prompts needs a plan of a whole pipeline")
    if guidance is not None and not guidance > 0:
        raise UserError(f"--guidance must be a positive number, got {guidance}")
    return spec


def _check_weights_needed(p, weights: str | None) -> None:
    """Refused without --weights where the plan needs the model's files (chunkflow_planner.plan.files_needed)."""
    from chunkflow_planner.plan import files_needed

    why = files_needed(p)
    if why is not None and weights is None:
        raise UserError(why)


def _resolve_weights(weights: str | None, opts) -> Path | None:
    """--weights as the folder it names (a Hub id found in the local cache too), set on `opts`; None without."""
    if weights is None:
        return None
    from chunkflow.weights import resolve_weights

    resolved = resolve_weights(weights)
    opts.weights = str(resolved)
    return resolved


def _plan_file(p, spec, lines, defaults: dict[str, Any], folder: Path, resolved: Path | None, profile,
               max_job_s: float | None) -> list[PlannedJob]:
    """Every line of the file planned against the loaded placement (run_jobs.plan_jobs), the jobs giving an image
    the pipeline cannot take refused, each job's time predicted and, with `max_job_s`, admitted by it."""
    from chunkflow.commands.run_jobs import plan_jobs
    from chunkflow_planner.plan import hardware_of

    hw = hardware_of(p, profile)
    planned = plan_jobs(p, spec, hw, lines, defaults, folder)
    _refuse_images(spec, resolved, planned)
    admit_by_time(p, planned, max_job_s)
    return planned


def _runnable(planned: list[PlannedJob], prompts: str) -> list[PlannedJob]:
    """The jobs that run, each refused line said; JobsError where none can."""
    from chunkflow.commands.run_jobs import JobsError

    runnable = [j for j in planned if j.error is None]
    for j in planned:
        if j.error is not None:
            _say(f"line {j.line}: skipped: {shown(j.error, one_line=True)}")
    if not runnable:
        raise JobsError(f"no job of {prompts!r} can run ({len(planned)} refused, said above); fix the lines and "
                        "run again")
    return runnable


def _run_and_report(p, cfg, opts, planned: list[PlannedJob], folder: Path, prompts: str, total: int, report: str,
                    imports_s: float | None) -> None:
    """The jobs run with bars, the report written and every job's row printed; where the batch stopped (Ctrl-C,
    SIGTERM, an error), the report of what was done first, then the exception raised again."""
    try:
        rep = _with_bars(p, cfg, opts, planned, folder, prompts, total)
        rep.load.imports_s = imports_s
    except BaseException as exc:  # Ctrl-C, SIGTERM: the report of what was done
        rep = getattr(exc, "jobs_report", None)
        if rep is not None:
            rep.load.imports_s = imports_s
            rep.write(report)
            print_jobs(rep)
            how = "Interrupted" if rep.interrupted else f"Stopped by an error ({type(exc).__name__})"
            console.print(f"{how}: the jobs done are written; report written to {report}", markup=False)
        raise
    rep.write(report)
    print_jobs(rep)
    console.print(f"Report written to {report}", markup=False)


def _check_files(p, spec, folder: Path | None, files: dict[str, str]) -> None:
    """The transformer files against the folder's configs and the plan's format, from their headers, before any
    job is read or output written (the same check as `run --prompt`'s)."""
    from chunkflow.models.transformer_file import check_files, check_plan_format

    if files and folder is None:
        raise UserError("--transformer FILE reads the transformer from a file and the rest of the pipeline from the "
                        "folder: give --weights DIR with it")
    if files:
        check_files(spec, folder, files)
    check_plan_format(p, files)


def admit_by_time(plan, planned, max_job_s: float | None) -> None:
    """Each job's predicted time and the upper end of its band (the plan's generation band), the first job to run
    with the process's start-up; with `max_job_s`, a job whose upper end is over it refused with both."""
    from chunkflow_planner.bands import MODEL_PRIOR

    band = plan.prediction.bands.get("generation_time_s") if plan.prediction is not None else None
    rel = band.rel if band is not None else MODEL_PRIOR["generation_time"]
    nominal = " (nominal: a CPU plan's times are not predictions)" if plan.hardware.device_is_host else ""
    first = True
    for j in planned:
        if j.error is not None or j.fit is None:
            continue
        j.predicted_s = j.fit.expected_s(first)
        j.upper_s = j.predicted_s * (1 + rel)
        if max_job_s is not None and j.upper_s > max_job_s:
            j.error = (f"predicted {format_seconds(j.predicted_s)}, up to {format_seconds(j.upper_s)} (+{rel:.0%}), "
                       f"over --max-job-time {format_seconds(max_job_s)}{nominal}: make it smaller (fewer frames, "
                       "a smaller size, fewer steps) or raise the limit")
            continue
        first = False


def _refuse_images(spec, folder: Path | None, planned) -> None:
    """The jobs giving an image, refused with the reason where the folder's pipeline (or the plan's, with random
    weights) has no image pipeline the same components run: those lines are skipped, the others run."""
    from chunkflow.models.adapters import run_class
    from chunkflow.models.pipeline_build import check_folder

    with_image = [j for j in planned if j.error is None and j.job.image is not None]
    if not with_image:
        return
    try:
        if folder is not None:
            check_folder(spec, folder, image=True)
        else:
            run_class(spec.pipeline.cls, None, True, spec=spec)
    except ChunkflowError as exc:
        if folder is not None:
            check_folder(spec, folder, image=False)  # a folder wrong whatever the jobs: its own error, for all
        for j in with_image:
            j.error = f"this folder's pipeline takes no image: {exc}"


def _make(folder: Path) -> None:
    """The output folder (checked before: files.check_output_dir), made once the jobs are known to run."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out-dir {str(folder)!r} cannot be made ({exc.strerror}); give a folder you can write "
                        "to") from None


def _with_bars(p, cfg, opts, planned, folder: Path, prompts: str, total: int):
    """run_jobs with a bar for the load, one for the jobs, one for the current job's phases."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from chunkflow.commands.run_jobs import run_jobs

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   TimeElapsedColumn(), console=err_console, transient=False)
    state: dict[str, Any] = {"load": None, "jobs": None, "phase": None, "name": None}

    def progress(phase: str, i: int | None, n: int | None) -> None:
        if phase == "load":
            if state["load"] is None:
                state["load"] = bar.add_task("load", total=None, count="")
            count = f"{format_bytes(i or 0)} of {format_bytes(n or 0)}" if n else "random weights"
            bar.update(state["load"], completed=i or 0, total=n or None, count=count)
            return
        if state["phase"] is None:
            state["phase"] = bar.add_task(phase, total=None, count="")
        count = f"{i}/{n}" if n else ""
        bar.update(state["phase"], description=f"  {phase}", completed=i or 0, total=n or None, count=count)

    def on_job(k: int, n: int, job) -> None:
        if state["load"] is not None:
            t = bar.tasks[state["load"]]
            bar.update(state["load"], completed=t.total or 1, total=t.total or 1)
            bar.stop_task(state["load"])
        if state["jobs"] is None:
            state["jobs"] = bar.add_task("jobs", total=n, count="")
        bar.update(state["jobs"], completed=k - 1, count=f"{k}/{n}: line {job.line} {job.job.label(40)!r}")
        if job.predicted_s is not None:
            _say(f"line {job.line}: starting, predicted {format_seconds(job.predicted_s)} (up to "
                 f"{format_seconds(job.upper_s)})")

    def on_done(_res) -> None:
        t = bar.tasks[state["jobs"]]
        bar.update(state["jobs"], completed=t.completed + 1)

    with bar:
        return run_jobs(p, cfg, opts, planned, folder, prompts, progress=progress, on_job=on_job, on_done=on_done,
                        log=_say)


def print_jobs(rep) -> None:
    """Every job: its state, output, time measured against the plan's prediction for it."""
    from rich.markup import escape
    from rich.table import Table

    done = [j for j in rep.jobs if j.state == "done"]
    timed = any(j.predicted_s is not None for j in rep.jobs)
    imports = f" after {rep.load.imports_s:.1f} s importing torch and diffusers" if rep.load.imports_s else ""
    t = Table(title=f"{rep.plan.model.name}: {len(done)} of {len(rep.jobs)} jobs done, one load "
                    f"({rep.load.measured_time_s:.1f} s{imports}), {rep.total_s:.1f} s in all, on {rep.gpu}")
    cols = ["line", "state", "prompt", "shape", "measured"] + (["predicted", "error"] if timed else [])
    for col in cols + ["output / reason"]:
        t.add_column(col, justify="right" if col in ("line", "measured", "predicted", "error") else "left")
    for j in rep.jobs:
        why = j.error or ""
        row = [str(j.line), j.state, escape(_short(j.prompt or "", 40)), j.shape or "",
               f"{j.seconds:.2f} s" if j.seconds is not None else ""]
        if timed:
            row += [f"{j.predicted_s:.2f} s" if j.predicted_s is not None else "",
                    f"{j.time_error:+.1%}" if j.time_error is not None else ""]
        t.add_row(*row, escape(j.out if j.state == "done" else _short(why, 60)))
    console.print(t)
    if done and done[0].predicted_s is None:
        console.print("(the plan's times are compared on a GPU only: on the CPU they are nominal)", markup=False)
    rss = [j.host_rss_bytes for j in done if j.host_rss_bytes]
    if rss:
        console.print(f"host memory after each job: {format_bytes(min(rss))} to {format_bytes(max(rss))}",
                      markup=False)


def _short(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters (the report keeps it whole)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
