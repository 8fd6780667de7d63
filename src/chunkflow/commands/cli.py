"""The `chunkflow` command line. Commands import torch only where they need it: `plan` never does.

One boundary for errors (`_command`): a ChunkflowError (bad input, an impossible request) is one line and exit
code 2; an infeasible plan says which constraint binds, exit 2; anything else is a bug: a short message saying
where to report it, exit 1, and the traceback only with `chunkflow --debug ...`. Every input is checked before
any expensive work (output paths included), and every file is written atomically (chunkflow_planner.files).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from chunkflow.launch import torchrun_rank, torchrun_world
from chunkflow_planner import __version__
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.offload import DEFAULT_CHUNK_BYTES
from chunkflow_planner.units import format_bytes, format_seconds, parse_duration, parse_size, short_bytes

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Run large diffusion transformers with weights streamed from host memory in chunks.",
)
console = Console()
err_console = Console(stderr=True, soft_wrap=True)


ISSUES_URL = "https://github.com/chunkflow/chunkflow/issues"
_debug = {"on": False}  # set by `chunkflow --debug`: unexpected errors keep their traceback


class UserError(ChunkflowError):
    """Bad input: printed as one clear message, exit code 2, no traceback."""


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # the user's words, verbatim
    raise typer.Exit(code)


def _say(message: str) -> None:
    """A line on stderr, printed as it is (file names and prompts may hold [brackets] rich would take as markup)."""
    err_console.print(message, highlight=False, markup=False)


def _command(name: str):
    """Register a command behind the one error boundary (see the module docstring)."""
    from chunkflow_planner.policy import Infeasible

    def decorate(fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            from rich.markup import escape

            from chunkflow.signals import Terminated, exit_code, interrupted
            from chunkflow_planner.files import note_interrupt

            note_interrupt(None)  # a command of its own (several may run in one process: tests, notebooks)
            try:
                result = fn(*args, **kwargs)
                if interrupted() is not None:  # a library swallowed the signal: still no success
                    raise KeyboardInterrupt
                return result
            except Infeasible as exc:
                err_console.print(f"[bold red]infeasible:[/] {escape(str(exc))}", highlight=False)
                raise typer.Exit(2) from None
            except ChunkflowError as exc:
                if interrupted() is not None:  # an error while stopping for a signal: the signal's code
                    _say("interrupted")
                    raise typer.Exit(exit_code()) from None
                _fail(str(exc))
            except (KeyboardInterrupt, Terminated) as exc:
                _say("interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated")
                raise typer.Exit(exit_code(15 if isinstance(exc, Terminated) else interrupted() or 2)) from None
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except Exception as exc:  # a bug: say so briefly, keep the traceback for --debug
                if interrupted() is not None:  # what stopping for a signal broke (an encoder's pipe): the signal's
                    _say("interrupted")
                    raise typer.Exit(exit_code()) from None
                if isinstance(exc, BrokenPipeError):  # stdout closed by its reader (`plan --json | head`): quietly
                    import os

                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                    raise typer.Exit(1) from None
                if _debug["on"]:
                    raise
                if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: stdout or an output on a full disk
                    _fail(f"no space left on the device to write to ({exc.filename or 'the output'}); free some "
                          "and run it again", code=1)
                err_console.print(f"[bold red]internal error:[/] {escape(f'{type(exc).__name__}: {exc}')}\nThis is a bug in "
                                  f"chunkflow {__version__}; please report it at {ISSUES_URL} with the command. "
                                  "Run `chunkflow --debug ...` for the traceback.", highlight=False)
                raise typer.Exit(1) from None

        doc = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        return app.command(name, short_help=doc)(guarded)

    return decorate


def _version(value: bool) -> None:
    if value:
        console.print(f"chunkflow {__version__} (the chunkflow-dit package)", highlight=False)
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def main_callback(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="print chunkflow's version and exit"),
    debug: bool = typer.Option(False, "--debug", help="show the Python traceback of an unexpected error"),
) -> None:
    """Run large diffusion transformers with weights streamed from host memory in chunks."""
    _debug["on"] = debug
    if ctx.invoked_subcommand is None:
        console.print(ctx.get_help(), highlight=False)
        raise typer.Exit(0)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)


# ------------------------------------------------------------------------------------------- catalogs


@_command("models")
def models_cmd() -> None:
    """List the model catalog (models.yaml)."""
    from chunkflow_planner.catalog import load_models

    table = Table(title="Models (models.yaml)")
    for col in ("name", "aliases", "blocks x width", "weights", "default workload"):
        table.add_column(col, no_wrap=col in ("name", "weights"))
    for spec in load_models().values():
        blocks = " + ".join(f"{g.count} {g.kind.replace('mmdit_', '')}" for g in spec.blocks) + f" x {spec.d}"
        w = spec.default_workload
        wl = f"{w.width}x{w.height}" + (f" x{w.frames}" if spec.is_video else f", batch {w.batch}") + f", {w.steps} steps"
        total = spec.nbytes + (sum(te.nbytes for te in spec.pipeline.text_encoders) + spec.pipeline.vae.nbytes
                               if spec.pipeline is not None else 0)
        table.add_row(spec.name, ", ".join(spec.aliases), blocks, format_bytes(total), wl)
    console.print(table)


@_command("hardware")
def hardware_cmd() -> None:
    """List the hardware catalog (hardware.yaml) and the profile saved by `chunkflow calibrate`, if any."""
    from chunkflow_planner.catalog import load_hardware
    from chunkflow_planner.planner import saved_profile_path

    table = Table(title="Hardware (hardware.yaml)")
    catalog = load_hardware()
    width = max(len(n) for n in catalog)  # the name whole at any width (what --hardware takes); the rest may wrap
    for col in ("name", "TFLOP/s", "H2D GB/s", "memory", "GPUs", "peer", "eta comp / pref"):
        table.add_column(col, no_wrap=col == "name", min_width=width if col == "name" else None)
    for hw in catalog.values():
        gpus = str(hw.gpus) + (f" ({hw.gpus_per_host_link}/link)" if hw.gpus_per_host_link > 1 else "")
        table.add_row(hw.name, f"{hw.peak_tflops:g}", f"{hw.h2d_gbps:.1f}", format_bytes(hw.memory_bytes), gpus,
                      hw.peer_link, f"{hw.eta_comp:.2f} / {hw.eta_pref:.2f}")
    console.print(table)
    path = saved_profile_path()
    console.print(f"Calibrated profile on this machine: {path if path.exists() else 'none (run `chunkflow calibrate`)'}",
                  markup=False)


# ----------------------------------------------------------------------------------------------- plan


@_command("plan")
def plan_cmd(
    model: str = typer.Option(..., "--model", "-m", help="catalog model name or alias (see `chunkflow models`)"),
    frames: Optional[int] = typer.Option(None, help="video frames (1 mod the VAE's temporal factor)"),
    batch: Optional[int] = typer.Option(None, help="batch size"),
    height: Optional[int] = typer.Option(None, help="image/video height in pixels"),
    width: Optional[int] = typer.Option(None, help="image/video width in pixels"),
    steps: Optional[int] = typer.Option(None, help="denoising steps"),
    sp: int = typer.Option(1, "--sp", help="Ulysses sequence-parallel degree"),
    hardware: Optional[str] = typer.Option(None, help="catalog GPU (see `chunkflow hardware`) or a calibrated profile file"),
    mem_budget: Optional[str] = typer.Option(None, help="GPU memory available, e.g. 24GB or 22GiB (default: the GPU's memory)"),
    mem_margin: Optional[float] = typer.Option(None, help="share of --mem-budget kept free for the memory model's "
                                               "error, e.g. 0.05 (default: the hardware profile's, measured; 0 plans "
                                               "to the byte)"),
    max_slowdown: Optional[float] = typer.Option(None, help="latency target relative to no offload: per step for the "
                                                 "transformer (default 1.05) and, when given, for the whole generation"),
    target_step_time: Optional[str] = typer.Option(None, help="absolute latency target per step, e.g. 1.2s"),
    target_time: Optional[str] = typer.Option(None, help="latency target of the whole generation, e.g. 5min or 90s "
                                              "(default: none, or --max-slowdown x everything on the GPU if given)"),
    host_mem_budget: Optional[str] = typer.Option(None, help="host memory available, e.g. 64GB (default: what this "
                                                  "machine has available now)"),
    transformer_only: bool = typer.Option(False, "--transformer-only", help="plan the transformer alone (no text "
                                          "encoder, VAE or host memory), as the ChunkFlow paper does"),
    cfg_batching: str = typer.Option("auto", help="run a step's two guidance passes as one batched forward, so each "
                                     "block is streamed once a step: auto (the planner decides), on, off"),
    weight_dtype: str = typer.Option("auto", help="storage of the streamed weights: auto (bf16, or fp8_e4m3 where it "
                                     "pays if --allow-fp8), bf16, fp8_e4m3 (lossy: half the host and H2D bytes)"),
    allow_fp8: bool = typer.Option(False, "--allow-fp8", help="let --weight-dtype auto choose lossy fp8 storage"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="write the plan JSON here"),
    json_out: bool = typer.Option(False, "--json", help="print the plan JSON on stdout instead of tables"),
    peak_tflops: Optional[float] = typer.Option(None, help="what-if: peak dense BF16 TFLOP/s"),
    h2d_gbps: Optional[float] = typer.Option(None, help="what-if: effective per-GPU host-to-device GB/s (BW_h2d)"),
    eta_comp: Optional[float] = typer.Option(None, help="what-if: compute efficiency factor"),
    eta_pref: Optional[float] = typer.Option(None, help="what-if: prefetch efficiency factor"),
    prefetch_bytes: Optional[str] = typer.Option(None, help="what-if: per-block prefetch volume, e.g. 520MB"),
    text_len: Optional[int] = typer.Option(None, help="what-if: text context length L_ctx"),
    weights: Optional[str] = typer.Option(None, help="the pipeline folder (or Hub id in the local cache) it will "
                                          "load: its files' headers give the bytes the load reads, and it is "
                                          "checked to hold this model's pipeline"),
    variant: Optional[str] = typer.Option(None, help="with --weights: the variant files it will read, e.g. fp16"),
) -> None:
    """Predict step time and peak memory per offload mode and choose chunk size and residency."""
    import math

    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.files import check_output_file
    from chunkflow_planner.planner import make_plan, resolve_hardware
    from chunkflow_planner.policy import Levers
    from chunkflow_planner.workload import make_workload

    if max_slowdown is not None and target_step_time is not None:
        raise UserError("give either --max-slowdown or --target-step-time, not both")
    if max_slowdown is not None and not (math.isfinite(max_slowdown) and max_slowdown >= 1.0):
        raise UserError(f"--max-slowdown is relative to no offload and must be a number >= 1.0, got {max_slowdown}")
    if text_len is not None and text_len < 0:
        raise UserError(f"--text-len must be >= 0, got {text_len}")
    if mem_margin is not None and not (math.isfinite(mem_margin) and 0 <= mem_margin <= 0.5):
        raise UserError(f"--mem-margin is a share of the budget between 0 and 0.5 (e.g. 0.05), got {mem_margin}")
    if out:
        from chunkflow_planner.files import check_distinct

        check_output_file(out, "--out")
        check_distinct({"--out": out}, {"--hardware": hardware if hardware and Path(hardware).exists() else None})
    spec = get_model(model)
    workload = make_workload(spec, batch=batch, frames=frames, height=height, width=width, steps=steps)
    levers = Levers.of(workload.cfg_passes, cfg_batching, weight_dtype, allow_fp8)
    resolved = resolve_hardware(hardware, peak_tflops=peak_tflops, h2d_gbps=h2d_gbps, eta_comp=eta_comp,
                                eta_pref=eta_pref)
    budget = parse_size(mem_budget, "--mem-budget") if mem_budget is not None else None
    target = parse_duration(target_step_time, "--target-step-time") if target_step_time is not None else None
    gen_target = parse_duration(target_time, "--target-time") if target_time is not None else None
    host_budget = parse_size(host_mem_budget, "--host-mem-budget") if host_mem_budget is not None else None
    pbytes = parse_size(prefetch_bytes, "--prefetch-bytes") if prefetch_bytes is not None else None
    if transformer_only and (gen_target is not None or host_budget is not None):
        raise UserError("--target-time and --host-mem-budget plan the whole pipeline; leave them out with "
                        "--transformer-only")
    if variant is not None and weights is None:
        raise UserError("--variant names the variant files of the folder --weights gives; add --weights")
    read_bytes = None
    if weights is not None:
        from chunkflow.weights import resolve_weights
        from chunkflow_planner.checkpoint import pipeline_read_bytes

        if transformer_only or spec.pipeline is None:
            raise UserError("--weights prices the load of a whole pipeline; leave it out with --transformer-only")
        read_bytes = pipeline_read_bytes(resolve_weights(weights), spec, variant)
    plan, decision, analysis = make_plan(
        spec, workload, resolved, sp=sp, budget=budget,
        max_slowdown=None if target is not None else (max_slowdown or 1.05),
        target_step_time=target, prefetch_bytes=pbytes, text_len=text_len, pipeline=not transformer_only,
        host_budget=host_budget, target_time=gen_target, generation_slowdown=max_slowdown, levers=levers,
        mem_margin=mem_margin, read_bytes=read_bytes,
    )
    if not transformer_only and spec.pipeline is not None and plan.pipeline is None:
        flags = [f for f, given in (("--sp", sp > 1), ("--prefetch-bytes", pbytes is not None),
                                    ("--text-len", text_len is not None)) if given]
        _say(f"note: {' and '.join(flags)} plan the transformer alone (a whole pipeline is planned for one GPU with "
             "the catalog's own volumes): the plan has no pipeline section, and `run --prompt` places the other "
             "components for their phase only")
    if out:
        plan.write(out)
    if json_out:
        sys.stdout.write(plan.to_json() + "\n")
        return
    from chunkflow.commands.plan_tables import print_plan

    print_plan(console, plan, decision, analysis)
    if out:
        console.print(f"Plan written to {out}", markup=False)


# ------------------------------------------------------------------------------------------------ run


@_command("run")
def run_cmd(
    plan: str = typer.Option(..., "--plan", "-p", help="plan file written by `chunkflow plan --out`"),
    mode: Optional[str] = typer.Option(None, help="override the plan's mode: none, layerwise or chunkflow"),
    chunk_size: Optional[str] = typer.Option(None, help="override the chunk size, e.g. 16MB or 4KB"),
    residency: Optional[float] = typer.Option(None, help="override the residency, a fraction in [0, 1]"),
    cfg_batched: Optional[bool] = typer.Option(None, "--cfg-batched/--no-cfg-batched", help="override the plan: "
                                               "both guidance passes of a step in one forward, or one forward each"),
    fp8_cast: Optional[str] = typer.Option(None, help="override the plan's fp8 cast: compute (the compute stream, "
                                           "before each block) or copy (the copy stream, after its copies)"),
    weight_dtype: Optional[str] = typer.Option(None, help="override the plan's weight storage: bf16 or fp8_e4m3 "
                                               "(lossy)"),
    device: Optional[str] = typer.Option(None, help="cuda (default when available), cuda:1 or cpu"),
    weights: Optional[str] = typer.Option(None, help="local diffusers-format checkpoint directory (default: random weights)"),
    variant: Optional[str] = typer.Option(None, help="with --weights: load the folder's variant files, e.g. fp16 "
                                                     "(as diffusers' from_pretrained(variant=...)); a component "
                                                     "without them loads its default files"),
    warmup: Optional[int] = typer.Option(None, help="untimed warm-up steps (default 1); with --prompt, whole "
                                         "generations before the measured one (default 0: the process's first, "
                                         "start-up included, as the plan predicts; 1 with --repeat)"),
    steps: Optional[int] = typer.Option(None, help="timed denoising steps (default: the plan's steps, at most 5)"),
    repeat: int = typer.Option(1, help="with --prompt: generations measured after the warm-up (which --repeat 2 "
                                       "or more makes 1 by default); the report gives each phase's median and "
                                       "every generation's time"),
    profile: Optional[str] = typer.Option(None, help="hardware profile or catalog GPU to predict with (default: the plan's)"),
    report: str = typer.Option("run-report.json", help="where to write the JSON run report"),
    seed: int = typer.Option(0, help="seed for random weights and inputs; with --prompt also the generator's, as "
                                     "diffusers' torch.Generator(device).manual_seed(seed)"),
    prompt: Optional[str] = typer.Option(None, help="generate from this prompt with the whole pipeline (text "
                                                    "encoders, transformer, VAE) placed as the plan says"),
    negative_prompt: Optional[str] = typer.Option(None, help="with --prompt: what to steer away from (CFG models)"),
    guidance: Optional[float] = typer.Option(None, help="with --prompt: guidance scale (default: the model's)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="with --prompt: write the result here, .mp4 (video) "
                                                               "or .png (image)"),
    latents: Optional[str] = typer.Option(None, help="also save the final latents (safetensors): of the generation "
                                          "with --prompt, else of the timed steps (to compare settings)"),
) -> None:
    """Run the plan's workload: warm-up and timed denoising steps with a flow-matching Euler scheduler; or, with
    --prompt, generate a video or image with the whole diffusers pipeline.

    Each step is cfg_passes transformer forwards plus one scheduler step. Prints measured against predicted
    step time and peak GPU memory and writes a run report. Under torchrun (WORLD_SIZE > 1) the model runs
    with Ulysses sequence parallelism over the processes; rank 0 prints and writes the report.

    With --prompt, --weights takes a diffusers pipeline folder (model_index.json) or a Hub id found in the local
    Hugging Face cache (never downloaded); without --weights every component has random weights. Each phase
    (encode, denoise, decode) is measured against the plan; --steps then counts every step of the generation.
    """
    import math
    import os

    from chunkflow_planner.files import check_output_file
    from chunkflow_planner.plan import load_plan
    from chunkflow_planner.predict import hardware_of

    p = load_plan(plan)
    cfg = p.offload.with_overrides(mode, chunk_size, residency, cfg_batched=cfg_batched,
                                   weight_dtype=weight_dtype, fp8_cast=fp8_cast)  # the flags are parsed here, once
    from chunkflow.commands.run import RunOptions, run_plan

    generating = prompt is not None
    if warmup is None:
        warmup = (1 if repeat > 1 else 0) if generating else 1
    opts = RunOptions(device=device, weights=weights, variant=variant, warmup=warmup, steps=steps, profile=profile,
                      seed=seed, repeat=repeat)
    if not generating and any(v is not None for v in (negative_prompt, guidance, out)):
        raise UserError("--negative-prompt, --guidance and --out go with --prompt (a generation)")
    opts.check()  # bad options fail before anything is built
    if generating:
        if guidance is not None and not (math.isfinite(guidance) and guidance > 0):
            raise UserError(f"--guidance must be a positive number, got {guidance}")
        if torchrun_world() > 1:
            raise UserError("--prompt runs on one GPU; leave torchrun out (sequence-parallel generation is not "
                            "supported yet)")
        if latents is not None:
            check_output_file(latents, "--latents")
        _check_generation(p, prompt, negative_prompt, out)
    else:
        if latents is not None:
            check_output_file(latents, "--latents")
            opts.latents = latents
    folder = None
    if weights is not None and generating:
        from chunkflow.weights import resolve_weights

        folder = resolve_weights(weights)  # a missing folder or uncached Hub id fails before anything is built
    elif weights is not None:  # the synthetic steps read a transformer folder
        folder = Path(weights).expanduser()
    hardware_of(p, profile)
    check_output_file(report, "--report")
    from chunkflow_planner.files import check_distinct

    check_distinct({"--out": out, "--report": report, "--latents": latents},
                   {"--plan": plan, "--weights": folder, "--profile": profile if profile and Path(profile).exists()
                    else None})

    # a plan's peak memory is what the allocator reserves: expandable segments keep that close to what torch
    # allocates (the planner's reserve_fraction). Set before torch starts CUDA; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from chunkflow.commands.plan_tables import print_run

    if generating:
        _generate(p, cfg, opts, prompt, negative_prompt, guidance, out, latents, report)
        return

    with _progress() as bar:
        task = bar.add_task("denoising steps", total=None)
        rep = run_plan(p, cfg, opts, progress=lambda i, n: bar.update(task, completed=i, total=n),
                       log=_say)
    if rep is None:  # not rank 0
        return
    rep.write(report)
    print_run(console, rep)
    console.print(f"Run report written to {report}", markup=False)


def _check_generation(p, prompt: str, negative_prompt: str | None, out: str | None) -> None:
    """A generation's words and output fit the plan's model, before anything is built: text that is UTF-8, a
    negative prompt only where the pipeline uses one, a video file for a video model and an image for an image
    model."""
    from chunkflow.generate import takes_negative_prompt
    from chunkflow_planner.catalog import get_model

    spec = get_model(p.model.name)
    for flag, text in (("--prompt", prompt), ("--negative-prompt", negative_prompt)):
        if text is None:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{flag} is not valid UTF-8 text (bytes the terminal could not decode); give it as UTF-8")
        if not text.strip():
            raise UserError(f"{flag} is empty; give the words to {'generate' if flag == '--prompt' else 'avoid'}")
    if negative_prompt is not None and not takes_negative_prompt(spec):
        raise UserError(f"{spec.name}'s pipeline takes no negative prompt (its guidance is "
                        f"{'distilled into the model' if spec.pipeline.adapter == 'flux' else 'embedded'}: --guidance "
                        "sets it); leave --negative-prompt out")
    if out is not None:
        from chunkflow.media import check_media_path

        kind = check_media_path(out)
        if spec.is_video and kind != "video":
            raise UserError(f"{spec.name} makes videos; write --out to a .mp4 file (not {out!r})")
        if not spec.is_video and kind == "video":
            raise UserError(f"{spec.name} makes images; write --out to a .png file (not {out!r})")


def _generate(p, cfg, opts, prompt, negative_prompt, guidance, out, latents, report) -> None:
    """`run --prompt`: the whole pipeline, phase by phase, with a progress bar over the denoising steps."""
    from chunkflow.commands.plan_tables import print_generation
    from chunkflow.commands.run_generate import GenerateOptions, run_generation

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from chunkflow_planner.units import format_bytes

    g = GenerateOptions(prompt=prompt, negative_prompt=negative_prompt, guidance=guidance, out=out, latents=latents)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   TimeElapsedColumn(), console=err_console, transient=False)
    with bar:
        tasks: dict[str, int] = {}  # a bar (and a clock) for each phase: the load's bytes, the steps of denoise

        def progress(phase: str, i: int | None, n: int | None) -> None:
            if phase not in tasks:
                for name, task in tasks.items():  # the phase before is over
                    bar.update(task, completed=bar.tasks[task].total or 1, total=bar.tasks[task].total or 1)
                    bar.stop_task(task)
                tasks[phase] = bar.add_task(phase, total=None, count="")
            if phase == "load":
                count = f"{format_bytes(i or 0)} of {format_bytes(n or 0)}" if n else "random weights"
            else:
                count = f"{i or 0}/{n}" if n else ""
            bar.update(tasks[phase], completed=i or 0, total=n or None, count=count)

        rep = run_generation(p, cfg, opts, g, progress=progress, log=_say)
    rep.write(report)
    print_generation(console, rep)
    if out:
        console.print(f"Written: {out}", markup=False)
    console.print(f"Run report written to {report}", markup=False)


# ------------------------------------------------------------------------------------------ calibrate


@_command("calibrate")
def calibrate_cmd(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="catalog model(s) whose blocks set the eta_comp "
                                        "curves, comma-separated (e.g. wan2.2,flux,hunyuan; default wan2.2); each "
                                        "model listed gets its own curve"),
    out: str = typer.Option("profile.yaml", "--out", "-o", help="write the hardware profile (YAML) here"),
    save: Optional[bool] = typer.Option(None, "--save/--no-save",
                                        help="also save it as this machine's default profile (default: yes, except --cpu-smoke)"),
    cpu_smoke: bool = typer.Option(False, "--cpu-smoke", help="run every measurement tiny on the CPU (tests); the numbers mean nothing"),
    from_report: Optional[list[str]] = typer.Option(None, "--from-report",
                                                    help="refit instead of measuring: run report(s) (.json, or .jsonl "
                                                         "with one per line); repeat the flag, or give a pattern: "
                                                         "out/*-report.json"),
    profile: Optional[str] = typer.Option(None, help="with --from-report: the profile to refit (default: each report's own)"),
    gemm_size: int = typer.Option(8192, help="n of the n^3 bf16 GEMM"),
    peak_tflops: Optional[float] = typer.Option(None, help="P_peak to express eta against (default: the catalog GPU's datasheet peak)"),
    base: Optional[str] = typer.Option(None, help="catalog GPU whose unmeasured fields the profile inherits (default: by GPU name)"),
    raw: Optional[str] = typer.Option(None, help="also write the raw measurements as JSON here"),
    weights: Optional[str] = typer.Option(None, help="time the disk this pipeline folder (or Hub id in the local "
                                          "cache) is on, as the loader reads it, cold and warm (default: the "
                                          "Hugging Face cache's disk)"),
    more_reports: Optional[list[str]] = typer.Argument(None, metavar="REPORT", show_default=False,
                                                       help="with --from-report: more run reports (what an unquoted "
                                                            "pattern, --from-report out/*-report.json, expands to)"),
) -> None:
    """Measure this machine (GEMM rate, eta_comp curve of a real block, pinned H2D, and under torchrun the
    all-to-all and its contention with H2D) and write a hardware profile that `chunkflow plan` uses.

    Saving over this machine's default profile keeps the previous one beside it (hardware-profile.previous.yaml)
    and prints what changed."""
    import math

    from chunkflow_planner.files import check_output_file

    if gemm_size < 1:
        raise UserError(f"--gemm-size must be positive, got {gemm_size}")
    import os

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `run` measures
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise UserError(f"--peak-tflops must be a positive number, got {peak_tflops}")
    if cpu_smoke and model is not None:
        raise UserError("--cpu-smoke measures the tiny catalog model; leave --model out (it is for GPU runs)")
    if more_reports and not from_report:
        raise UserError(f"unexpected argument(s) {' '.join(more_reports)} (report files go after --from-report: "
                        "`chunkflow calibrate --from-report out/*-report.json`)")
    from_report = (from_report or []) + (more_reports or [])
    if from_report and (cpu_smoke or model is not None or raw is not None or weights is not None):
        raise UserError("--from-report refits from run reports; --model, --cpu-smoke, --raw and --weights measure: use "
                        "one or the other")
    if weights is not None:
        from chunkflow.calibrate_disk import disk_folder

        disk_folder(weights)  # a missing folder or uncached Hub id fails before anything is measured
    check_output_file(out, "--out")
    if raw:
        check_output_file(raw, "--raw")
    default = save if save is not None else not cpu_smoke
    from chunkflow_planner.files import check_distinct, check_output_dir
    from chunkflow_planner.planner import config_dir, saved_profile_path

    if default:  # where the default profile goes must take it, known before the measurement
        check_output_dir(config_dir(), "chunkflow's config directory ($CHUNKFLOW_CONFIG_DIR)")
    previous = saved_profile_path().with_name("hardware-profile.previous.yaml") if default else None
    check_distinct({"--out": out, "--raw": raw, "the previous default profile": previous},
                   {**{f"--from-report {r}": r for r in from_report}, "--profile": profile})
    if from_report:
        new, header = _refit_profile(from_report, profile)
    else:
        measured = _measure_profile(model or "wan2.2", cpu_smoke, gemm_size, peak_tflops, base, raw, weights)
        if measured is None:  # not rank 0
            return
        new, header = measured
    _save_profile(new, out, header, default=default)
    _print_profile(new)


def _save_profile(new, out: str, header: str, default: bool) -> None:
    """The profile to `out`, and as this machine's default: the one it replaces is kept (read before anything is
    written, `out` being that same file or not), and what changed said."""
    from chunkflow_planner.catalog import CatalogError, load_profile
    from chunkflow_planner.files import write_atomic
    from chunkflow_planner.planner import saved_profile_path

    from chunkflow.calibrate import profile_changes, write_profile

    path = saved_profile_path()
    previous = path.read_bytes() if default and path.is_file() else None
    try:
        old = load_profile(path) if previous is not None else None
    except CatalogError:
        old = None
    write_profile(new, out, header)
    console.print(f"Profile written to {out}", markup=False)
    if not default:
        return
    if previous is not None:
        kept = write_atomic(path.with_name("hardware-profile.previous.yaml"), previous)
        console.print(f"The previous default profile is kept as {kept}" + (
            "; changes: " + "; ".join(profile_changes(old, new)) if old is not None else " (it could not be read)"),
            highlight=False, markup=False)
    write_profile(new, path, header)
    console.print(f"Saved as this machine's default profile: {path} (`chunkflow plan` uses it without --hardware)",
                  markup=False)


def _refit_profile(reports: list[str], profile: str | None):
    """(refitted profile, header) from run reports; notes printed. Reports that cannot describe a GPU are refused."""
    from chunkflow_planner.catalog import HardwareSpec, get_hardware

    from chunkflow.calibrate import CalibrationError, check_refit_reports, read_reports, refit

    import glob
    import os

    paths = []
    for given in reports:  # a quoted pattern (`--from-report 'out/*-report.json'`) is expanded here
        if any(c in given for c in "*?["):
            found = sorted(glob.glob(given))
            if not found:
                raise CalibrationError(f"--from-report {given!r} matches no file")
            paths += found
        else:
            paths.append(given)
    unique: dict[str, str] = {}  # each file once, where patterns overlap
    for path in paths:
        unique.setdefault(os.path.realpath(path), path)
    paths = list(unique.values())
    reps = []
    for path in paths:  # one at a time, so a refused report is named
        these = read_reports([path])
        check_refit_reports(these, [path])
        reps += these
    reports = paths
    if profile:
        hw = get_hardware(profile)
    else:
        try:
            hw = HardwareSpec(**(reps[0].plan.hardware.spec or {}))
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"the first run report's plan has no usable hardware profile ({exc}); pass "
                                   "--profile") from None
    new, notes = refit(hw, reps)
    for n in notes:
        console.print(f"- {n}", highlight=False)
    return new, f"refit from {', '.join(reports)}"


def _measure_profile(model: str, cpu_smoke: bool, gemm_size: int, peak_tflops: float | None, base: str | None,
                     raw: str | None, weights: str | None = None):
    """(measured profile, header) on rank 0; None on other ranks under torchrun (every rank measures)."""
    import json

    from chunkflow_planner.files import write_atomic

    from chunkflow.calibrate import calibrate

    rank0 = torchrun_rank() == 0
    with _progress() as bar:
        def progress(desc, total):
            task = bar.add_task(desc, total=total, visible=rank0)
            return lambda: bar.advance(task)

        cal = calibrate(model, cpu_smoke=cpu_smoke, gemm_n=gemm_size, peak_tflops=peak_tflops, base=base,
                        progress=progress, weights=weights,
                        log=_say if rank0 else (lambda s: None))
    if not rank0:
        return None
    if raw:
        write_atomic(raw, json.dumps(cal.raw, indent=2, default=str) + "\n")
    header = "measured by chunkflow calibrate" + (" --cpu-smoke (not a GPU: numbers mean nothing)" if cpu_smoke else "")
    return cal.profile, header


def _print_profile(hw) -> None:
    t = Table(title=f"Hardware profile {hw.name}")
    t.add_column("field")
    t.add_column("value", justify="right")
    for key in ("peak_tflops", "gemm_tflops", "eta_comp", "h2d_link_gbps", "dma_startup_us", "eta_pref",
                "coll_gbps", "contention", "block_overhead_us", "hbm_gbps", "fp8_cast_gbps", "mem_ops_scale", "cpu_tflops",
                "encode_host_s", "host_op_us", "cpu_op_us", "postprocess_gbps", "alloc_slack", "reserve_fraction",
                "mem_margin", "disk_read_gbps", "page_cache_gbps", "pin_gbps", "host_fault_gbps", "load_startup_s"):
        v = getattr(hw, key)
        t.add_row(key, "-" if v is None else f"{v:.4g}")
    t.add_row("context_bytes", format_bytes(hw.context_bytes))
    t.add_row("process_host_bytes", format_bytes(hw.process_host_bytes))
    if hw.startup_s:
        t.add_row("startup_s", ", ".join(f"{k} {v:.3f}" for k, v in hw.startup_s.items()))
    for arch, c in hw.text_host.items():
        t.add_row(f"host ops {arch}", f"{c.ops_per_layer}/layer + {c.ops_once}; {c.gpu_op_us:.1f} us (GPU path), "
                  f"{c.cpu_op_us:.1f} us (CPU)" + (f"; transformers {c.transformers}" if c.transformers else ""))
    if hw.eta_comp_curve:
        t.add_row("eta_comp(F)", "; ".join(f"{f:.2e}: {e:.3f}" for f, e in hw.eta_comp_curve))
    if hw.gemm_eta:
        t.add_row("GEMM / attention shapes", f"{len(hw.gemm_eta)} / {len(hw.attn_eta or [])} measured")
    for name, fit in hw.vae_decode.items():
        t.add_row(f"VAE {name}", f"{fit.mem_const / 1e9:.2f} GB + {fit.mem_per_px:.0f} B/px + {fit.mem_per_voxel:.1f} B/voxel; "
                  f"{fit.time_per_voxel * 1e9:.2f} ns/voxel" + (
                      "" if not fit.tiled else f"; tiled {fit.tiled.time_per_call * 1e3:.1f} ms/decoder call"
                      if fit.tiled.time_per_call else " (+tiled)"))
    console.print(t)


# ---------------------------------------------------------------------------------------------- bench


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be a comma-separated list of whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{what} needs positive values, got {text!r}")
    return sorted(set(values))


def _bench_spec(model, frames, batch, modes, chunk_sizes, residency, chunk_at, residency_at, height, width, hardware,
                warmup, steps, comm_aware, baselines="", compile="off", weight_dtype="bf16", fp8_cast="compute"):
    """(ModelSpec, BenchSpec, HardwareSpec) from the bench flags, every value checked; UserError or ValueError."""
    from chunkflow.commands.bench import BenchSpec
    from chunkflow.commands.bench.baselines import BASELINES, check_baseline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import MODES
    from chunkflow_planner.planner import resolve_hardware

    if model is None:
        raise UserError("give --model (or --from-dir to redraw an earlier run)")
    spec = get_model(model)
    if (frames is None) == (batch is None):
        raise UserError("give exactly one of --frames (video models) or --batch")
    axis = "frames" if frames is not None else "batch"
    if axis == "frames" and not spec.is_video:
        raise UserError(f"{spec.name} is an image model: sweep --batch")
    values = _int_list(frames if frames is not None else batch, f"--{axis}")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in mode_list if m not in MODES]
    if bad or not mode_list:
        raise UserError(f"unknown mode(s) {', '.join(bad) or modes!r}; use {', '.join(MODES)}")
    try:
        res = list(dict.fromkeys(float(x) for x in residency.split(",") if x.strip()))
    except ValueError:
        raise UserError(f"--residency must be comma-separated fractions, got {residency!r}") from None
    if not res or any(not 0.0 <= r <= 1.0 for r in res):
        raise UserError(f"--residency values must be in [0, 1], got {residency!r}")
    chunks = list(dict.fromkeys(parse_size(c) for c in chunk_sizes.split(",") if c.strip()))
    if not chunks:
        raise UserError(f"--chunk-sizes needs positive sizes, got {chunk_sizes!r}")
    if steps < 1 or warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    if comm_aware not in ("auto", "on", "off"):
        raise UserError(f"--comm-aware must be on, off or auto, got {comm_aware!r}")
    if compile not in ("off", "regional", "regional-fullgraph"):
        raise UserError(f"--compile must be off, regional or regional-fullgraph, got {compile!r}")
    if weight_dtype not in ("bf16", "fp8_e4m3"):
        raise UserError(f"--weight-dtype must be bf16 or fp8_e4m3, got {weight_dtype!r}")
    if fp8_cast not in ("compute", "copy"):
        raise UserError(f"--fp8-cast must be compute or copy, got {fp8_cast!r}")
    if fp8_cast != "compute" and weight_dtype == "bf16":
        raise UserError("--fp8-cast says where fp8-stored weights are cast; add --weight-dtype fp8_e4m3")
    base = [b.strip() for b in baselines.split(",") if b.strip()]
    if any(b not in BASELINES for b in base):
        raise UserError(f"unknown baseline(s) in {baselines!r}; known: {', '.join(BASELINES)}")
    for b in base:
        check_baseline(b)
    hw = resolve_hardware(hardware).spec
    aware = hw.pace_collectives if comm_aware == "auto" else comm_aware == "on"
    bench = BenchSpec(model=spec.name, axis=axis, values=values, height=height, width=width, modes=mode_list,
                      chunk_sizes=chunks, residencies=res, chunk_at=chunk_at, residency_at=residency_at,
                      comm_aware=aware, warmup=warmup, steps=steps, baselines=base, compile=compile,
                      weight_dtype=weight_dtype, fp8_cast=fp8_cast)
    for v in {*values, bench.chunk_value, bench.residency_value}:
        bench.workload(spec, v)  # validates frames / batch / sizes
    for c in chunks:
        bench.config("chunkflow", c)  # validates chunk sizes
    return spec, bench, hw


def _bench_table(df, spec, hw, axis: str, world: int) -> Table:
    from chunkflow.commands.bench.sweep import row_label

    t = Table(title=f"{spec.name}: measured vs predicted step time (hardware {hw.name}, SP={world})")
    for col in (axis, "config", "measured", "x none", "predicted", "error", "bit-identical"):
        t.add_column(col, justify="right")
    none = {r["value"]: r["measured_step_s"] for _, r in df[df["mode"] == "none"].iterrows()}
    for _, r in df.iterrows():
        label = row_label(r["mode"], r["chunk_bytes"], r["residency"], r.get("weight_dtype", "bf16"),
                          r.get("fp8_cast", "compute"))
        xn = f"{r['measured_step_s'] / none[r['value']]:.3f}" if r["value"] in none else "-"
        pred = "-" if r["predicted_step_s"] != r["predicted_step_s"] else format_seconds(r["predicted_step_s"])
        err = "-" if r["err_step"] != r["err_step"] else f"{r['err_step']:+.1%}"
        t.add_row(str(r["value"]), label, format_seconds(r["measured_step_s"]), xn, pred, err, str(r["bit_identical"]))
    return t


@_command("bench")
def bench_cmd(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="catalog model name or alias"),
    frames: Optional[str] = typer.Option(None, help="video frame counts to sweep, e.g. 41,81,121"),
    batch: Optional[str] = typer.Option(None, help="batch sizes to sweep (image models), e.g. 1,4,8"),
    modes: str = typer.Option("none,layerwise,chunkflow", help="modes to run"),
    baselines: str = typer.Option("", help="other offloaders to measure at every value, after the modes: "
                                           "diffusers-group (diffusers' group offloading, block level, streams)"),
    compile: str = typer.Option("off", "--compile", help="torch.compile the repeated blocks before offloading "
                                "(diffusers' compile_repeated_blocks): off, regional (fullgraph=False) or "
                                "regional-fullgraph"),
    chunk_sizes: str = typer.Option(short_bytes(DEFAULT_CHUNK_BYTES), help="chunkflow chunk sizes; the first is used across the workloads, "
                                                  "all of them at --chunk-at, e.g. 16MB,4MB,64MB,256MB"),
    residency: str = typer.Option("0", help="chunkflow residencies; the first is used across the workloads, all "
                                            "of them at --residency-at, e.g. 0,0.2,0.4,0.6"),
    chunk_at: Optional[int] = typer.Option(None, help="frames/batch of the chunk-size sweep (default: the middle one)"),
    residency_at: Optional[int] = typer.Option(None, help="frames/batch of the residency sweep (default: the smallest)"),
    height: Optional[int] = typer.Option(None, help="height in pixels (default: the model's)"),
    width: Optional[int] = typer.Option(None, help="width in pixels (default: the model's)"),
    hardware: Optional[str] = typer.Option(None, help="catalog GPU or profile to predict with (default: saved profile, else h200)"),
    device: Optional[str] = typer.Option(None, help="cuda (default when available) or cpu; under torchrun each rank's GPU"),
    warmup: int = typer.Option(1, help="warm-up steps per point"),
    steps: int = typer.Option(2, help="timed steps per point (median), one forward each"),
    comm_aware: str = typer.Option("auto", help="pace chunk copies around collectives (SP): on, off, or auto "
                                                "(on unless the hardware's peer link is NVLink, as the planner does)"),
    weight_dtype: str = typer.Option("bf16", help="storage of the streamed weights in layerwise and chunkflow: bf16 "
                                     "or fp8_e4m3 (lossy: half the H2D bytes; none runs the model as it is)"),
    fp8_cast: str = typer.Option("compute", help="with fp8_e4m3: cast each streamed block on the compute stream "
                                 "before it runs, or on the copy stream after its copies (copy)"),
    out: str = typer.Option("bench", "--out", "-o", help="directory for bench.csv, bench.json, summary.md and plots"),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="draw the plots (needs matplotlib)"),
    from_dir: Optional[str] = typer.Option(None, "--from-dir", help="redraw plots and summary.md of an earlier bench "
                                                                     "directory (no model is run; writes to --out)"),
) -> None:
    """Sweep frames or batch, modes, chunk size and residency for a model; write CSV, summary and plots.

    Under torchrun (`torchrun --nproc-per-node N -m chunkflow bench ...`) every rank runs the sweep with
    Ulysses sequence parallelism of degree N; predictions are for SP=N and rank 0 writes the results.
    """
    from chunkflow_planner.files import check_output_dir

    check_output_dir(out, "--out")
    if from_dir is not None:
        _bench_redraw(Path(from_dir), Path(out), plots)
        return
    world = torchrun_world()
    spec, bench, hw, dev = _bench_setup(world, device, model, frames, batch, modes, chunk_sizes, residency, chunk_at,
                                        residency_at, height, width, hardware, warmup, steps, comm_aware, baselines,
                                        compile, weight_dtype, fp8_cast)
    rank = 0
    if world > 1:
        from chunkflow.parallel import init_distributed

        rank, world, dev = init_distributed()
    df = _bench_measure(spec, bench, hw, dev, world, Path(out), show=rank == 0)
    if rank == 0:
        _bench_write(df, spec, bench, hw, dev, world, Path(out), plots)


def _bench_redraw(from_dir: Path, out: Path, plots: bool) -> None:
    """Plots and summary.md again from an earlier bench directory's files."""
    from chunkflow.commands.bench import load, write_outputs

    paths = write_outputs(*load(from_dir), out, plots)
    console.print("Written: " + ", ".join(str(p) for p in paths))


def _bench_setup(world: int, device: str | None, *flags):
    """(ModelSpec, BenchSpec, HardwareSpec, device) from the flags, every one checked before any work."""
    spec, bench, hw = _bench_spec(*flags)
    if world == 1:
        from chunkflow.runtime.resolve import resolve_device

        return spec, bench, hw, resolve_device(device, hint="--device cpu")
    if bench.baselines:
        raise UserError("--baselines run on one GPU; leave them out under torchrun")
    from chunkflow_planner.planner import check_parallel

    check_parallel(spec, hw, world)
    return spec, bench, hw, None  # each rank's device comes from init_distributed()


def _bench_measure(spec, bench, hw, dev, world: int, out_dir: Path, show: bool):
    """Run the sweep with a progress bar; while it runs, rank 0 keeps bench.partial.csv (what a sweep cut short by
    a time limit still leaves behind)."""
    from chunkflow.commands.bench import run_bench

    partial = out_dir / "bench.partial.csv"

    def keep_partial(rows: list[dict]) -> None:
        if show:
            import pandas as pd

            from chunkflow_planner.files import write_atomic

            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(partial, pd.DataFrame(rows).to_csv(index=False))

    with _progress() as bar:
        task = bar.add_task(f"{spec.name}: {bench.n_points()} points, SP={world}", total=bench.n_points(),
                            visible=show)
        df = run_bench(spec, bench, hw, device=dev, sp=world, progress=lambda: bar.advance(task),
                       log=(lambda s: bar.console.print(s, highlight=False)) if show else (lambda s: None),
                       on_row=keep_partial)
    if show:
        partial.unlink(missing_ok=True)
    return df


def _bench_write(df, spec, bench, hw, dev, world: int, out_dir: Path, plots: bool) -> None:
    """bench.csv, bench.json, summary.md and plots, then the table on the console."""
    import os

    from chunkflow.commands.bench import BenchMeta, write_outputs
    from chunkflow.commands.run import environment

    env = environment(dev)
    launcher = f"torchrun --nproc-per-node {world} -m chunkflow " if world > 1 else "chunkflow "
    meta = BenchMeta(spec=bench, hardware=hw.model_dump(mode="json"), sp=world, gpu=env["gpu"], date=env["date"],
                     command=launcher + " ".join(sys.argv[1:]), torch=env["torch"], diffusers=env["diffusers"],
                     env={k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES")})
    paths = write_outputs(df, meta, out_dir, plots)
    console.print("Written: " + ", ".join(str(p) for p in paths))
    console.print(_bench_table(df, spec, hw, bench.axis, world))


def main() -> None:
    """Console-script entry point: SIGINT and SIGTERM routed through chunkflow.signals first; one that comes after
    the command's work still makes the exit code the signal's (never 0 after an interrupt). The process ends through
    signals.leave, so no signal finds the interpreter's defaults back while it frees the model."""
    from chunkflow.signals import Terminated, exit_code, install, interrupted, leave, quiet

    install()
    code: int | str | None = 0
    try:
        app()
    except SystemExit as done:
        code = done.code
    except (KeyboardInterrupt, Terminated) as exc:  # outside a command (parsing the arguments, starting up)
        _say("interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated")
        code = exit_code(15 if isinstance(exc, Terminated) else 2)
    finally:
        quiet()  # from here on a signal is only noted: the process is ending
    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        _say(code)
        code = 1
    if interrupted() is not None:
        leave(exit_code() if code in (0, None) else code)
    leave(code or 0, finished=True)


if __name__ == "__main__":
    main()
