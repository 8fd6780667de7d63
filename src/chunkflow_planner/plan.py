"""The plan file: what the planner decided and predicted, read by the runtime and other tools.

A versioned pydantic schema written as JSON. Readers check `schema_version` and refuse others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chunkflow_planner.bands import Band
from chunkflow_planner.catalog import (EFFICIENCY_RANGE, H2D_GBPS_RANGE, PEAK_TFLOPS_RANGE, CatalogError, HardwareSpec,
                                       ModelSpec, Workload, get_hardware)
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.versioned import field_errors, read_versioned

# 2: model.spec, the whole entry of a model derived from a folder (issue 37). A version 1 plan reads as it is: its
# model is the catalog's (model_of).
PLAN_SCHEMA_VERSION = 7  # 7: blocks kept whole (offload.whole_blocks, issue 54); 6: a step cache (workload.cache, prediction.cache; issue 54); 5: the stored format (`format`, issue 52); 4: a band on every prediction (prediction.bands,
# issue 41); 3: the codec (offload.codec and its prediction fields, issue 39); 4, 3, 2 and 1 read as they are (bf16;
# no bands before 4)
OLDER_PLAN_VERSIONS = (1, 2, 3, 4, 5, 6)  # 6 and 5 read as they are: no block kept whole (5: no cache)


from chunkflow_planner.stepcache import StepCache  # noqa: E402 (a field's type)


class PlanError(ChunkflowError):
    """A plan file that cannot be read; the message says why and what to do."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class PlanModel(_Section):
    name: str
    n_blocks: int = Field(gt=0)
    block_bytes_total: int = Field(gt=0)
    non_block_bytes: int = Field(ge=0)
    spec: ModelSpec | None = Field(None, description="the whole model entry, for a model derived from its folder "
                                   "(`plan --weights DIR`); absent: the catalog's entry named `name`")


def model_of(plan: "Plan") -> ModelSpec:
    """The model a plan was made for: the entry it embeds (derived from a folder), else the catalog's by name
    (CatalogError when this chunkflow's catalog has no such model). Every reader of a plan's model asks this."""
    if plan.model.spec is not None:
        return plan.model.spec
    from chunkflow_planner.catalog import get_model

    return get_model(plan.model.name)


class PlanFormat(_Section):
    """The stored format the plan streams (chunkflow_planner/formats.py) against the model's own dtype; absent: bf16."""

    name: str = Field(description="bf16, q8_0, q6_k, q5_k, q4_k, q4_0 or fp8-scaled (a file: the quant type most of "
                      "its block weights take)")
    source: str = Field(description="where the bytes come from: the file's header, or the format's bits per weight "
                        "before the download")
    stored_bytes: int = Field(ge=0, description="the transformer's tensors as stored (one expert)")
    file_bytes: int | None = Field(None, ge=0, description="the file's size on disk (a file only)")
    bf16_bytes: int = Field(ge=0, description="the transformer in the model's own dtype (one expert)")
    block_bytes_ratio: float = Field(gt=0, description="the blocks' stored bytes over their bytes in the model's own "
                                     "dtype: what every streamed byte shrinks by")
    h2d_bytes_per_step: int = Field(ge=0, description="bytes the plan's setting copies host to device a step")
    h2d_bytes_per_step_bf16: int = Field(ge=0, description="the same setting's bytes a step over the bf16 blocks")
    decode_s_per_step: float = Field(ge=0, description="seconds a step dequantizes weights on the GPU (in "
                                     "prediction.step_time_s)")
    decode_gbps: dict[str, float] = Field(default_factory=dict, description="by quant type, the decode rate priced "
                                          "(GB/s of dequantized output)")
    decode_measured: bool = Field(False, description="whether those rates were measured by `chunkflow calibrate` "
                                  "(false: supposed, formats.SUPPOSED_DECODE_SHARE of the memory bandwidth)")
    types: dict[str, int] = Field(default_factory=dict, description="block weights by the type they are stored in")


class PlanWorkload(_Section):
    batch: int = Field(gt=0)
    frames: int = Field(gt=0)
    height: int = Field(gt=0)
    width: int = Field(gt=0)
    tokens: int = Field(gt=0, description="global token count S per sample")
    steps: int = Field(gt=0)
    cfg_passes: int = Field(1, ge=1, le=2)
    cache: StepCache | None = Field(None, description="the step cache the plan prices (stepcache.py); none: every "
                                    "step computed")

    def to_workload(self) -> Workload:
        """The planner's Workload of this section (tokens are derived, not stored)."""
        return Workload(batch=self.batch, frames=self.frames, height=self.height, width=self.width, steps=self.steps,
                        cfg_passes=self.cfg_passes, cache=self.cache)


class PlanParallel(_Section):
    sp_degree: int = Field(1, ge=1)


class PlanHardware(_Section):
    # the bounds of a hardware profile's (catalog.HardwareSpec): a plan without an embedded profile predicts with these
    name: str
    source: str = Field("", description="catalog, calibrated profile path, or default")
    peak_tflops: float = Field(ge=PEAK_TFLOPS_RANGE[0], le=PEAK_TFLOPS_RANGE[1])
    h2d_gbps: float = Field(gt=0, le=H2D_GBPS_RANGE[1])  # a link's rate shared by the GPUs on it
    eta_comp: float = Field(ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1])
    eta_pref: float = Field(ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1])
    memory_bytes: int | None = Field(None, gt=0, le=2**60)
    peer_link: str = "none"
    spec: dict | None = Field(None, description="the full hardware profile planned with (HardwareSpec fields)")

    @property
    def device_is_host(self) -> bool:
        """Whether the plan's 'GPU' is the host CPU (chunkflow's CPU mode): its device memory is host memory, its
        times are nominal, nothing is page-locked."""
        return bool((self.spec or {}).get("device_is_host"))

    @property
    def device_word(self) -> str:
        """What the plan's words call the device: 'GPU', or 'device' where it is the host CPU."""
        return "device" if self.device_is_host else "GPU"


class Critical(_Section):
    axis: Literal["frames", "batch"]
    value: float | None = Field(description="continuous critical frames or batch; None when never reached")
    nearest_valid: int | None = None
    reason: str = ""


class Analysis(_Section):
    block_flops_per_gpu: float
    prefetch_bytes_per_block: float
    f_star: float
    i_block: float
    i_star: float
    t_comp_s: float
    t_pref_s: float
    eta_comp_used: float | None = Field(None, description="eta_comp at this F_block (the curve's value, if any)")
    regime: Literal["hidden", "exposed"]
    critical: Critical


class Prediction(_Section):
    step_time_s: float
    peak_memory_bytes: int
    pinned_host_bytes: int = 0
    disk_read_bytes_per_step: int = Field(0, ge=0, description="the disk tier's reads a step (offload.disk_blocks' "
                                          "streamed bytes, each forward)")
    disk_read_gbps: float | None = Field(None, description="the disk's cold read rate the disk tier was priced at")
    disk_stall_s: float = Field(0.0, ge=0, description="what a step waits for the disk beyond its own time")
    codec_ratio: float | None = Field(None, description="offload.codec's stored / raw bytes the plan was priced at")
    codec_ratio_measured: bool = Field(False, description="whether codec_ratio was measured on the user's weights "
                                       "(`chunkflow calibrate --weights`) or supposed (tiers.SUPPOSED_CODEC_RATIO)")
    codec_decode_gbps: float | None = Field(None, description="the decode rate the codec was priced at (GB/s out)")
    codec_saved_bytes_per_step: int = Field(0, ge=0, description="host-to-device bytes the codec saves a step (the "
                                            "host tier's and the disk tier's blocks)")
    codec_saved_host_bytes: int = Field(0, ge=0, description="bytes the codec saves in the pinned host store")
    codec_staging_bytes: int = Field(0, ge=0, description="device bytes of the codec's staging ring (in the peak)")
    codec_spill_bytes: int = Field(0, ge=0, description="disk bytes of the codec's spill file: the disk tier's tails "
                                   "encoded at the load (CHUNKFLOW_CACHE_DIR or ~/.cache/chunkflow; not host memory)")


class Baselines(_Section):
    none: Prediction = Field(description="no offload, the guidance passes as is fastest (what --max-slowdown is "
                             "relative to)")
    layerwise: Prediction
    none_cfg_batched: bool = Field(False, description="whether that fastest no-offload run batches the guidance passes")


class LoadPrediction(_Section):
    """Building the pipeline from its checkpoint folder (chunkflow_planner/pipeline/load.py)."""

    read_bytes: int = Field(ge=0, description="bytes read from the checkpoint files (as stored)")
    read_bytes_source: str = Field("", description="where read_bytes comes from: the folder's headers (plan "
                                   "--weights) or every component's parameters in its own dtype")
    time_cold_s: float | None = Field(None, ge=0, description="from files the page cache does not hold (None: the "
                                      "profile has no disk rate; `chunkflow calibrate --weights DIR` measures one)")
    time_warm_s: float | None = Field(None, ge=0, description="from files the page cache holds")
    parts_cold_s: dict[str, float] = Field(default_factory=dict, description="where time_cold_s goes")
    h2d_bytes: int = Field(0, ge=0, description="bytes copied between host and device while loading")
    pinned_bytes: int = Field(0, ge=0, description="host bytes page-locked while loading")
    pinned_while_reading_bytes: int = Field(0, ge=0, description="the part of pinned_bytes locked while the reads run "
                                            "(the streamed modules' host stores)")
    fresh_bytes: int = Field(0, ge=0, description="host bytes first touched by their write (not page-locked)")
    host_peak_bytes: int = Field(ge=0, description="host memory the process holds at the load's end, its peak")
    host_peak_per_host_bytes: int | None = Field(None, ge=0, description="under SP, host memory all the host's ranks "
                                                 "hold at the load's end: what they share once, the rest once a rank "
                                                 "(None with one rank: host_peak_bytes)")


class CachePrediction(_Section):
    """What the step cache (workload.cache) saves: the steps it computes and skips at its hit rate (and at the
    rate's spread), and the denoising steps' seconds with and without it, at the plan's setting."""

    label: str
    hit_rate: float | None = Field(None, description="the share of steps skipped, as planned (None: a schedule)")
    hit_rate_source: str
    computed_steps: int = Field(ge=0)
    skipped_steps: int = Field(ge=0)
    computed_steps_range: tuple[int, int] = Field(description="computed steps at the hit rate's spread: (fewest, "
                                                  "most)")
    steps_s: float = Field(ge=0, description="the denoising steps' seconds with the cache")
    steps_s_range: tuple[float, float] = Field(description="the same at the spread's ends")
    uncached_steps_s: float = Field(ge=0, description="the same steps, every one computed")
    speedup: float = Field(gt=0, description="uncached_steps_s / steps_s")


class PlanPrediction(Prediction):
    cache: CachePrediction | None = Field(None, description="the step cache's saving (workload.cache)")
    baselines: Baselines
    load: LoadPrediction | None = Field(None, description="building the pipeline from its checkpoint folder")
    phases: PhasesPrediction | None = Field(None, description="the whole generation, phase by phase")
    generation_time_s: float | None = Field(None, ge=0)
    host_memory_bytes: int | None = Field(None, ge=0, description="host memory the plan needs: with the whole "
                                          "pipeline, the host's (every rank under SP), what the host budget is "
                                          "checked against")
    host_memory: dict[str, int] | None = Field(None, description="host bytes by what holds them, in one process "
                                               "(one rank)")
    host_memory_shared_bytes: int | None = Field(None, ge=0, description="under SP, of host_memory_bytes the bytes "
                                                 "the host's ranks share, held once (offload.share_host: the streamed "
                                                 "tails of the host tier, the parked copies of components placed "
                                                 "phase); None with one rank")
    host_memory_per_rank_bytes: int | None = Field(None, ge=0, description="under SP, the host bytes each rank holds "
                                                   "on its own: host_memory_bytes = host_memory_shared_bytes + "
                                                   "parallel.sp_degree x this; None with one rank")
    disk_read_bytes_per_generation: int = Field(0, ge=0, description="bytes every component on the disk tier reads "
                                                "from the checkpoint's files in one generation")
    bands: dict[str, Band] = Field(default_factory=dict, description="each prediction's band by its path in this "
                                   "section (step_time_s, generation_time_s, phases.denoise.time_s, "
                                   "load.time_cold_s, ...): from the profile's fits and the planner's own error "
                                   "(chunkflow_planner/bands.py); empty in a plan of schema 3 or older")


class PlanComponent(_Section):
    """One component of the pipeline and where it runs (chunkflow_planner/pipeline/placement.py)."""

    name: str = Field(description="the pipeline attribute: text_encoder, transformer, transformer_2, vae, ...")
    kind: Literal["text_encoder", "transformer", "vae"]
    bytes: int = Field(ge=0, description="parameter bytes")
    placement: Literal["gpu", "phase", "stream", "cpu", "disk"] = Field(description="where it runs: on the GPU "
                                                                        "throughout, moved per phase, streamed, on "
                                                                        "the CPU, or read from the checkpoint's files "
                                                                        "(disk)")
    disk_read_bytes: int = Field(0, ge=0, description="bytes it reads from the checkpoint's files a generation (its "
                                 "disk tier; 0 for a plan made before the disk tier was planned per component)")
    steps: int | None = Field(None, ge=0, description="an expert's share of the denoising steps (a pipeline of "
                              "several experts; none for a plan made before the experts were planned apart)")


class PlanPipeline(_Section):
    components: list[PlanComponent] = Field(min_length=1)
    vae_tiling: bool = False


class PhasePrediction(_Section):
    time_s: float = Field(ge=0, description="the phase in a process's first generation, start-up included")
    startup_s: float = Field(0.0, ge=0, description="the part of time_s only a process's first generation pays")
    peak_memory_bytes: int = Field(ge=0, description="device memory in use at the peak: allocation, allocator "
                                   "reserve and CUDA context")
    allocated_bytes: int = Field(0, ge=0, description="torch's peak allocation in the phase")
    parts_s: dict[str, float] = Field(default_factory=dict, description="where time_s goes: components (each text "
                                      "encoder), host work, denoising steps, start-up")


class PhasesPrediction(_Section):
    encode: PhasePrediction
    denoise: PhasePrediction
    decode: PhasePrediction


class Plan(_Section):
    schema_version: int = PLAN_SCHEMA_VERSION
    model: PlanModel
    workload: PlanWorkload
    parallel: PlanParallel
    hardware: PlanHardware
    analysis: Analysis
    offload: OffloadConfig
    prediction: PlanPrediction
    pipeline: PlanPipeline | None = Field(None, description="placements of the whole pipeline (absent: the "
                                          "transformer was planned alone)")
    format: PlanFormat | None = Field(None, description="the stored format streamed (GGUF, fp8-scaled) against "
                                      "bf16; absent: the model's own dtype, and in plans of schema 4 or older")
    memory_budget_bytes: int | None = Field(None, gt=0)
    memory_margin: float | None = Field(None, ge=0, le=0.5, description="share kept free for the memory model's "
                                        "error: every predicted GPU peak is at most memory_budget_bytes / (1 + "
                                        "memory_margin)")
    host_memory_budget_bytes: int | None = Field(None, gt=0)
    host_memory_margin: float | None = Field(None, ge=0, le=0.5, description="share of the host budget kept free "
                                             "for the host model's error: the predicted host peak is at most "
                                             "host_memory_budget_bytes / (1 + host_memory_margin)")
    host_memory_budget_source: str | None = Field(None, description="where the host budget came from: --host-mem-budget "
                                                  "or this machine's available memory when planned")
    target_step_time_s: float | None = None
    target_time_s: float | None = Field(None, description="latency target of the whole generation")
    reason: str = ""

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def write(self, path: str | Path) -> None:
        from chunkflow_planner.files import write_atomic

        write_atomic(path, self.to_json() + "\n")


def load_plan(source: str | os.PathLike | dict | Plan) -> Plan:
    """A plan from a file path, a dict or a Plan, validated whole: its schema, then its model, workload and SP
    degree against the catalog. Anything wrong is a PlanError naming the file (or "plan") and the field."""
    if isinstance(source, Plan):
        plan, where = source, "plan"
    elif isinstance(source, dict):
        if source.get("schema_version", PLAN_SCHEMA_VERSION) not in (PLAN_SCHEMA_VERSION, *OLDER_PLAN_VERSIONS):
            raise PlanError(f"plan has schema_version {source.get('schema_version')!r}; this chunkflow reads "
                            f"version {PLAN_SCHEMA_VERSION}")
        try:
            plan, where = Plan.model_validate(source), "plan"
        except ValidationError as exc:
            raise PlanError(f"plan is malformed: {field_errors(exc)}") from None
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        plan = read_versioned(path, Plan, PLAN_SCHEMA_VERSION, what="plan file", error=PlanError,
                              remedy=f"write it with `chunkflow plan --out {path}`", older=OLDER_PLAN_VERSIONS)
        where = f"plan file {str(path)!r}"
    else:
        raise PlanError(f"a plan is the path of a plan file, a dict or a Plan, not {type(source).__name__}")
    check_plan(plan, where)
    return plan


def check_plan(plan: Plan, where: str = "plan") -> None:
    """The plan's model is in the catalog (or embedded in it), its workload is one that model can run, its SP degree splits its heads,
    and the rest of it fits that model within a real run's bounds (plan_checks): checked whole, before anything is
    loaded, every error naming `where` and the field."""
    from chunkflow_planner.workload import WorkloadError, validate

    try:
        spec = model_of(plan)
    except CatalogError as exc:
        raise PlanError(f"{where}: its model {plan.model.name!r} is not in the catalog of this chunkflow ({exc})") from None
    try:
        validate(spec, plan.workload.to_workload())
    except WorkloadError as exc:
        raise PlanError(f"{where}: workload: {exc}") from None
    if spec.heads % plan.parallel.sp_degree:
        raise PlanError(f"{where}: parallel.sp_degree {plan.parallel.sp_degree} does not divide {spec.name}'s "
                        f"{spec.heads} attention heads; re-plan with a valid --sp")
    from chunkflow_planner.plan_checks import plan_problem, pricing_problem

    problem = plan_problem(plan, spec)
    if problem is None:  # what a run is measured against: the profile must price the plan's codec and disk tier
        problem = pricing_problem(plan.offload, hardware_of(plan))
    if problem is not None:
        raise PlanError(f"{where}: {problem}")


def hardware_of(plan: Plan, profile: str | None = None) -> HardwareSpec:
    """The HardwareSpec to predict a plan's runs with: `profile` (catalog name or file) if given, else the profile
    embedded in the plan, else the catalog entry of the plan's hardware name with the plan's figures laid over it."""
    if profile:
        return get_hardware(profile)
    hw = plan.hardware
    if hw.spec:
        try:
            return HardwareSpec(**hw.spec)
        except ValidationError as exc:
            raise PlanError(f"the plan's embedded hardware profile is malformed ({exc.errors()[0]['msg']}); "
                            "pass --profile or re-plan") from None
    try:
        base = get_hardware(hw.name)
    except CatalogError:
        base = get_hardware("h200")
    return base.model_copy(update=dict(
        name=hw.name, peak_tflops=hw.peak_tflops, eta_comp=hw.eta_comp, eta_pref=hw.eta_pref,
        h2d_link_gbps=hw.h2d_gbps * base.gpus_per_host_link, eta_comp_curve=None,
    ))


def check_setting(plan: Plan, cfg: OffloadConfig, flags: str) -> None:
    """The offload setting a run makes of the plan's (`flags`: the overriding flags, e.g. "--chunk-size") fits the
    plan's model as the plan's own must (plan_checks.offload_problem)."""
    from chunkflow_planner.plan_checks import offload_problem

    problem = offload_problem(cfg, model_of(plan), flags)
    if problem is not None:
        raise PlanError(problem)


def files_needed(plan: Plan, cfg: OffloadConfig | None = None, how: str = "--weights DIR",
                 components: bool = True) -> str | None:
    """Why running `plan` (with offload setting `cfg`, default the plan's) reads the checkpoint's files, so that a
    run needs its folder (`how` names how to give it), or None: blocks kept on disk, or (`components`: a run of
    the whole pipeline) components placed on disk."""
    cfg = plan.offload if cfg is None else cfg
    if cfg.disk_blocks:
        where = "a spill file encoded from the checkpoint's files" if cfg.codec != "none" else "the checkpoint's files"
        return (f"the plan keeps {cfg.disk_blocks} blocks' weights on disk, read each step from {where}: give the "
                f"folder with {how} (or plan with more host memory)")
    if cfg.codec != "none":
        return (f"the plan streams the blocks encoded (codec {cfg.codec}), encoded at the load from the checkpoint's "
                f"files, which also hold the weights outside the forward: give the folder with {how}, or run it "
                "without the codec (--codec off)")
    on_disk = [c.name for c in plan.pipeline.components if c.placement == "disk"] \
        if plan.pipeline is not None and components else []
    if on_disk:
        return (f"the plan reads {', '.join(on_disk)} from the checkpoint's files when it runs (placement disk): "
                f"give the folder with {how} (or plan with more host memory)")
    return None
