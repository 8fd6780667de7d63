"""`chunkflow plan`, `models` and `hardware`: the planner's answers on the command line (it never imports torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional
import math
import sys

from rich.table import Table
import typer

from chunkflow.commands.app import console, UserError, _command, _say
from chunkflow.commands.terminal import json_shown
from chunkflow.commands.options import INPUT, OUTPUT, Hardware, Height, Variant, Width
from chunkflow_planner.units import format_bytes, parse_duration, parse_size

if TYPE_CHECKING:  # annotations only: the planner's modules are imported when `plan` runs
    from chunkflow_planner.catalog import ModelSpec, Workload
    from chunkflow_planner.overlap import OverlapAnalysis
    from chunkflow_planner.plan import Plan
    from chunkflow_planner.planner import ResolvedHardware
    from chunkflow_planner.policy import Decision

    PlanResult = tuple[Plan, Decision, OverlapAnalysis]


_Describe = Annotated[Optional[str], typer.Option(
    "--describe", metavar="DIR", help="derive the model entry of a diffusers folder chunkflow has never seen (a "
    "pipeline folder with model_index.json, a Hub id in the local cache, a transformer folder or its config.json) "
    "and print it in models.yaml's format, to paste into a catalog"), INPUT]


@_command("models")
def models_cmd(describe: _Describe = None) -> None:
    """List the model catalog (models.yaml), or with --describe DIR the entry derived from a folder."""
    from chunkflow_planner.catalog import load_models

    if describe is not None:
        from chunkflow.models.derive import derive_model, describe_yaml

        sys.stdout.write(describe_yaml(derive_model(describe)))
        return

    table = Table(title="Models (models.yaml): weights in the dtypes a plan runs them in")
    # every name a user types whole on its own line (no column cuts one at 80 columns): the rest wraps
    table.add_column("name: any of these", no_wrap=True)
    for col in ("blocks x width", "transformer", "pipeline", "default workload"):
        table.add_column(col, no_wrap=col in ("transformer", "pipeline"),
                         justify="right" if col in ("transformer", "pipeline") else "left")
    for spec in load_models().values():
        blocks = " + ".join(f"{g.count} {g.kind.replace('mmdit_', '')}" for g in spec.blocks) + f" x {spec.d}"
        w = spec.default_workload
        wl = f"{w.width}x{w.height}" + (f" x{w.frames}" if spec.is_video else f", batch {w.batch}") + f", {w.steps} steps"
        experts = spec.pipeline.experts if spec.pipeline is not None else 1
        transformer = (f"{experts} x " if experts > 1 else "") + format_bytes(spec.nbytes)
        table.add_row("\n".join(typed_names(spec)), blocks, transformer,
                      format_bytes(sum(spec.component_bytes().values())), wl)
    console.print(table)
    console.print("name: the model's name (in any case) and its aliases, each what --model takes; pipeline: the "
                  "text encoders, every transformer (Wan2.2-A14B has two experts) and the VAE, what `chunkflow plan` "
                  "loads; host memory needs the process on top (`chunkflow plan` prints it)", markup=False)


def typed_names(spec) -> list[str]:
    """What --model takes for `spec`: its name, its lower-case form where that differs (`qwen-image`), its
    aliases."""
    names = [spec.name] + ([spec.name.lower()] if spec.name.lower() != spec.name else [])
    return names + [a for a in spec.aliases if a not in names]


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


_PlanModel = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="catalog model name or alias (see `chunkflow models`), or a diffusers folder / Hub id in the "
    "local cache to derive the model from (default: the --weights folder's)"), INPUT]
_Frames = Annotated[Optional[int], typer.Option(help="video frames (1 mod the VAE's temporal factor)")]
_Batch = Annotated[Optional[int], typer.Option(help="batch size")]
_Steps = Annotated[Optional[int], typer.Option(help="denoising steps")]
_Sp = Annotated[int, typer.Option("--sp", help="Ulysses sequence-parallel degree")]
_MemBudget = Annotated[Optional[str], typer.Option(help="GPU memory available, e.g. 24GB or 22GiB (default: the GPU's "
                                                        "memory)")]
_MemMargin = Annotated[Optional[float], typer.Option(help="share of --mem-budget kept free for the memory model's "
                                                          "error, e.g. 0.05 (default: the hardware profile's, measured; "
                                                          "0 plans to the byte)")]
_MaxSlowdown = Annotated[Optional[float], typer.Option(help="latency target relative to no offload: per step for the "
                                                            "transformer (default 1.05) and, when given, for the whole "
                                                            "generation")]
_TargetStepTime = Annotated[Optional[str], typer.Option(help="absolute latency target per step, e.g. 1.2s")]
_TargetTime = Annotated[Optional[str], typer.Option(help="latency target of the whole generation, e.g. 5min or 90s "
                                                         "(default: none, or --max-slowdown x everything on the GPU if "
                                                         "given)")]
_HostMemBudget = Annotated[Optional[str], typer.Option(help="host memory available, e.g. 64GB (default: this "
                                                            "machine's memory less 10% where the plan is for this "
                                                            "machine; none checked where --hardware names another, "
                                                            "or with --transformer-only)")]
_HostMemMargin = Annotated[Optional[float], typer.Option(help="share of --host-mem-budget kept free for the host "
                                                              "model's error, e.g. 0.05 (default: the hardware "
                                                              "profile's, measured; 0 plans to the byte)")]
_TransformerOnly = Annotated[bool, typer.Option("--transformer-only", help="plan the transformer alone (no text "
                                                "encoder, VAE or host memory), as the ChunkFlow paper does")]
_CfgBatching = Annotated[str, typer.Option(help="run a step's two guidance passes as one batched forward, so each "
                                                "block is streamed once a step: auto (the planner decides), on, off")]
_WeightDtype = Annotated[str, typer.Option(help="storage of the streamed weights: auto (bf16, or fp8_e4m3 where it "
                                                "pays if --allow-fp8), bf16, fp8_e4m3 (lossy: half the host and H2D "
                                                "bytes)")]
_Codec = Annotated[str, typer.Option(help="store and copy the streamed bf16 weights losslessly encoded (exponent-pack), "
                                          "decoded on the GPU: auto (where it pays: a streaming-bound step, or a "
                                          "host budget only the encoded store fits), on, off. Needs the profile's "
                                          "decode rate (`chunkflow calibrate` measures it)")]
_NoShareHost = Annotated[bool, typer.Option("--no-share-host", help="under --sp, plan each rank with its own pinned "
                                            "host copy of the streamed weights and parked components (n copies a "
                                            "host) instead of one shared by the host's ranks (the default)")]
_AllowFp8 = Annotated[bool, typer.Option("--allow-fp8", help="let --weight-dtype auto choose lossy fp8 storage")]
_Out = Annotated[Optional[str], typer.Option("--out", "-o", help="write the plan JSON here"), OUTPUT]
_Json = Annotated[bool, typer.Option("--json", help="print the plan JSON on stdout instead of tables")]
_PeakTflops = Annotated[Optional[float], typer.Option(help="what-if: peak dense BF16 TFLOP/s")]
_H2dGbps = Annotated[Optional[float], typer.Option(help="what-if: effective per-GPU host-to-device GB/s (BW_h2d)")]
_DiskGbps = Annotated[Optional[float], typer.Option(help="what-if: the disk's cold read rate in GB/s (BW_disk), for "
                                                        "the disk tier before anything is downloaded or calibrated "
                                                        "(`chunkflow calibrate --weights DIR` measures it)")]
_EtaComp = Annotated[Optional[float], typer.Option(help="what-if: compute efficiency factor")]
_EtaPref = Annotated[Optional[float], typer.Option(help="what-if: prefetch efficiency factor")]
_PrefetchBytes = Annotated[Optional[str], typer.Option(help="what-if: per-block prefetch volume, e.g. 520MB")]
_TextLen = Annotated[Optional[int], typer.Option(help="what-if: text context length L_ctx")]
_Format = Annotated[Optional[str], typer.Option(
    "--format", help="price the transformer in the stored format users download, before the download, from its bits "
    "per weight: bf16, q8_0, q6_k, q5_k, q4_k, q4_0 (GGUF) or fp8-scaled (Comfy's float8 with a per-tensor scale). "
    "One plans it fully (the plan file records it, and its bytes a step against bf16's); several, comma-separated "
    "(q8_0,q4_k,fp8-scaled,bf16), print one row a format: fits or not, GPU peak, host memory, disk, bytes a step "
    "against bf16, time; --out then needs {format} in its name (plan-{format}.json), one plan file a format that "
    "fits")]
_Weights = Annotated[Optional[str], typer.Option(help="the pipeline folder (or Hub id in the local cache) it will "
                                                      "load: its files' headers give the bytes the load reads, and it "
                                                      "is checked to hold this model's pipeline"), INPUT]


_Transformer = Annotated[Optional[str], typer.Option(help="with --weights DIR: the transformer the run will read from "
                                                           "this single file (a GGUF file), checked from its header "
                                                           "against the folder's config"), INPUT]
_Cache = Annotated[Optional[str], typer.Option(help="price a step cache, as `run --cache` takes it: KIND[:PARAMS], "
                                                 "e.g. first-block:0.1, mag:ratios=flux, taylorseer:2,lite, sea:0.3")]
_CacheHitRate = Annotated[Optional[str], typer.Option(help="the share of steps the cache is expected to skip "
                                                      "(first-block, sea): a number (0.35, or 0.35+-0.1 with the "
                                                      "spread the band takes), or earlier runs' reports, "
                                                      "comma-separated (run --cache ... --report R.json): their "
                                                      "measured shares' mean, the farthest from it the spread. "
                                                      "Default: a wide prior")]
_Transformer2 = Annotated[Optional[str], typer.Option(help="as --transformer, for the second expert (transformer_2)"),
                         INPUT]


@_command("plan")
def plan_cmd(model: _PlanModel = None, frames: _Frames = None, batch: _Batch = None, height: Height = None, width: Width = None,
             steps: _Steps = None, sp: _Sp = 1, hardware: Hardware = None, mem_budget: _MemBudget = None,
             mem_margin: _MemMargin = None, max_slowdown: _MaxSlowdown = None,
             target_step_time: _TargetStepTime = None, target_time: _TargetTime = None,
             host_mem_budget: _HostMemBudget = None, host_mem_margin: _HostMemMargin = None,
             transformer_only: _TransformerOnly = False,
             cfg_batching: _CfgBatching = "auto", weight_dtype: _WeightDtype = "auto",
             allow_fp8: _AllowFp8 = False, codec: _Codec = "auto", no_share_host: _NoShareHost = False,
             out: _Out = None, json_out: _Json = False,
             peak_tflops: _PeakTflops = None, h2d_gbps: _H2dGbps = None, disk_gbps: _DiskGbps = None,
             eta_comp: _EtaComp = None,
             eta_pref: _EtaPref = None, prefetch_bytes: _PrefetchBytes = None, text_len: _TextLen = None,
             weights: _Weights = None, variant: Variant = None, weight_format: _Format = None,
             transformer: _Transformer = None, transformer_2: _Transformer2 = None, cache: _Cache = None,
             cache_hit_rate: _CacheHitRate = None) -> None:
    """Predict step time and peak memory per offload mode and choose chunk size and residency; with --weights DIR
    (or --model DIR) and no catalog model, for the model derived from that folder. Every prediction carries a band
    (`12.4 s +-6%`: about 95% of runs on the profile's machine), from the profile's fits and the planner's own error;
    `chunkflow calibrate` and `calibrate --from-report` narrow it. With --format, in the stored formats users
    download (GGUF, fp8-scaled), priced before the download."""
    from chunkflow_planner.planner import resolve_hardware
    from chunkflow.commands.plan_formats import check_format_flags, show_formats

    formats, out = check_format_flags(weight_format, out, weight_dtype, allow_fp8)
    _check_plan_flags(max_slowdown, target_step_time, text_len, mem_margin, out, hardware)
    _check_host_margin(host_mem_margin)
    spec, workload, text_len = _model_and_workload(model, weights, text_len, cache, cache_hit_rate, height=height,
                                                   width=width, frames=frames, steps=steps, batch=batch)
    resolved = resolve_hardware(hardware, peak_tflops=peak_tflops, h2d_gbps=h2d_gbps, eta_comp=eta_comp,
                                eta_pref=eta_pref, disk_gbps=disk_gbps)
    given = _PlanQuantities.parse(mem_budget, target_step_time, target_time, host_mem_budget, prefetch_bytes)
    if transformer_only and given.target_time is not None:
        raise UserError("--target-time is the whole generation's; leave it out with --transformer-only")
    settings = _PlanSettings(
        workload, resolved, given, sp=sp, max_slowdown=max_slowdown, text_len=text_len,
        transformer_only=transformer_only, cfg_batching=cfg_batching, weight_dtype=weight_dtype, allow_fp8=allow_fp8,
        codec=codec, mem_margin=mem_margin, host_mem_margin=host_mem_margin, share_host=not no_share_host,
        read_bytes=_read_bytes(spec, weights, variant, transformer_only))
    spec = _with_transformer_file(spec, weights, transformer, transformer_2, formats)
    if formats is not None and len(formats) > 1:
        show_formats(console, spec, formats, settings.plan_of, out, json_out)
        return
    spec = _in_format(spec, formats)
    plan, decision, analysis = _plan_or_explain(spec, settings)
    if not transformer_only and spec.pipeline is not None and plan.pipeline is None:
        _note_transformer_alone(given.prefetch_bytes, text_len)
    _show_plan(plan, decision, analysis, out, json_out)


def _check_host_margin(host_mem_margin: float | None) -> None:
    """--host-mem-margin: a share of the host budget between 0 and 0.5."""
    if host_mem_margin is not None and not (math.isfinite(host_mem_margin) and 0 <= host_mem_margin <= 0.5):
        raise UserError(f"--host-mem-margin is a share of the host budget between 0 and 0.5 (e.g. 0.05), got "
                        f"{host_mem_margin}")


def _model_and_workload(model: str | None, weights: str | None, text_len: int | None, cache: str | None,
                        cache_hit_rate: str | None, *, height: int | None, width: int | None, frames: int | None,
                        steps: int | None, batch: int | None) -> tuple[ModelSpec, Workload, int | None]:
    """(the model spec, the workload with its step cache, the --text-len the planner still takes): None for a
    derived model, whose entry took it."""
    from chunkflow_planner.workload import make_workload

    spec = _model_spec(model, weights, dict(height=height, width=width, frames=frames, steps=steps,
                                            text_len=text_len))
    if spec.derived is not None:
        text_len = None  # the derived entry's own text length (--text-len went into it)
    workload = make_workload(spec, batch=batch, frames=frames, height=height, width=width, steps=steps)
    return spec, _with_cache(workload, cache, cache_hit_rate), text_len


@dataclass(frozen=True)
class _PlanQuantities:
    """The size and duration flags of `plan`, parsed: None where not given."""

    budget: int | None
    target_step_time: float | None
    target_time: float | None
    host_budget: int | None
    prefetch_bytes: int | None

    @classmethod
    def parse(cls, mem_budget: str | None, target_step_time: str | None, target_time: str | None,
              host_mem_budget: str | None, prefetch_bytes: str | None) -> _PlanQuantities:
        """Each flag parsed in this order (the first bad one is the one named)."""
        return cls(
            budget=parse_size(mem_budget, "--mem-budget") if mem_budget is not None else None,
            target_step_time=(parse_duration(target_step_time, "--target-step-time")
                              if target_step_time is not None else None),
            target_time=parse_duration(target_time, "--target-time") if target_time is not None else None,
            host_budget=parse_size(host_mem_budget, "--host-mem-budget") if host_mem_budget is not None else None,
            prefetch_bytes=parse_size(prefetch_bytes, "--prefetch-bytes") if prefetch_bytes is not None else None,
        )


@dataclass(frozen=True)
class _PlanSettings:
    """What every plan of one `chunkflow plan` shares (the workload, the hardware, the budgets, targets and levers):
    `plan_of` plans one model with them."""

    workload: Workload
    resolved: ResolvedHardware
    given: _PlanQuantities
    sp: int
    max_slowdown: float | None
    text_len: int | None
    transformer_only: bool
    cfg_batching: str
    weight_dtype: str
    allow_fp8: bool
    codec: str
    mem_margin: float | None
    host_mem_margin: float | None
    share_host: bool
    read_bytes: int | None

    def plan_of(self, model: ModelSpec, with_band: bool = True, at: Workload | None = None) -> PlanResult:
        """The model in one format, planned: (plan, decision, analysis) of `model` at the workload (or at `at`),
        with its bands unless `with_band` is False."""
        from chunkflow_planner.planner import make_plan
        from chunkflow_planner.policy import Levers, codec_refusal

        given = self.given
        levers = Levers.of(self.workload.cfg_passes, self.cfg_batching, self.weight_dtype, self.allow_fp8, self.codec,
                           codec_refusal(model, self.resolved.spec))
        return make_plan(
            model, at if at is not None else self.workload, self.resolved, sp=self.sp, budget=given.budget,
            max_slowdown=None if given.target_step_time is not None else (self.max_slowdown or 1.05),
            target_step_time=given.target_step_time, prefetch_bytes=given.prefetch_bytes, text_len=self.text_len,
            pipeline=not self.transformer_only, host_budget=given.host_budget, target_time=given.target_time,
            generation_slowdown=self.max_slowdown, levers=levers, mem_margin=self.mem_margin,
            read_bytes=None if model.stored is not None else self.read_bytes, host_mem_margin=self.host_mem_margin,
            share_host=self.share_host, with_band=with_band,
        )


def _with_transformer_file(spec: ModelSpec, weights: str | None, transformer: str | None, transformer_2: str | None,
                           formats: list[str] | None) -> ModelSpec:
    """The model with --transformer FILE's blocks, priced from the file's header block by block as they will
    stream (after both files are checked against the folder's config); as it is without one."""
    _check_transformer_files(spec, weights, {"transformer": transformer, "transformer_2": transformer_2})
    if transformer is None:
        return spec
    if formats is not None:
        raise UserError("--transformer FILE is priced from the file itself; --format prices a format before "
                        "its download: give one or the other")
    from chunkflow_planner.stored_file import from_file

    return from_file(spec, transformer)


def _in_format(spec: ModelSpec, formats: list[str] | None) -> ModelSpec:
    """The model in the one stored format --format names; as it is without --format."""
    if formats is None:
        return spec
    from chunkflow_planner.formats import with_format

    return with_format(spec, formats[0])


def _plan_or_explain(spec: ModelSpec, settings: _PlanSettings) -> PlanResult:
    """(plan, decision, analysis) of `spec`; where nothing fits a derived model, its folder's defaults said, and
    what does fit."""
    from chunkflow_planner.policy import Infeasible

    try:
        return settings.plan_of(spec)
    except Infeasible as exc:
        if spec.derived is None:
            raise
        from chunkflow.commands.plan_smaller import explain_infeasible  # a folder's defaults: say them, and what fits

        raise explain_infeasible(spec, settings.workload, exc,
                                 lambda w: settings.plan_of(spec, with_band=False, at=w)) from None


def _note_transformer_alone(prefetch_bytes: int | None, text_len: int | None) -> None:
    """Say that --prefetch-bytes or --text-len left the plan without its pipeline section."""
    flags = [f for f, given in (("--prefetch-bytes", prefetch_bytes is not None),
                                ("--text-len", text_len is not None)) if given]
    _say(f"note: {' and '.join(flags)} plan the transformer alone (a whole pipeline is planned with the "
         "catalog's own volumes): the plan has no pipeline section, and `run --prompt` places the other "
         "components for their phase only")

def _with_cache(workload, cache: str | None, hit_rate: str | None):
    """The workload with the step cache `--cache` names (stepcache.plan_cache) at `--cache-hit-rate` (a number with
    an optional spread, or earlier runs' reports): one line for a bad spec."""
    if cache is None:
        if hit_rate is not None:
            raise UserError("--cache-hit-rate is the hit rate of a cache: give the cache with --cache KIND")
        return workload
    from chunkflow_planner.cache import CacheSpecError, parse_cache
    from chunkflow_planner.stepcache import plan_cache

    try:
        rate, spread, source = _hit_rate(hit_rate, parse_cache(cache))
        return workload.model_copy(update={"cache": plan_cache(cache, rate, source, workload.steps, spread)})
    except CacheSpecError as exc:
        raise UserError(str(exc)) from None


def _hit_rate(text: str | None, setting) -> tuple[float | None, float, str]:
    """`--cache-hit-rate` as (rate, spread, source): a number as given (`0.35`, or `0.35+-0.1` with its spread), or
    run reports of the same cache (a file, or files comma-separated): their measured shares' mean, with the largest
    distance of one from it as the spread, so that every report's rate lies inside the band (one report: none; the
    same prompt and seed skip the same steps, another prompt may not)."""
    if text is None:
        return None, 0.0, "given"
    from chunkflow_planner.stepcache import parse_hit_rate

    if Path(text).expanduser().is_file():
        return _report_hit_rate(text, setting), 0.0, "reports"
    number = parse_hit_rate(text)
    if number is not None:
        return number[0], number[1], "given"
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or any(not Path(p).expanduser().is_file() and _is_number(p) for p in parts):
        raise UserError(f"--cache-hit-rate {text!r}: give one number (0.35 or 0.35+-0.1), or run reports "
                        "comma-separated (run --cache ... --report R.json)")
    rates = [_report_hit_rate(part, setting) for part in parts]
    mean = sum(rates) / len(rates)
    return mean, max(abs(r - mean) for r in rates), "reports"


def _is_number(text: str) -> bool:
    """Whether `text` reads as a rate (with or without its spread), not as a report's path."""
    from chunkflow_planner.cache import CacheSpecError
    from chunkflow_planner.stepcache import parse_hit_rate

    try:
        return parse_hit_rate(text) is not None
    except CacheSpecError:
        return True


def _report_hit_rate(path: str, setting) -> float:
    """One run report's measured share of skipped steps, for a cache of `setting`'s kind."""
    from chunkflow_planner.files import FileError, read_bounded

    try:
        raw = read_bounded(Path(path).expanduser(), f"--cache-hit-rate {path!r}", 256 * 2**20,
                           fix="give a number, or a run report (run --report R.json)")
        got = json.loads(raw.decode()).get("generation", {}).get("cache")
    except FileError as exc:
        raise UserError(str(exc)) from None
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise UserError(f"--cache-hit-rate {path!r} is neither a number nor a readable run report (JSON)") from None
    if not isinstance(got, dict) or not isinstance(got.get("measured_hit_rate"), (int, float)):
        raise UserError(f"--cache-hit-rate {path!r}: the report ran no step cache (run --cache ... --report)")
    kind = (got.get("setting") or {}).get("kind")
    if kind != setting.kind:
        raise UserError(f"--cache-hit-rate {path!r}: the report's cache is {kind}, not {setting.kind}: give a report "
                        "of the same cache")
    return float(got["measured_hit_rate"])


def _check_transformer_files(spec, weights: str | None, files: dict[str, str | None]) -> None:
    """--transformer FILE: checked from its header against the folder's transformer config (a file the run could
    not load is refused now, before anything is downloaded or run)."""
    files = {k: v for k, v in files.items() if v}
    if not files:
        return
    if weights is None:
        raise UserError("--transformer FILE is checked against the pipeline folder's transformer config: give "
                        "--weights DIR with it")
    from chunkflow.models.transformer_file import check_files
    from chunkflow.weights import resolve_weights

    formats = check_files(spec, resolve_weights(weights), files)
    _say("; ".join(f"{name}: {files[name]} ({fmt}), checked against the folder's config" for name, fmt in
                   formats.items()))


def _check_plan_flags(max_slowdown: float | None, target_step_time: str | None, text_len: int | None,
                      mem_margin: float | None, out: str | None, hardware: str | None) -> None:
    """The flags `plan` checks by themselves (the rest are checked where they are parsed)."""
    import math

    from chunkflow_planner.files import check_distinct, check_output_file

    if max_slowdown is not None and target_step_time is not None:
        raise UserError("give either --max-slowdown or --target-step-time, not both")
    if max_slowdown is not None and not (math.isfinite(max_slowdown) and max_slowdown >= 1.0):
        raise UserError(f"--max-slowdown is relative to no offload and must be a number >= 1.0, got {max_slowdown}")
    if text_len is not None and text_len < 0:
        raise UserError(f"--text-len must be >= 0, got {text_len}")
    if mem_margin is not None and not (math.isfinite(mem_margin) and 0 <= mem_margin <= 0.5):
        raise UserError(f"--mem-margin is a share of the budget between 0 and 0.5 (e.g. 0.05), got {mem_margin}")
    if out:
        check_output_file(out, "--out")
        check_distinct({"--out": out}, {"--hardware": hardware if hardware and Path(hardware).exists() else None})


def _model_spec(model: str | None, weights: str | None, given: dict):
    """The catalog's model named by --model; else the entry derived from the folder or Hub id --model names, or
    --weights gives without --model (models/derive.py: the only path here that imports torch)."""
    from chunkflow_planner.catalog import CatalogError, get_model

    if model is None and weights is None:
        raise UserError("give --model (a catalog model, see `chunkflow models`) or --weights DIR (a diffusers "
                        "pipeline folder or a Hub id in the local cache, for the model derived from it)")
    if model is not None:
        try:
            return get_model(model)
        except CatalogError:
            from chunkflow.models.derive import looks_like_folder

            if not looks_like_folder(model):
                raise
    from chunkflow.models.derive import derive_model

    return derive_model(model if model is not None else weights, given)


def _read_bytes(spec, weights: str | None, variant: str | None, transformer_only: bool) -> int | None:
    """The bytes loading the --weights folder reads (its files' headers), or None without --weights."""
    if variant is not None and weights is None:
        raise UserError("--variant names the variant files of the folder --weights gives; add --weights")
    if weights is None:
        return None
    from chunkflow.weights import resolve_weights
    from chunkflow_planner.checkpoint import pipeline_read_bytes

    if spec.derived is not None and spec.pipeline is None:
        return None  # a transformer folder: the transformer is planned alone
    if transformer_only or spec.pipeline is None:
        raise UserError("--weights prices the load of a whole pipeline; leave it out with --transformer-only")
    return pipeline_read_bytes(resolve_weights(weights), spec, variant)


def _untimed(plan, untimed: list[str]) -> list[str]:
    """The derived model's parts no calibration timed: its VAE is timed where the profile planned with holds a decode
    fit by its name (`calibrate --weights` of its folder)."""
    from chunkflow_planner.plan import hardware_of

    vae = plan.model.spec.pipeline.vae if plan.model.spec.pipeline is not None else None
    if vae is None or vae.name not in hardware_of(plan).pipeline.vae_decode:
        return untimed
    return [u for u in untimed if not u.startswith(f"{vae.component} (")]


def _show_plan(plan, decision, analysis, out: str | None, json_out: bool) -> None:
    """The plan to --out, then as JSON on stdout (--json) or as tables."""
    if out:
        plan.write(out)
    if json_out:
        sys.stdout.write(json_shown(plan.to_json()) + "\n")  # a name from a profile may hold control characters
        return
    from chunkflow.commands.plan_tables import print_plan

    print_plan(console, plan, decision, analysis)
    derived = plan.model.spec.derived if plan.model.spec is not None else None
    if derived is not None:
        console.print(f"Model derived from {derived.source} (no catalog entry; the plan file carries it)",
                      markup=False)
        untimed = _untimed(plan, derived.untimed)
        if untimed:
            console.print("Not timed by any calibration (priced from their shapes, with a margin): "
                          + "; ".join(untimed), markup=False)
        for note in derived.notes:
            console.print(f"Assumed: {note}", markup=False)
    if out:
        console.print(f"Plan written to {out}", markup=False)
