"""`chunkflow run`: a plan's denoising steps (commands.steps) or, with --prompt, its whole generation
(commands.run_generate), checked before any work."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from chunkflow.commands.app import console, err_console, UserError, _command, _progress, _say
from chunkflow.commands.options import INPUT, OUTPUT, Device, Variant
from chunkflow.commands.ranks import speaks
from chunkflow.launch import torchrun_world

if TYPE_CHECKING:
    from chunkflow.commands.steps import RunOptions
    from chunkflow_planner.cache import CacheSetting
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.plan import Plan


_Plan = Annotated[str, typer.Option("--plan", "-p", help="plan file written by `chunkflow plan --out`"), INPUT]
_Mode = Annotated[Optional[str], typer.Option(help="override the plan's mode: none, layerwise or chunkflow")]
_ChunkSize = Annotated[Optional[str], typer.Option(help="override the chunk size, e.g. 16MB or 4KB")]
_Residency = Annotated[Optional[float], typer.Option(help="override the residency, a fraction in [0, 1]")]
_CfgBatched = Annotated[Optional[bool], typer.Option("--cfg-batched/--no-cfg-batched", help="override the plan: "
                                                     "both guidance passes of a step in one forward, or one each")]
_Fp8Cast = Annotated[Optional[str], typer.Option(help="override the plan's fp8 cast: compute (the compute stream, "
                                                      "before each block) or copy (the copy stream, after its copies)")]
_WeightDtype = Annotated[Optional[str], typer.Option(help="override the plan's weight storage: bf16 or fp8_e4m3 "
                                                          "(lossy)")]
_Codec = Annotated[Optional[str], typer.Option(help="override the plan's codec: on (the streamed bf16 weights stored "
                                                    "and copied losslessly encoded, exponent-pack) or off (raw)")]
_Decode = Annotated[Optional[str], typer.Option(help="override the plan's decode of a GGUF or fp8-scaled transformer's "
                                                     "weights: ahead (a streamed block's decoded on the copy stream "
                                                     "before its forward, into a decode buffer per slot) or forward "
                                                     "(each layer dequantizes in its forward, no buffer)")]
_Weights = Annotated[Optional[str], typer.Option(help="local diffusers-format checkpoint directory (default: random "
                                                      "weights); with --prompt also a Hub id in the local cache"),
                     INPUT]
_Transformer = Annotated[Optional[str], typer.Option(help="with --prompt (or --prompts: every job) and --weights: "
                                                           "read the transformer from this single file (a GGUF file: "
                                                           "Q8_0, Q6_K, Q5_K, Q4_K, Q4_0; or an fp8-scaled "
                                                           ".safetensors), the rest of the pipeline from the folder"),
                        INPUT]
_Transformer2 = Annotated[Optional[str], typer.Option(help="as --transformer, for the second expert (transformer_2, "
                                                            "Wan2.2-A14B's low-noise model)"), INPUT]
_Warmup = Annotated[Optional[int], typer.Option(help="untimed warm-up steps (default 1); with --prompt, whole "
                                                     "generations before the measured one (default 0: the process's "
                                                     "first, start-up included, as the plan predicts; 1 with --repeat)")]
_Steps = Annotated[Optional[int], typer.Option(help="timed denoising steps (default: the plan's steps, at most 5)")]
_Repeat = Annotated[int, typer.Option(help="with --prompt: generations measured after the warm-up (which --repeat 2 "
                                           "or more makes 1 by default); the report gives each phase's median and "
                                           "every generation's time")]
_Profile = Annotated[Optional[str], typer.Option(help="hardware profile or catalog GPU to predict with (default: the "
                                                      "plan's)"), INPUT]
_Report = Annotated[str, typer.Option(help="where to write the JSON run report"), OUTPUT]
_Seed = Annotated[int, typer.Option(help="seed for random weights and inputs; with --prompt also the generator's, as "
                                         "diffusers' torch.Generator(device).manual_seed(seed)")]
_Prompt = Annotated[Optional[str], typer.Option(help="generate from this prompt with the whole pipeline (text "
                                                     "encoders, transformer, VAE) placed as the plan says")]
_NegativePrompt = Annotated[Optional[str], typer.Option(help="with --prompt: what to steer away from (CFG models)")]
_Guidance = Annotated[Optional[float], typer.Option(help="with --prompt: guidance scale (default: the model's)")]
_Out = Annotated[Optional[str], typer.Option("--out", "-o", help="with --prompt: write the result here, .mp4 (video) "
                                                                 "or .png (image)"), OUTPUT]
_Image = Annotated[Optional[str], typer.Option(help="with --prompt: the image to animate (image-to-video) or edit "
                                                 "(PNG, JPEG, WebP); the pipeline is the image pipeline of the "
                                                 "plan's model (e.g. Wan image-to-video)"), INPUT]
_Prompts = Annotated[Optional[str], typer.Option(help="generate every job of this file with one load: a JSON object a "
                                                      "line (prompt, and optionally negative_prompt, seed, guidance, "
                                                      "steps, height, width, frames, image, out) or one prompt a line; "
                                                      "outputs go to --out-dir"), INPUT]
_OutDir = Annotated[Optional[str], typer.Option(help="with --prompts: the folder the outputs are written to (made if "
                                                     "missing; default: outputs)"), OUTPUT]
_MaxJobTime = Annotated[Optional[str], typer.Option(help="with --prompts: skip, before the load, each job whose "
                                                          "predicted time (the upper end of its band) is over this, "
                                                          "e.g. 10min or 600s")]
_Cache = Annotated[Optional[str], typer.Option(help="with --prompt or --prompts (every job): a step cache of diffusers' on the transformer(s), "
                                                    "KIND[:PARAMS]: first-block:0.1 (threshold), mag:ratios=flux "
                                                    "(MagCache; ratios=FILE.json, or calibrate), taylorseer:2,lite "
                                                    "(interval; lite skips whole blocks), sea:0.3 (SeaCache, Wan "
                                                    "text-to-video); lossy by design. The report counts the blocks "
                                                    "computed and skipped")]
_Latents = Annotated[Optional[str], typer.Option(help="also save the final latents (safetensors): of the generation "
                                                      "with --prompt, else of the timed steps (to compare settings)"),
                     OUTPUT]


@dataclass
class RunArgs:
    """`chunkflow run`'s options as given (run_cmd's parameters, each as its flag says)."""

    plan: str
    mode: str | None
    chunk_size: str | None
    residency: float | None
    cfg_batched: bool | None
    fp8_cast: str | None
    weight_dtype: str | None
    codec: str | None
    decode: str | None
    device: str | None
    weights: str | None
    variant: str | None
    warmup: int | None
    steps: int | None
    repeat: int
    profile: str | None
    report: str
    seed: int
    prompt: str | None
    negative_prompt: str | None
    guidance: float | None
    out: str | None
    latents: str | None
    image: str | None
    prompts: str | None
    out_dir: str | None
    transformer: str | None
    transformer_2: str | None
    max_job_time: str | None
    cache: str | None

    @property
    def generating(self) -> bool:
        """Whether this run generates one prompt with the whole pipeline (--prompt)."""
        return self.prompt is not None


@dataclass
class CheckedRun:
    """What the checks before anything is built hand on: the plan, its offload with the overrides, the run's
    options (None with --prompts), the --image read (None without), the seconds torch and diffusers took to import
    (None: imported before) and the step cache (a CacheSetting; None: none)."""

    plan: Plan
    offload: OffloadConfig
    opts: RunOptions | None
    picture: Any  # a PIL image
    imports_s: float | None
    cache: CacheSetting | None


@_command("run")
def run_cmd(plan: _Plan, mode: _Mode = None, chunk_size: _ChunkSize = None, residency: _Residency = None,
            cfg_batched: _CfgBatched = None, fp8_cast: _Fp8Cast = None, weight_dtype: _WeightDtype = None,
            codec: _Codec = None, decode: _Decode = None, device: Device = None, weights: _Weights = None,
            variant: Variant = None, warmup: _Warmup = None, steps: _Steps = None, repeat: _Repeat = 1,
            profile: _Profile = None, report: _Report = "run-report.json", seed: _Seed = 0, prompt: _Prompt = None,
            negative_prompt: _NegativePrompt = None, guidance: _Guidance = None, out: _Out = None,
            latents: _Latents = None, image: _Image = None, prompts: _Prompts = None, out_dir: _OutDir = None,
            transformer: _Transformer = None, transformer_2: _Transformer2 = None, max_job_time: _MaxJobTime = None,
            cache: _Cache = None) -> None:
    """Run the plan's workload: warm-up and timed denoising steps with a flow-matching Euler scheduler; or, with
    --prompt, generate a video or image with the whole diffusers pipeline.

    Each step is cfg_passes transformer forwards plus one scheduler step. Prints measured against predicted
    step time and peak GPU memory and writes a run report. Under torchrun (WORLD_SIZE > 1) the model runs
    with Ulysses sequence parallelism over the processes; rank 0 prints and writes the report.

    With --prompt, --weights takes a diffusers pipeline folder (model_index.json) or a Hub id found in the local
    Hugging Face cache (never downloaded); without --weights every component has random weights. Each phase
    (encode, denoise, decode) is measured against the plan; --steps then counts every step of the generation.
    --image gives an image-to-video or edit pipeline its image. The folder and the image are checked against the
    plan before anything is loaded.

    With --prompts FILE the pipeline is loaded once and every job of the file runs in order (a JSON object a line,
    or one prompt a line), each output written to --out-dir as it finishes; --seed, --negative-prompt, --guidance and
    --steps are the defaults of the jobs that do not set them. Lines that are not jobs, and jobs whose shape does not
    fit the loaded placement, are said and skipped; Ctrl-C stops with a report of what was done.
    """
    args = RunArgs(plan=plan, mode=mode, chunk_size=chunk_size, residency=residency, cfg_batched=cfg_batched,
                   fp8_cast=fp8_cast, weight_dtype=weight_dtype, codec=codec, decode=decode, device=device,
                   weights=weights, variant=variant, warmup=warmup, steps=steps, repeat=repeat, profile=profile,
                   report=report, seed=seed, prompt=prompt, negative_prompt=negative_prompt, guidance=guidance,
                   out=out, latents=latents, image=image, prompts=prompts, out_dir=out_dir, transformer=transformer,
                   transformer_2=transformer_2, max_job_time=max_job_time, cache=cache)
    _prefer_expandable_segments()
    run = _checked_on_every_rank(args)
    if prompts is not None:
        _run_prompt_file(args, run)
    elif args.generating:
        _generate(run.plan, run.offload, run.opts, prompt, negative_prompt, guidance, out, latents, report,
                  run.picture, run.imports_s, run.cache)
    else:
        _run_steps(run, report)


def _prefer_expandable_segments() -> None:
    """PYTORCH_CUDA_ALLOC_CONF's expandable segments, unless the user set it."""
    import os

    # a plan's peak memory is what the allocator reserves: expandable segments keep that close to what torch
    # allocates (the planner's reserve_fraction). Set before torch starts CUDA (under torchrun, joining the job
    # does); a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _checked_on_every_rank(args: RunArgs) -> CheckedRun:
    """_checked(args); under torchrun (a generation, sequence parallel) on every rank, ranks other than 0 quiet."""
    ranks = torchrun_world() > 1 and (args.generating or args.prompts is not None)  # a generation under torchrun (SP)
    if not ranks:
        return _checked(args)
    from chunkflow.commands.ranks import quiet_rank, together

    quiet_rank()  # ranks other than 0 print nothing but errors
    # every rank checks, joins the job, and they refuse together (commands.ranks)
    return together(lambda: _checked(args))


def _checked(args: RunArgs) -> CheckedRun:
    """Everything checked before anything is built: the plan and its offload with the overrides, the step cache,
    then a prompt file's run (one process) or a single run's options (_checked_single)."""
    from chunkflow_planner.plan import check_setting, load_plan

    p = load_plan(args.plan)
    cfg = p.offload.with_overrides(args.mode, args.chunk_size, args.residency, cfg_batched=args.cfg_batched,
                                   weight_dtype=args.weight_dtype, fp8_cast=args.fp8_cast,
                                   codec=codec_override(args.codec), decode=args.decode)  # the flags parsed here, once
    check_setting(p, cfg, "--chunk-size" if args.chunk_size is not None else "offload")  # fits the model as the plan's
    cache = _check_cache(args.cache, args.generating, args.prompts is not None, p)
    imports_s = import_libraries()  # said before the silence it would be (the checks below need them)
    _check_priced(p, cfg, args.profile)
    if cache is not None:  # on the model's transformer on the meta device, before the load
        _check_cache_fits(cache, p, args.steps, each_job=args.prompts is not None)
    if args.prompts is not None:
        if torchrun_world() > 1:
            raise UserError("--prompts runs in one process; leave torchrun out (a prompt file under sequence "
                            "parallelism is not supported yet: run each prompt with --prompt under torchrun)")
        return CheckedRun(p, cfg, None, None, imports_s, cache)
    opts = _single_run_options(args)
    picture = _check_run(p, opts, args.plan, args.report, args.prompt, args.negative_prompt, args.guidance,
                         args.out, args.latents, args.image)
    return CheckedRun(p, cfg, opts, picture, imports_s, cache)


def _check_cache_fits(setting: CacheSetting, p: Plan, steps: int | None, each_job: bool) -> None:
    """The step cache fits the model's transformer (on the meta device) for the run's steps; `each_job`: a prompt
    file's jobs have their own steps, each checked as it runs, so no step count is refused here."""
    from chunkflow.caches import check_fits
    from chunkflow_planner.plan import model_of

    check_fits(setting, model_of(p), steps or p.workload.steps)
    if not each_job:
        _check_skips(setting, steps or p.workload.steps)


def _single_run_options(args: RunArgs) -> RunOptions:
    """A single run's (no --prompts) RunOptions, a prompt file's flags and a generation's refused first."""
    from chunkflow.commands.steps import RunOptions

    if args.out_dir is not None:
        raise UserError("--out-dir goes with --prompts (a file of jobs); a single generation writes to --out")
    if args.max_job_time is not None:
        raise UserError("--max-job-time goes with --prompts (a file of jobs); a single generation is yours to "
                        "time: `chunkflow plan` predicts it")
    if (args.transformer or args.transformer_2) and not args.generating:
        raise UserError("--transformer FILE goes with --prompt (a generation of the whole pipeline)")
    warmup = ((1 if args.repeat > 1 else 0) if args.generating else 1) if args.warmup is None else args.warmup
    return RunOptions(device=args.device, weights=args.weights, variant=args.variant, steps=args.steps,
                      profile=args.profile, seed=args.seed, repeat=args.repeat, transformer=args.transformer,
                      transformer_2=args.transformer_2, warmup=warmup)


def _run_prompt_file(args: RunArgs, run: CheckedRun) -> None:
    """`run --prompts FILE`: every job of the file on one load (commands.run_prompts)."""
    from chunkflow.commands.run_prompts import run_prompts

    run_prompts(run.plan, run.offload, args.plan, args.prompts, args.out_dir, args.report, device=args.device,
                weights=args.weights, variant=args.variant, profile=args.profile, seed=args.seed,
                negative_prompt=args.negative_prompt, guidance=args.guidance, steps=args.steps,
                transformers={"transformer": args.transformer, "transformer_2": args.transformer_2},
                imports_s=run.imports_s, max_job_s=_duration(args.max_job_time, "--max-job-time"),
                cache=run.cache,
                others={"--prompt": args.prompt, "--out": args.out, "--latents": args.latents,
                        "--image": args.image, "--warmup": args.warmup,
                        "--repeat": args.repeat if args.repeat != 1 else None})


def _run_steps(run: CheckedRun, report: str) -> None:
    """The plan's synthetic denoising steps with a bar; rank 0 writes the report and prints the table."""
    from chunkflow.commands.plan_tables import print_run
    from chunkflow.commands.steps import run_plan

    with _progress() as bar:
        task = bar.add_task("denoising steps", total=None)
        rep = run_plan(run.plan, run.offload, run.opts, progress=lambda i, n: bar.update(task, completed=i, total=n),
                       log=_say)
    if rep is None:  # not rank 0
        return
    rep.write(report)
    print_run(console, rep)
    console.print(f"Run report written to {report}", markup=False)


def _duration(text: str | None, flag: str) -> float | None:
    """A duration flag in seconds (None where not given); one line for a bad one."""
    if text is None:
        return None
    from chunkflow_planner.units import UnitError, parse_duration

    try:
        return parse_duration(text, flag)
    except UnitError as exc:
        raise UserError(str(exc)) from None


def import_libraries() -> float | None:
    """torch and diffusers imported, said first on a terminal where they are not yet (tens of seconds on a slow
    disk, before which the command would print nothing): the seconds it took, None where they were already
    imported."""
    import sys
    import time

    from chunkflow.loading.libraries import cached_at_start

    cached_at_start()  # the libraries' page-cache state, before torch maps them (a first generation's band)
    if "torch" in sys.modules and "diffusers" in sys.modules:
        return None
    if speaks() and sys.stderr.isatty():  # on a terminal; a pipe keeps an error to its one line
        _say("loading torch and diffusers ...")
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import diffusers

    diffusers.DiffusionPipeline  # noqa: B018 - diffusers is lazy: its pipelines' base (and transformers) now
    return time.perf_counter() - t0


def _check_priced(p, cfg, profile: str | None) -> None:
    """The run's setting (the plan's, or with --codec, --profile) can be priced by the profile it is measured
    against, before anything is loaded: a run that could not be compared is refused now, not after it ran."""
    from chunkflow_planner.plan_checks import pricing_problem
    from chunkflow_planner.plan import hardware_of

    where = f"--profile {profile!r}" if profile else "the plan's profile (hardware.spec)"
    problem = pricing_problem(cfg, hardware_of(p, profile), where, "run with another --profile")
    if problem is not None:
        raise UserError(problem)


def _check_cache(text: str | None, generating: bool, prompts: bool, plan=None):
    """`--cache` parsed and validated (CacheSpecError, one line, where it is bad), else the cache the plan priced
    (`plan --cache`) where this run generates (--prompt, or every job of --prompts); refused where this run cannot
    take it; None without either."""
    planned = plan.workload.cache if plan is not None else None
    if text is None and (planned is None or not (generating or prompts)):
        return None
    from chunkflow_planner.cache import parse_cache

    setting = parse_cache(text) if text is not None else planned.setting
    what = "--cache" if text is not None else f"the plan's cache ({planned.label()}, from plan --cache)"
    if prompts:
        return setting  # each job's generation with it (run_jobs: the session's cache)
    if not generating:
        raise UserError("--cache goes with --prompt: a cache keys on the pipeline's denoising steps, which the "
                        "synthetic steps do not run")
    if torchrun_world() > 1:
        from chunkflow_planner.stepcache import parallel_problem

        problem = parallel_problem(setting)
        if problem is not None:
            raise UserError(f"{what} under torchrun: {problem}")
    return setting


def _check_skips(setting, steps: int) -> None:
    """A cache that can skip none of the run's steps (a few-step schedule) refused in one line before the load."""
    from chunkflow_planner.stepcache import does_nothing

    why = does_nothing(setting, steps)
    if why:
        raise UserError(f"--cache: {why}, so it would change nothing; leave --cache out, or run more steps")


def codec_override(codec: str | None) -> str | None:
    """`run --codec on|off` as the offload's codec (None: the plan's)."""
    if codec is None:
        return None
    from chunkflow_planner.policy import CODEC

    named = {"on": CODEC, "off": "none", CODEC: CODEC, "none": "none"}
    if codec not in named:
        raise UserError(f"--codec overrides the plan's codec: on or off, got {codec!r}")
    return named[codec]


def _check_run(p, opts, plan: str, report: str, prompt: str | None, negative_prompt: str | None,
               guidance: float | None, out: str | None, latents: str | None, image: str | None = None):
    """Every option of `run` checked against the plan and each other before anything is built; sets
    opts.latents for the synthetic steps. With --prompt the weights folder is checked against the plan's model
    (every class and config, models/pipeline_build.check_folder) and --image read and checked: returns the image
    (None without --image)."""
    import math

    from chunkflow_planner.files import check_distinct, check_output_file
    from chunkflow_planner.plan import files_needed
    from chunkflow_planner.plan import hardware_of

    generating = prompt is not None
    why = files_needed(p, components=generating)
    if why is not None and opts.weights is None:
        raise UserError(why)
    if not generating and any(v is not None for v in (negative_prompt, guidance, out, image)):
        raise UserError("--negative-prompt, --guidance, --out and --image go with --prompt (a generation)")
    opts.check()  # bad options fail before anything is built
    if latents is not None:
        check_output_file(latents, "--latents")
    if generating:
        if guidance is not None and not (math.isfinite(guidance) and guidance > 0):
            raise UserError(f"--guidance must be a positive number, got {guidance}")
        _check_generation(p, prompt, negative_prompt, out)
        _check_sequence_parallel(p, torchrun_world())
    else:
        opts.latents = latents
    folder = None
    if opts.weights is not None and generating:
        from chunkflow.weights import resolve_weights

        folder = resolve_weights(opts.weights)  # a missing folder or uncached Hub id fails before anything is built
    elif opts.weights is not None:  # the synthetic steps read a transformer folder
        folder = Path(opts.weights).expanduser()
    hardware_of(p, opts.profile)
    check_output_file(report, "--report")
    check_distinct({"--out": out, "--report": report, "--latents": latents},
                   {"--plan": plan, "--weights": folder, "--image": image,
                    "--profile": opts.profile if opts.profile and Path(opts.profile).exists() else None})
    picture = _check_pipeline(p, folder, image, latents) if generating else None
    if opts.transformers:
        from chunkflow.models.transformer_file import check_files
        from chunkflow_planner.plan import model_of

        check_files(model_of(p), folder, opts.transformers)
    from chunkflow.models.transformer_file import check_plan_format

    check_plan_format(p, opts.transformers or {})  # headers against the folder's configs, nothing read
    return picture


def _check_pipeline(p, folder: Path | None, image: str | None, latents: str | None = None):
    """The run's pipeline against the plan, before the load and its progress bar: --image read and checked (format,
    size), the folder's classes and configs (a folder of another model is refused here, not after the load began),
    the pipeline class given --image or not. Returns the image."""
    from chunkflow.models.adapters import run_class
    from chunkflow.models.pipeline_build import check_folder
    from chunkflow_planner.plan import model_of

    from chunkflow.media import load_input_image

    spec = model_of(p)
    picture = load_input_image(image) if image is not None else None
    if spec.pipeline is None:
        return picture  # run_generation says what to do
    if folder is not None:
        cls = check_folder(spec, folder, image=image is not None).pipeline
    else:
        cls = run_class(spec.pipeline.cls, None, image is not None, spec=spec)
    if latents is not None and cls is not None:
        from chunkflow.models.adapters import hands_out_latents

        if not hands_out_latents(cls):  # refused now: the run would end without the file asked for
            raise UserError(f"--latents: {cls.__name__} hands no step callback the latents (no "
                            "callback_on_step_end), so they cannot be saved; leave --latents out")
    if image is not None and speaks():  # what the plan cannot promise (docs/any-h200.md)
        console.print("note: the plan does not price the image's encode by the VAE (once, in the encode phase): that "
                      "phase may hold more than planned (Wan2.2-TI2V-5B at 704x1280 on an H200: 8.99 GB against "
                      "6.68 GB)", markup=False)
    return picture


def _check_sequence_parallel(p, world: int) -> None:
    """A generation under torchrun: Ulysses splits the attention heads and the latent tokens between the `world`
    processes, so both must divide by it (the text's tokens are the pipeline's: a split that does not divide is
    diffusers' error)."""
    if world <= 1:
        return
    from chunkflow_planner.plan import model_of
    from chunkflow_planner.workload import tokens

    spec = model_of(p)
    if spec.heads % world:
        raise UserError(f"{spec.name} has {spec.heads} attention heads, which {world} processes cannot share "
                        f"(sequence parallelism gives each the same number): launch a number of processes that "
                        f"divides {spec.heads}")
    n = tokens(spec, p.workload.to_workload())
    if n % world:
        raise UserError(f"the plan's workload is {n} latent tokens a sample, which {world} processes cannot split "
                        f"evenly (sequence parallelism gives each the same number): launch a number of processes "
                        f"that divides {n}, or plan another size")


def _check_generation(p, prompt: str, negative_prompt: str | None, out: str | None) -> None:
    """A generation's words and output fit the plan's model, before anything is built: text that is UTF-8, a
    negative prompt only where the pipeline uses one, a video file for a video model and an image for an image
    model."""
    from chunkflow.models.adapters import negative_prompt_refusal
    from chunkflow_planner.plan import model_of

    spec = model_of(p)
    for flag, text in (("--prompt", prompt), ("--negative-prompt", negative_prompt)):
        if text is None:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{flag} is not valid UTF-8 text (bytes the terminal could not decode); give it as UTF-8")
        if not text.strip():
            raise UserError(f"{flag} is empty; give the words to {'generate' if flag == '--prompt' else 'avoid'}")
    refused = negative_prompt_refusal(spec, "--negative-prompt", "--guidance") if negative_prompt is not None \
        else None
    if refused is not None:
        raise UserError(refused)
    if out is not None:
        from chunkflow.media import check_media_path, image_names

        kind = check_media_path(out)
        for name in image_names(out, p.workload.batch) if kind == "image" else ():  # a batch's images, each
            check_media_path(name)
        if spec.is_video and kind != "video":
            raise UserError(f"{spec.name} makes videos; write --out to a .mp4 file (not {out!r})")
        if not spec.is_video and kind == "video":
            raise UserError(f"{spec.name} makes images; write --out to a .png file (not {out!r})")


def _generate(p, cfg, opts, prompt, negative_prompt, guidance, out, latents, report, image=None,
              imports_s: float | None = None, cache=None) -> None:
    """`run --prompt`: the whole pipeline, phase by phase, with a progress bar over the denoising steps. Under
    torchrun every rank generates, rank 0 alone with bars, notes, files and tables (commands.ranks)."""
    from chunkflow.commands.plan_tables import print_generation
    from chunkflow.commands.run_generate import GenerateOptions, run_generation

    g = GenerateOptions(prompt=prompt, negative_prompt=negative_prompt, guidance=guidance, out=out, latents=latents,
                        image=image, cache=cache)
    if not speaks():
        run_generation(p, cfg, opts, g)  # None: rank 0 writes and reports
        return
    with _phase_bars() as (progress, finish):
        rep = run_generation(p, cfg, opts, g, progress=progress, log=_say)
        finish()
    if rep.generation is not None:
        from chunkflow.loading.libraries import cached_at_start

        rep.generation.libraries_cached = cached_at_start()  # taken before torch was imported (import_libraries)
        if rep.generation.load is not None:
            rep.generation.load.imports_s = imports_s  # the command's start-up, said with the load's
    rep.write(report)
    print_generation(console, rep)
    if out:
        console.print(f"Written: {out}", markup=False)
    console.print(f"Run report written to {report}", markup=False)


@contextlib.contextmanager
def _phase_bars():
    """(progress(phase, i, n), finish()): a bar (and a clock) for each phase of a generation, on stderr: the load's
    bytes, the steps of denoise; finish() fills the bars of the phases begun."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from chunkflow_planner.units import format_bytes

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                   TimeElapsedColumn(), console=err_console, transient=False)
    with bar:
        tasks: dict[str, int] = {}

        def finish() -> None:
            """The phases begun are over: full bars, and a count only where it counted something."""
            for task in tasks.values():
                t = bar.tasks[task]
                if not t.finished:
                    bar.update(task, completed=t.total or 1, total=t.total or 1, count=t.fields["count"] or "done")
                    bar.stop_task(task)

        def progress(phase: str, i: int | None, n: int | None) -> None:
            if phase not in tasks:
                finish()  # the phase before is over
                tasks[phase] = bar.add_task(phase, total=None, count="")
            if phase == "load":
                count = f"{format_bytes(i or 0)} of {format_bytes(n or 0)}" if n else "random weights"
            else:
                count = f"{i or 0}/{n}" if n else ""
            bar.update(tasks[phase], completed=i or 0, total=n or None, count=count)

        yield progress, finish
