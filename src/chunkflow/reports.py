"""Every schema `chunkflow run` writes and `calibrate --from-report` reads: the run report (what ran, measured
against what the plan predicted) and its `generation` section (`run --prompt`: each phase, the load). Versioned:
an older report is upgraded on reading (`load_reports`).

The orchestration lives in chunkflow.commands.steps (synthetic steps) and chunkflow.commands.run_generate (a whole generation); both
write these, neither is needed to read them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated, Any, Sequence

from pydantic import BaseModel, Field, ValidationError, computed_field

from chunkflow_planner.cache import CacheSetting
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.files import FileError, read_text
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.plan import Plan
from chunkflow_planner.predict import Predicted
from chunkflow_planner.versioned import parse_json
from chunkflow_planner.versioned import field_errors

RUN_REPORT_SCHEMA_VERSION = 3


class RunError(ChunkflowError):
    """A run that cannot start (bad plan, model, profile or option); the message says what to fix."""


class GcCollection(BaseModel):
    """One collection of Python's garbage collector: what it took, which generation it scanned (2: a full
    collection), how many objects it freed (few freed in a long time: their finalizers, not the scan, took it)."""

    seconds: float
    generation: int
    collected: int


class PhaseResult(BaseModel):
    measured_time_s: float = Field(description="the median over the measured generations (--repeat)")
    measured_times_s: list[float] = Field(default_factory=list, description="each measured generation's time")
    gc_s: list[float] = Field(default_factory=list, description="each measured generation's seconds in Python's "
                              "garbage collector during the phase")
    gc_longest: list[GcCollection | None] = Field(default_factory=list, description="each measured generation's "
                                                   "longest collection in the phase (none: no collection)")
    parts_s: dict[str, list[float]] = Field(default_factory=dict, description="component -> each measured "
                                            "generation's seconds in its forwards (the text encoders in encode)")
    predicted_parts_s: dict[str, float] = Field(default_factory=dict, description="the plan's account of the "
                                                "phase's time (components, host work, start-up)")
    measured_peak_memory_bytes: int | None = Field(None, description="reserved + context at the phase's peak (GPU)")
    measured_peak_allocated_bytes: int | None = None
    measured_host_rss_bytes: int = 0
    predicted_time_s: float | None = None
    predicted_peak_memory_bytes: int | None = None
    time_error: float | None = None
    memory_error: float | None = None


class LoadResult(BaseModel):
    """Building the pipeline: measured, and predicted for what it read (chunkflow_planner/pipeline/load.py)."""

    weights: str = Field(description="the pipeline folder read, or 'random' (weights drawn in place, nothing read)")
    variant: str | None = None
    measured_time_s: float
    startup_s: float | None = Field(None, description="of measured_time_s, the part before the first byte was read "
                                    "(or drawn): imports, tokenizers and scheduler, the modules built on the meta "
                                    "device, the folder checked")
    imports_s: float | None = Field(None, description="seconds the command spent importing torch and diffusers "
                                    "before the load (not in measured_time_s; None: already imported, or not a "
                                    "command)")
    read_bytes: int = 0
    cached_fraction: float | None = Field(None, description="share of the bytes read that the page cache held "
                                          "before the load (None: not known on this system)")
    read_seconds: float = Field(0.0, description="seconds inside the reads")
    pin_seconds: float | None = Field(None, description="seconds page-locking host stores (cudaHostRegister) during "
                                      "the load, on any thread (None: a report from before they were timed)")
    pin_wait_seconds: float | None = Field(None, description="of pin_seconds, those the load's own thread spent: "
                                           "the page-locking the reads did not hide")
    host_peak_bytes: int = Field(description="the process's peak resident memory at the load's end")
    component_bytes: dict[str, int] = Field(default_factory=dict, description="bytes each component holds")
    disk_component_bytes: dict[str, int] = Field(default_factory=dict, description="components placed on disk: "
                                                 "their bytes, left in the checkpoint's files (not read at load)")
    planned_component_bytes: dict[str, int] = Field(default_factory=dict)
    transformer_files: dict[str, str] = Field(default_factory=dict, description="transformers read from a single "
                                              "file (--transformer FILE) instead of the folder: component -> file")
    transformer_formats: dict[str, str] = Field(default_factory=dict, description="those files' formats "
                                                "(gguf, fp8-scaled): component -> format")
    predicted_time_s: float | None = Field(None, description="the plan's load time for these bytes and this cache "
                                           "share")
    predicted_parts_s: dict[str, float] = Field(default_factory=dict)
    predicted_host_peak_bytes: int | None = None
    time_error: float | None = None
    host_error: float | None = None

    @property
    def read_gbps(self) -> float | None:
        return self.read_bytes / self.read_seconds / 1e9 if self.read_seconds > 0 else None


class OutputPixels(BaseModel):
    """What the written output's 8-bit pixels hold: the range of nearly all of them, and whether every pixel is a
    shade of grey (its channels within 2 levels of each other)."""

    low: int = Field(ge=0, le=255, description="the 1st percentile of every channel of every pixel")
    high: int = Field(ge=0, le=255, description="the 99th percentile")
    grey: bool

    @property
    def flat(self) -> bool:
        """Nearly one colour: 98% of the values within 8 levels."""
        return self.high - self.low <= 8

    def said(self, what: str = "picture") -> str:
        """What the output (a `what`: picture, clip) looks like, in words."""
        # a video's pixels are the frames' before its lossy encoding, which moves some by a few levels
        coded = ", as decoded; the .mp4's compression moves some by a few levels" if what == "clip" else ""
        if self.flat:
            return (f"a flat {'grey' if self.grey else 'single-colour'} {what} (pixels {self.low}-{self.high} of "
                    f"255{coded})")
        return f"noise (pixels {self.low}-{self.high} of 255{coded})"


class DecodeResult(BaseModel):
    """A stored format's decode (GGUF, fp8-scaled) measured on the run's device against the plan's: every block's
    weights dequantized once a forward, at the rate chunkflow.runtime.codecs.probe measured after the generations."""

    decoded_bytes_per_step: int = Field(ge=0, description="bytes the weights decode into a denoising step (every "
                                        "forward of the step)")
    measured_s_per_step: float = Field(ge=0, description="those bytes at the rate measured (the largest block's "
                                       "weights decoded by their layers' own calls, timed)")
    measured_gbps: float = Field(gt=0, description="GB/s of decoded output measured")
    planned_s_per_step: float | None = Field(None, description="the plan's decode a step (its format's rate)")
    planned_gbps: dict[str, float] = Field(default_factory=dict, description="the plan's rate per quant type")
    error: float | None = Field(None, description="(measured - planned) / planned, where the plan's device is this "
                                "run's kind")


class CacheResult(BaseModel):
    """A step cache in the measured generations (`run --cache`): its setting and the block runs it skipped."""

    setting: CacheSetting
    label: str = Field(description="the setting as --cache takes it")
    transformers: list[str] = Field(description="the components it was enabled on")
    forwards: int = Field(description="transformer forwards of the measured generations")
    forwards_per_step: int = Field(1, description="forwards a denoising step (guidance passes, experts' turns)")
    blocks_computed: int = Field(description="block calls whose own forward ran (one of the block's modules ran)")
    blocks_skipped: int = Field(description="block calls the cache skipped (the block called, its forward replaced)")
    skipped_per_forward: list[int] = Field(default_factory=list, description="blocks skipped in each forward, in "
                                                                              "order (step i: forwards_per_step of them)")
    skipped_by_block: dict[str, int] = Field(default_factory=dict, description="block -> forwards it was skipped in")
    skipped_h2d_bytes: int | None = Field(None, description="bytes copied host to device for the skipped blocks "
                                                            "(streamed transformers; None where none streams)")
    forwards_skipped: int = Field(0, description="forwards in which the cache skipped blocks (a skipped step's)")
    measured_hit_rate: float = Field(0.0, description="forwards_skipped / forwards: the share of steps skipped")
    planned_hit_rate: float | None = Field(None, description="the plan's (prediction.cache: skipped / steps)")
    planned_computed_steps: int | None = Field(None, description="the steps the plan has computed, a generation")
    planned_source: str | None = Field(None, description="where the plan's hit rate came from (schedule, given, "
                                       "reports, prior)")

    @property
    def hit_rate(self) -> float:
        """Share of the block calls skipped."""
        n = self.blocks_computed + self.blocks_skipped
        return self.blocks_skipped / n if n else 0.0


class GenerationResult(BaseModel):
    prompt: str
    negative_prompt: str | None = None
    seed: int
    guidance: float | None = None
    steps: int
    out: str | None = None
    components: dict[str, str] = Field(description="component -> placement, as run")
    vae_tiling: bool = False
    phases: dict[str, PhaseResult]
    generation_time_s: float
    predicted_generation_time_s: float | None = None
    generation_time_error: float | None = None
    host_peak_bytes: int = Field(description="the process's peak resident memory (VmHWM), loading included")
    host_peak_per_host_bytes: int | None = Field(default=None, description=(
        "under torchrun: the host's, summed over its ranks (each one's peak less the shared segments' pages it "
        "counts) plus each shared segment once; what the plan's per-host host memory is compared with"))
    host_peak_per_rank_bytes: list[int] | None = Field(default=None, description=(
        "under torchrun: each rank's peak resident memory less the shared segments' pages it counts"))
    host_shared_bytes: int | None = Field(default=None, description=(
        "under torchrun: the host copies the local ranks share (runtime/tiers/shared.py), each counted once"))
    predicted_host_memory_bytes: int | None = None
    host_memory_error: float | None = None
    gpu_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    warmup_generations: int = Field(0, ge=0, description="whole generations run before the measured one (--warmup)")
    libraries_cached: float | None = Field(None, ge=0, le=1, description="the share of torch's, the NVIDIA "
                                           "libraries' and triton's shared objects in the page cache when the "
                                           "command started (loading/libraries.py): at least half of the "
                                           "profile's warm share (libraries_warm_share; else of all their bytes), "
                                           "and a first generation is not held to a freshly started machine's "
                                           "band edge")
    measured_generations: int = Field(1, ge=1, description="generations measured after the warm-up (--repeat)")
    generation_times_s: list[float] = Field(default_factory=list, description="each measured generation's time")
    first_phase_times_s: dict[str, float] | None = Field(
        None, description="with --warmup: the process's first generation, phase by phase (start-up included)")
    first_parts_s: dict[str, dict[str, float]] | None = Field(
        None, description="with --warmup: the first generation's timed components per phase (PhaseResult.parts_s)")
    load: LoadResult | None = Field(None, description="building the pipeline, measured against the plan")
    encode_cached: list[bool] = Field(default_factory=list, description="each measured generation: its prompt was "
                                      "encoded before in this process, so the encode phase ran no text encoder")
    disk_read_bytes: dict[str, int] = Field(default_factory=dict, description="components that keep weights in the "
                                            "checkpoint's files: bytes read from them a measured generation (their "
                                            "mean; the load's and warm-ups' reads not counted)")
    predicted_disk_read_bytes: dict[str, int] = Field(default_factory=dict, description="the plan's reads from the "
                                                      "checkpoint's files a generation, by component")
    output_pixels: OutputPixels | None = Field(None, description="what the output written (--out) holds")
    decode: DecodeResult | None = Field(None, description="a GGUF or fp8-scaled transformer: its decode measured "
                                        "against planned")
    cache: CacheResult | None = Field(None, description="the step cache it ran with (--cache) and what it skipped")


class MemorySample(BaseModel):
    """Memory after one timed step: torch's allocated and reserved device bytes (None on the CPU), host RSS."""

    step: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    host_rss_bytes: int


PositiveTime = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Measured(BaseModel):
    step_times_s: list[PositiveTime] = Field(min_length=1)
    median_step_s: PositiveTime
    median_steps_counted: int | None = Field(None, description="where a step cache skipped blocks in some steps: the "
                                             "steps median_step_s is the median of (those in which every forward "
                                             "computed, the step the plan prices); None: every step")
    peak_allocated_bytes: int | None = Field(None, description="torch peak allocated over the timed steps (GPU)")
    peak_reserved_bytes: int | None = None
    pinned_host_bytes: int = 0
    achieved_residency: float | None = None
    codec: str = Field("none", description="the codec the streamed tails were stored and copied in (OffloadStats.codec)")
    codec_raw_bytes: int = Field(0, description="the streamed tails the codec encoded, raw bytes")
    codec_stored_bytes: int = Field(0, description="the same tails as stored encoded in host memory")
    memory_trace: list[MemorySample] = Field(default_factory=list, description="memory after every timed step")


def codec_stats(stats) -> dict:
    """The codec's fields of the runtime's OffloadStats (an object or its as_dict()), with the defaults of a runtime
    that has no codec: codec, codec_raw_bytes, codec_stored_bytes."""
    get = stats.get if isinstance(stats, dict) else (lambda k, d: getattr(stats, k, d))
    if stats is None:
        return dict(codec="none", codec_raw_bytes=0, codec_stored_bytes=0)
    return dict(codec=str(get("codec", "none") or "none"), codec_raw_bytes=int(get("codec_raw_bytes", 0) or 0),
                codec_stored_bytes=int(get("codec_stored_bytes", 0) or 0))


class RelErrors(BaseModel):
    """(measured - predicted) / predicted; None where nothing was compared: peak GPU memory on the CPU, and any time
    measured on another kind of device than the plan's (a GPU's prediction run on the CPU)."""

    step_time: float | None = None
    peak_memory: float | None = None


class BandVerdict(BaseModel):
    """One measurement against its prediction's band (the plan's `prediction.bands`)."""

    error: float = Field(description="measured / predicted - 1, as the report's error for it")
    band: float = Field(description="the band's half-width, a share of the prediction (of an asymmetric band, its "
                        "wider side)")
    below: float | None = Field(None, description="how far below the prediction the band reaches, a share of it "
                                "(a first generation's time: its warm band's low edge plus the start-up's low)")
    above: float | None = Field(None, description="how far above it the band reaches (the start-up's high added)")
    inside: bool = Field(description="-below <= error <= above")
    fits: list[str] = Field(default_factory=list, description="the fits that move the band most (bands.FITS)")


def _libraries_were_cached(g: "GenerationResult", hardware: dict | None) -> bool:
    """Whether the run started with its libraries cached, against the plan's profile's warm share where it has one
    (libraries.were_cached)."""
    from chunkflow.loading.libraries import were_cached

    return bool(were_cached(g.libraries_cached, (hardware or {}).get("libraries_warm_share")))


def band_verdicts(report: "RunReport") -> dict[str, BandVerdict]:
    """Each error the report computed, against the band of the prediction it compares (by its key in the plan's
    `prediction.bands`); none for a plan without bands (schema 3 or older) or where nothing was compared (a CPU run
    of a GPU plan compares no time). After --warmup a phase's time and the generation's are held to their warm bands
    (start-up excluded, as they are compared); without, a first generation's, to their one-sided bands (the
    start-up's own band on top of the warm one: bands.with_startup). A load's time is held to the wider of its cold and warm bands (its
    prediction is for the share the page cache held)."""
    bands = report.plan.prediction.bands
    if not bands:
        return {}
    g = report.generation
    # a generation's steps ran inside the whole pipeline: its phases' peaks are compared, not the transformer's
    # step peak (a report written before it said so may hold that error)
    peak = report.rel_error.peak_memory if g is None else None
    pairs: list[tuple[str, tuple[str, ...], float | None]] = [
        ("step_time_s", ("step_time_s",), report.rel_error.step_time),
        ("peak_memory_bytes", ("peak_memory_bytes",), peak)]
    if g is not None:
        # after --warmup the times compared are a later generation's, start-up excluded: their own bands (the
        # start-up's spread is not in them); a plan without start-up has no separate warm band (the same times)
        def timed(key: str, warm: str) -> tuple[str, ...]:
            return (warm, key) if g.warmup_generations else (key,)

        pairs.append(("generation_time_s", timed("generation_time_s", "generation_warm_time_s"),
                      g.generation_time_error))
        for name, ph in g.phases.items():
            pairs += [(f"phases.{name}.time_s", timed(f"phases.{name}.time_s", f"phases.{name}.warm_time_s"),
                       ph.time_error),
                      (f"phases.{name}.peak_memory_bytes", (f"phases.{name}.peak_memory_bytes",), ph.memory_error)]
        pairs.append(("host_memory_bytes", ("host_memory_bytes",), g.host_memory_error))  # the host's under SP
        if g.load is not None:  # the load's host peak is compared a process (pipeline_setup.load_result)
            pairs += [("load.time_s", ("load.time_cold_s", "load.time_warm_s"), g.load.time_error),
                      ("load.host_peak_bytes", ("load.host_peak_bytes",), g.load.host_error)]
    # a run that started with its libraries cached is not a freshly started machine: that edge is not its own
    cached = g is not None and _libraries_were_cached(g, report.plan.hardware.spec)
    out = {}
    for key, keys, error in pairs:
        if key == "load.time_s":  # the wider of cold and warm: the load's share of cached bytes is in between
            found = [bands[k] for k in keys if k in bands]
        else:  # the first key that has a band (a warm band, else the time's own)
            found = next(([bands[k]] for k in keys if k in bands), [])
        if error is None or not found:  # (a CPU plan's nominal times carry no band: planner.with_bands)
            continue
        band = max(found, key=lambda b: b.rel)
        if cached:
            band = band.without_cold()
        below, above = band.edges()
        out[key] = BandVerdict(error=error, band=band.rel, below=below, above=above, inside=band.holds(error),
                               fits=band.fits)
    return out


class RunConfig(BaseModel):
    offload: OffloadConfig
    device: str
    dtype: str
    weights: str = "random"
    warmup: int
    steps: int
    world_size: int = 1
    sp_degree: int = 1


class RunReport(BaseModel):
    schema_version: int = RUN_REPORT_SCHEMA_VERSION
    date: str
    command: str
    gpu: str
    torch: str
    diffusers: str
    triton: str | None = Field(None, description="Triton's version where installed (the fp8 cast kernel)")
    transformers: str | None = Field(None, description="transformers' version where installed (its text encoders' "
                                     "operator counts change with it)")
    hardware: str = Field(description="name of the hardware profile the prediction used")
    plan: Plan
    run: RunConfig
    measured: Measured
    predicted: Predicted
    rel_error: RelErrors
    stats: dict[str, Any] | None = Field(None, description="OffloadHandle.stats() after the timed steps")
    generation: GenerationResult | None = Field(None, description="`run --prompt`: the whole generation, phase by "
                                                "phase, measured against the plan")

    @computed_field(description="each measurement against its prediction's band (band_verdicts); recomputed on "
                    "reading")
    @property
    def bands(self) -> dict[str, BandVerdict]:
        return band_verdicts(self)

    def write(self, path: str | Path) -> None:
        from chunkflow_planner.files import write_atomic

        write_atomic(path, self.model_dump_json(indent=2) + "\n")


JOBS_REPORT_SCHEMA_VERSION = 1


class JobResult(BaseModel):
    """One job of a prompt file (`run --prompts`): what it asked, what became of it, measured against the plan."""

    line: int = Field(description="its line in the prompt file")
    prompt: str | None = None
    seed: int | None = None
    state: str = Field(description="done, failed (it ran and broke), refused (never ran: a bad line, an unreadable "
                       "image, a shape the loaded placement cannot fit), interrupted, or not run (after Ctrl-C)")
    out: str | None = Field(None, description="the file written")
    error: str | None = None
    shape: str | None = Field(None, description="width x height (x frames), steps")
    seconds: float | None = Field(None, description="the generation, measured")
    predicted_s: float | None = Field(None, description="the plan's time for it against the loaded placement (GPU)")
    time_error: float | None = None
    phases_s: dict[str, float] = Field(default_factory=dict)
    encode_cached: bool = Field(False, description="its prompt was encoded before in this process")
    host_rss_bytes: int | None = Field(None, description="the process's host memory at the job's end")
    cache: CacheResult | None = Field(None, description="what the step cache skipped in its generation (--cache)")


class JobsReport(BaseModel):
    """`chunkflow run --prompts`: one load, then every job in order."""

    schema_version: int = JOBS_REPORT_SCHEMA_VERSION
    date: str
    command: str
    gpu: str
    torch: str
    diffusers: str
    plan: Plan
    prompts_file: str
    out_dir: str
    loads: int = Field(1, description="pipeline loads this run made (one for all its jobs)")
    load: LoadResult
    jobs: list[JobResult]
    total_s: float = Field(description="the load and every job, wall clock")
    interrupted: bool = False

    def write(self, path: str | Path) -> None:
        from chunkflow_planner.files import write_atomic

        write_atomic(path, self.model_dump_json(indent=2) + "\n")


def _upgrade(data: dict) -> dict:
    """An older report in today's layout: version 1 held the offload setting as flat fields of `run`; version 2
    had no `generation` section."""
    if data.get("schema_version") == 1 and isinstance(data.get("run"), dict):
        run = dict(data["run"])
        fields = {k: run.pop(k) for k in ("mode", "chunk_bytes", "residency", "comm_aware") if k in run}
        data = {**data, "schema_version": 2, "run": {**run, "offload": fields}}
    if data.get("schema_version") == 2:
        data = {**data, "schema_version": RUN_REPORT_SCHEMA_VERSION}
    return data


def load_reports(paths: Sequence[str | Path]) -> list[RunReport]:
    """RunReports from .json files (one report) or .jsonl files (one per line); version 1 reports are upgraded."""
    out = []
    for p in paths:
        path = Path(p)
        try:
            text = read_text(path, "run report")
        except FileError as exc:
            raise RunError(str(exc)) from None
        lines = [ln for ln in text.splitlines() if ln.strip()] if path.suffix == ".jsonl" else [text]
        for i, line in enumerate(lines):
            where = f"{str(path)!r}{f' line {i + 1}' if len(lines) > 1 else ''}"
            data = parse_json(line, f"run report {where}", RunError, "to be a run report")
            data = _upgrade(data) if isinstance(data, dict) else data
            if not isinstance(data, dict) or data.get("schema_version") != RUN_REPORT_SCHEMA_VERSION:
                raise RunError(f"{where} is not a run report of schema_version {RUN_REPORT_SCHEMA_VERSION} "
                               "(write it with `chunkflow run`)")
            try:
                out.append(with_computed_median(RunReport.model_validate(data)))
            except ValidationError as exc:
                raise RunError(f"run report {where} is malformed: {field_errors(exc)}") from None
            except (TypeError, ValueError, RecursionError) as exc:  # a section's own check (its offload setting's)
                raise RunError(f"run report {where} is malformed: {exc}") from None
    if not out:
        raise RunError("no run reports given")
    return out


def computed_step_times(times: list[float], cache: CacheResult | None) -> list[float] | None:
    """The times of the steps in which every forward computed, where the step cache (`cache`, over the same measured
    generations) skipped blocks in some: the step the plan prices is a computed one, and a median over skipped and
    computed steps alike is neither. None without a cache, where it skipped nothing, or where its forwards do not
    line up with the steps."""
    if cache is None or not cache.blocks_skipped:
        return None
    per, skipped = cache.forwards_per_step, cache.skipped_per_forward
    if per < 1 or len(skipped) != len(times) * per:
        return None
    return [t for i, t in enumerate(times) if not any(skipped[i * per:(i + 1) * per])] or None


def with_computed_median(report: RunReport) -> RunReport:
    """A report written before `median_steps_counted` (a cached run's median over every step) with its median step
    and step-time error taken over the computed steps, as `chunkflow run` now writes them; others as they are."""
    m, g = report.measured, report.generation
    counted = computed_step_times(m.step_times_s, g.cache) if g is not None else None
    if counted is None or m.median_steps_counted is not None:
        return report
    median = statistics.median(counted)
    measured = m.model_copy(update={"median_step_s": median, "median_steps_counted": len(counted)})
    step = report.rel_error.step_time  # None where the run was not compared with the plan's step
    errors = report.rel_error.model_copy(update={"step_time": None if step is None else
                                                 rel_error(median, report.predicted.step_time_s)})
    return report.model_copy(update={"measured": measured, "rel_error": errors})


def rel_error(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or predicted == 0:
        return None
    return (measured - predicted) / predicted
