"""The model and hardware catalogs: `models.yaml` and `hardware.yaml`, read into typed specs.

The top-level YAML files are the source; copies ship inside the wheel (`chunkflow_planner/data/`) so an
installed `chunkflow` finds them. Per-block parameter counts are derived from the architecture by
`chunkflow_planner.params`, never typed in by hand.
"""

from __future__ import annotations

import difflib
import math
from functools import lru_cache
from importlib import resources
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    model_serializer,
    model_validator,
)

from chunkflow_planner.components import PipelineSpec, TextEncoderArch, TextEncoderSpec, VaeSpec  # noqa: F401  (re-exported)
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.stepcache import StepCache

CATALOG_SCHEMA_VERSION = 10  # 10: the allocator's slack measured with each VAE decode fit (VaeDecodeFit.alloc_slack;
# issue 55); 9: a started process's host memory before its first kernels (process_start_host_bytes)
# and the libraries' page-cache share once warm (libraries_warm_share; issue 55); 8: a freshly started machine's
# start-up (startup_s keys `cold:<phase>`; issue 55);
# 7: a fit's bias (FitQuality.bias: the load path against the load model, the `load` fit;
# issue 55); 6: the start-up's samples (startup_samples_s; issue 55); 5: the stored formats' decode rates (format_decode_gbps; issue 52); 4: each fit's
# quality and the planner's errors from run reports (fits, model_errors; issue 41); 3: the codec's figures
# (codec_decode_gbps, codec_ratio; issue 39); 2: the host model of issue 28 (text_layer_host_us, host_margin); 1 is
# migrated
READ_AS_IS_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9)  # profiles of these versions hold no field version 10 dropped or changed

# Plausible ranges of the figures the planner divides by. Outside them the arithmetic stops meaning anything
# (an efficiency of 1e-300 puts F* beyond any float); a measurement that lands there is wrong.
PEAK_TFLOPS_RANGE = (1e-3, 1e6)  # 1 GFLOP/s .. 1 EFLOP/s
H2D_GBPS_RANGE = (1e-3, 1e5)  # 1 MB/s .. 100 TB/s
EFFICIENCY_RANGE = (1e-6, 1.0)  # an achieved fraction below 1e-6 is a failed measurement (CPU smoke runs reach 1e-3)

BlockKind = Literal["dit", "mmdit_double", "mmdit_single"]
BlockArch = Literal["wan_dit", "flux_double", "flux_single", "hunyuan_double", "hunyuan_single", "qwen_double"]


class CatalogError(ChunkflowError):
    """A catalog entry or profile file that cannot be used; the message says what to fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


QuantFormat = Literal["q8_0", "q6_k", "q5_k", "q4_k", "q4_0", "fp8-scaled"]  # formats.FORMATS less bf16


class StoredBlock(_Strict):
    """One block as a stored format holds it (chunkflow_planner/formats.py): from the file's header, or estimated
    from the format's bits per weight before anything is downloaded."""

    nbytes: int = Field(gt=0, description="bytes of the block's tensors as stored: what the tiers hold and stream")
    decoded: dict[QuantFormat, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="by quant type, bytes of the block's quantized weights once dequantized in "
        "the compute dtype: what its forward decodes, each call")
    dequant_peak_bytes: int = Field(0, ge=0, description="the largest quantized weight of the block in the compute "
                                    "dtype: the transient a layer's dequantization allocates")


class StoredWeights(_Strict):
    """The transformer's weights in a stored format, as a whole (formats.py)."""

    format: QuantFormat = Field(description="the format; of a file, the quant type most of its block weights take")
    source: str = Field(description="where the bytes come from: a file's header, or the format's bits per weight")
    nbytes: int = Field(gt=0, description="bytes of every tensor of the transformer as stored (a file: its tensors' "
                        "data; an estimate: the blocks' estimate and the rest in the model's own dtype)")
    file_bytes: int | None = Field(None, gt=0, description="the file's size on disk (a file only)")
    bf16_block_bytes: int = Field(gt=0, description="the blocks' bytes in the model's own dtype, what it is set "
                                  "against")
    types: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict, description="block weights by the "
                                                          "type they are stored in (GGUF type or dtype)")


class BlockGroup(_Strict):
    """One ordered list of identical blocks in the transformer (e.g. Flux's 19 double-stream blocks)."""

    kind: BlockKind = Field(description="FLOP family: dit (eq. 12), mmdit_double (eq. 18), mmdit_single (eq. 22)")
    arch: BlockArch = Field(description="exact layer layout, used to derive the parameter count")
    count: int = Field(gt=0)
    diffusers_list: str = Field(description="attribute of the diffusers model holding this nn.ModuleList")
    first: int = Field(0, ge=0, description="index in that list of this group's first block (a derived entry splits "
                       "a list where its blocks' sizes change, e.g. SD3's last block, which has no context output)")
    params: int | None = Field(None, gt=0, description="parameters of one block, measured on the meta device (an "
                               "entry derived from a folder); unset: derived from `arch` (params.py)")
    fp32_params: int | None = Field(None, ge=0, description="of `params`, those the class keeps in float32 "
                                    "(measured with `params`)")
    fp8_kept_params: int | None = Field(None, ge=0, description="of `params`, those fp8 storage keeps in their own "
                                        "dtype (norms, modulation; measured with `params`)")
    stored: StoredBlock | None = Field(None, description="one block as a stored format holds it (ModelSpec.stored); "
                                       "unset: in the model's own dtype")

    @model_validator(mode="after")
    def _measured_whole(self) -> "BlockGroup":
        given = [self.params is not None, self.fp32_params is not None, self.fp8_kept_params is not None]
        if any(given) and not all(given):
            raise ValueError("a measured block gives params, fp32_params and fp8_kept_params together")
        if self.params is not None and max(self.fp32_params, self.fp8_kept_params) > self.params:
            raise ValueError("fp32_params and fp8_kept_params are shares of params")
        return self


class Workload(_Strict):
    """What one generation asks of the model: resolution, frames or batch, steps, guidance passes."""

    batch: int = Field(1, gt=0)
    frames: int = Field(1, gt=0, description="video frames (1 for image models)")
    height: int = Field(gt=0)
    width: int = Field(gt=0)
    steps: int = Field(gt=0)
    cfg_passes: int = Field(1, ge=1, le=2, description="transformer forwards per step: 2 with true CFG")
    cache: StepCache | None = Field(None, description="a step cache skipping some steps' blocks (stepcache.py)")


class ActivationModel(_Strict):
    """Peak activation bytes per local token: dtype_bytes * (c_f * f + c_d * d) (see memory.py)."""

    c_f: float = 2.0
    c_d: float = 4.0
    prior_multiple: float | None = Field(None, ge=1.0, description="set where the coefficients are the default "
                                         "model times this, for a class never measured (chunkflow/models/derive.py, "
                                         "ACTIVATION_MARGIN): an upper bound, so the bands of the GPU peaks reach "
                                         "down to the default model (planner.with_activation_prior); None: measured "
                                         "for the class, or the default itself")

    def lowered(self) -> "ActivationModel":
        """The least a class priced by this prior is supposed to hold: the coefficients over prior_multiple (the
        default model); a measured model is itself."""
        if self.prior_multiple is None:
            return self
        k = self.prior_multiple
        return ActivationModel(c_f=self.c_f / k, c_d=self.c_d / k)


class DiffusersSpec(_Strict):
    cls: str = Field(description="diffusers class name, e.g. WanTransformer3DModel")
    config: dict[str, Any] = Field(description="constructor config (the checkpoint's config.json)")
    inputs: Literal["wan", "flux", "hunyuan_video", "qwen_image", "generic"] = Field(
        description="which input builder makes latents, timestep and text states for this class (generic: a "
        "derived entry's class, driven through its diffusers pipeline)"
    )
    cp_plan: Literal["hunyuan_video"] | None = Field(
        None, description="chunkflow's own context-parallel plan, for a class diffusers ships without one"
    )
    masked_attention: bool = Field(False, description="the class hands its joint attention a key-padding mask for the "
                                   "text (SDPA then runs a masked kernel, slower than flash attention: the operator "
                                   "model prices it with the masked table, HardwareSpec.attn_eta_masked)")


class Derived(_Strict):
    """Where an entry derived from a folder came from (chunkflow/models/derive.py), and what of it no calibration
    has timed."""

    source: str = Field(description="the folder (or Hub id) it was derived from")
    untimed: list[str] = Field(default_factory=list, description="parts priced from their shapes with a margin, "
                               "never timed by a calibration (uncatalogued text encoders, VAE)")
    notes: list[str] = Field(default_factory=list, description="what was assumed where the folder did not say")


class ModelSpec(_Strict):
    """Architecture of one diffusion transformer, as the planner and runtime need it."""

    name: str
    aliases: list[str] = []
    description: str = ""
    d: int = Field(gt=0, description="hidden size")
    f: int = Field(gt=0, description="FFN inner size")
    heads: int = Field(gt=0)
    text_len: int = Field(ge=0, description="text context length L_ctx")
    patch: tuple[int, int, int] = Field(description="patch size (t, h, w); t = 1 for image models")
    vae_spatial: int = Field(gt=0)
    vae_temporal: int | None = Field(None, description="VAE temporal compression; None for image models")
    latent_channels: int = Field(gt=0)
    dtype_bytes: int = Field(2, gt=0, description="bytes per parameter (bf16: 2)")
    blocks: list[BlockGroup] = Field(min_length=1, description="block lists in execution order")
    total_params: int = Field(gt=0, description="all parameters of the transformer (meta instantiation)")
    fp32_params: int = Field(0, ge=0, description="of those, the parameters its class keeps in float32 whatever the "
                             "model's dtype (diffusers' _keep_in_fp32_modules: Wan's time embedder, modulation tables "
                             "and norms); those inside a block are priced in its bytes (block_bytes)")
    default_workload: Workload
    activation: ActivationModel = ActivationModel()
    diffusers: DiffusersSpec
    pipeline: PipelineSpec | None = Field(None, description="the rest of the diffusers pipeline (text encoders, VAE)")
    derived: Derived | None = Field(None, description="set on an entry derived from a folder, not written by hand")
    stored: StoredWeights | None = Field(None, description="the weights in a stored format (GGUF, fp8-scaled; "
                                         "formats.py), every block group's `stored` set with it; unset: bf16, the "
                                         "model's own dtype")

    @model_validator(mode="after")
    def _stored_whole(self) -> "ModelSpec":
        has = [g.stored is not None for g in self.blocks]
        if any(has) != all(has) or (self.stored is not None) != all(has):
            raise ValueError("a stored format sets `stored` on the model and on every block group together")
        return self

    @property
    def weight_format(self) -> str:
        """The stored format's name (formats.FORMATS), "bf16" for the model's own dtype."""
        return "bf16" if self.stored is None else self.stored.format

    @property
    def is_video(self) -> bool:
        return self.vae_temporal is not None

    @property
    def per_token_timestep(self) -> bool:
        """Whether its pipeline gives every token its own timestep (Wan2.2-TI2V's expand_timesteps): the time
        embedding and each block's modulation are then per token."""
        return self.pipeline is not None and bool(self.pipeline.config.get("expand_timesteps", False))

    @property
    def n_blocks(self) -> int:
        return sum(g.count for g in self.blocks)

    def block_params(self, group: BlockGroup) -> int:
        """Parameters of one block of `group`: measured (a derived entry), else derived from the architecture."""
        from chunkflow_planner.params import block_params

        return group.params if group.params is not None else block_params(group.arch, self)

    def block_fp32_params(self, group: BlockGroup) -> int:
        """Of one block's parameters, those its class keeps in float32 (measured, else params.block_fp32_params)."""
        from chunkflow_planner.params import block_fp32_params

        return group.fp32_params if group.fp32_params is not None else block_fp32_params(group.arch, self)

    def block_fp8_kept_params(self, group: BlockGroup) -> int:
        """Of one block's parameters, those fp8 storage keeps (measured, else params.fp8_kept_params)."""
        from chunkflow_planner.params import fp8_kept_params

        return group.fp8_kept_params if group.fp8_kept_params is not None else fp8_kept_params(group.arch, self)

    def block_bytes(self, group: BlockGroup) -> int:
        """Bytes of one block of `group` as the built model holds it: dtype_bytes a parameter, float32 for those its
        class keeps in float32 (params.block_fp32_params; the runtime's layout of the block has the same bytes); in a
        stored format, its bytes as stored (group.stored)."""
        if group.stored is not None:
            return group.stored.nbytes
        fp32 = self.block_fp32_params(group)
        return (self.block_params(group) - fp32) * self.dtype_bytes + 4 * fp32

    def block_stored_bytes(self, group: BlockGroup, fp8: bool) -> int:
        """Bytes of one block of `group` in the host store: its bytes, or with fp8 storage one byte for each
        parameter fp8 casts and its own bytes for those it keeps (params.fp8_kept_params)."""
        if not fp8:
            return self.block_bytes(group)
        kept, fp32 = self.block_fp8_kept_params(group), self.block_fp32_params(group)
        return (self.block_params(group) - kept) + (kept - fp32) * self.dtype_bytes + 4 * fp32

    @property
    def block_bytes_total(self) -> int:
        return sum(self.block_bytes(g) * g.count for g in self.blocks)

    @property
    def nbytes(self) -> int:
        """Bytes of every parameter as the loaded model holds them: dtype_bytes each, float32 for fp32_params; in a
        stored format, its tensors' bytes as stored."""
        if self.stored is not None:
            return self.stored.nbytes
        return (self.total_params - self.fp32_params) * self.dtype_bytes + 4 * self.fp32_params

    def component_bytes(self) -> dict[str, int]:
        """Component -> bytes of the whole pipeline as the plan counts them, each in the dtype it runs in: the text
        encoders, every expert transformer (Wan2.2-A14B has two), the VAE; the transformer alone without a
        pipeline."""
        if self.pipeline is None:
            return {"transformer": self.nbytes}
        pipe = self.pipeline
        out = {te.component: te.nbytes for te in pipe.text_encoders}
        out.update({"transformer" if k == 0 else f"transformer_{k + 1}": self.nbytes for k in range(pipe.experts)})
        out[pipe.vae.component] = pipe.vae.nbytes
        return out

    @property
    def non_block_bytes(self) -> int:
        return self.nbytes - self.block_bytes_total

    @property
    def mean_block_bytes(self) -> float:
        """Average per-block parameter bytes over all blocks (the B_pref of Appendix B)."""
        return self.block_bytes_total / self.n_blocks

    def block_sequence(self) -> list[BlockGroup]:
        """One entry per block, in execution order."""
        return [g for g in self.blocks for _ in range(g.count)]


PeerLink = Literal["nvlink", "pcie", "none"]


class VaeDecodeFit(_Strict):
    """A VAE decode measured at a few sizes and fitted linearly: peak allocated bytes mem_const + mem_per_px * (H W)
    + mem_per_voxel * (B F H W), time time_const + time_per_voxel * (B F H W) + time_per_call * (B x decoder calls);
    F = 1 for images; the allocator's slack over those bytes where calibrate measured it (alloc_slack). `tiled` is
    the same with VAE tiling on, its time fitted per decoder call (the VAE's `tiling` counts them:
    components.VaeTiling) where the catalog knows the VAE's tiling. Where and when it was measured in `source`."""

    mem_const: float = Field(ge=-1e12, le=1e13)
    mem_per_px: float = Field(0.0, ge=0, le=1e9)
    mem_per_voxel: float = Field(ge=0, le=1e9)
    time_const: float = Field(ge=-10, le=1e4)
    time_per_voxel: float = Field(0.0, ge=0, le=1)
    time_per_call: float = Field(0.0, ge=0, le=100)
    alloc_slack: float | None = Field(None, ge=0, le=10, description="bytes the allocator held beyond the decode's "
                                      "peak allocation, per activation byte, measured with the fit (calibrate: the "
                                      "median over its decodes); None: the profile's alloc_slack")
    tiled: "VaeDecodeFit | None" = None
    source: str = ""

    @model_validator(mode="after")
    def _has_a_rate(self) -> "VaeDecodeFit":
        if self.time_per_voxel <= 0 and self.time_per_call <= 0:
            raise ValueError("a decode fit needs time_per_voxel or time_per_call above 0")
        return self


STARTUP_KEY = r"^(cold:)?(encode|denoise|decode)$|^encode:[a-z0-9_]+(\+[a-z0-9_]+)*$"  # PipelineProfile.startup_s keys


def encode_startup_key(spec: "ModelSpec") -> str | None:
    """startup_s's key for the encode phase of `spec`'s pipeline: its text encoders' archs in pipeline order."""
    if spec.pipeline is None:
        return None
    return "encode:" + "+".join(te.arch for te in spec.pipeline.text_encoders)


def _check_table(what: str, table: list) -> None:
    """An efficiency table by shape: positive coordinates filling their grid, efficiencies in (0, 1]."""
    dims = len(table[0]) - 1
    axes = [{r[i] for r in table} for i in range(dims)]
    if any(not 0 < r[i] < 1e12 for r in table for i in range(dims)):
        raise ValueError(f"{what}: shapes must be positive")
    if len({tuple(r[:dims]) for r in table}) != len(table) or len(table) != math.prod(len(a) for a in axes):
        raise ValueError(f"{what} must fill its grid: one row for every combination of its shapes")
    if any(not 0 < r[dims] <= 1 for r in table):
        raise ValueError(f"{what}: efficiencies must be in (0, 1]")


# Profile fields of schema version 1 that version 2 prices otherwise (issue 28's lean host model): the host cost of
# one text-encoder operator (host_op_us, cpu_op_us) and per architecture its operator counts (text_host). Migrated
# on load: a measured architecture's count times its cost becomes its layer's host time; the rest is dropped.
OBSOLETE_V1 = ("host_op_us", "cpu_op_us", "text_host")


def _arch_layers() -> dict[str, int]:
    """Layers of each text-encoder architecture's first catalog pipeline encoder (the one calibrate measures)."""
    out: dict[str, int] = {}
    for spec in load_models().values():
        if spec.pipeline is not None and not spec.name.startswith("tiny"):
            for te in spec.pipeline.text_encoders:
                out.setdefault(te.arch, te.shape()["layers"])
    return out


def migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1 profile as version 2: each architecture calibrate counted and timed (text_host: operators per
    layer and once per forward, host microseconds each on the GPU path) becomes its layer's host microseconds
    (text_layer_host_us); host_op_us and cpu_op_us, costs of an operator the version 2 model does not count, go."""
    out = {k: v for k, v in data.items() if k not in OBSOLETE_V1}
    layers = _arch_layers() if data.get("text_host") else {}
    per_layer = dict(out.get("text_layer_host_us") or {})
    for arch, cost in (data.get("text_host") or {}).items():
        if isinstance(cost, dict) and arch in layers and arch not in per_layer:
            ops = cost.get("ops_per_layer", 0) + cost.get("ops_once", 0) / layers[arch]
            per_layer[arch] = ops * cost.get("gpu_op_us", 0.0)
    if per_layer:
        out["text_layer_host_us"] = per_layer
    out["schema_version"] = CATALOG_SCHEMA_VERSION
    return out


# alloc_slack where no generation report measured it: the H200's, refit from its reports (hardware.yaml h200, 0.365).
# Zero, the old default, let every other GPU's plans leave out what the allocator keeps mapped: Wan2.2-5B at 704x1280
# x81 on an H100 held 2.07 GB reserved beyond its allocation, +35% over its plan (docs/data/gpu-cache/README.md, run 3).
ALLOC_SLACK_PRIOR = 0.365


class PipelineProfile(_Strict):
    """The figures of a hardware profile that only the whole-pipeline extension reads (chunkflow_planner.pipeline):
    the host process, the host CPU's rates for components placed there, the text encoders' host dispatch, the VAE's
    decode, the phases' start-ups, the checkpoint load. On disk they stay flat beside the transformer's figures (one
    profile file, one schema version): HardwareSpec lifts them into its `pipeline` on load and writes them back
    flat (see HardwareSpec._lift and _flatten)."""

    process_host_bytes: int = Field(3 * 10**9, ge=0, le=2**44, description="host memory a chunkflow process holds "
                                    "besides the weights: Python, torch, the CUDA libraries, those its kernels "
                                    "loaded (calibrate: the start-up probes' resident set after their calls)")
    process_start_host_bytes: int | None = Field(None, ge=0, le=2**44, description="host memory of a started "
                                                 "process before its first kernels ran (torch, diffusers and CUDA "
                                                 "started): what the load holds besides its copies (calibrate; "
                                                 "`calibrate --from-report` from the loads' host peaks); unset: "
                                                 "process_host_bytes")
    cpu_tflops: float = Field(1.0, gt=0, le=1e4, description="the host CPU's achieved bf16/fp32 matmul rate, for "
                              "components placed on the CPU (calibrate measures it)")
    cpu_gemm_eta: list[tuple[float, float, float, float]] | None = Field(
        None, description="the host CPU's bf16 GEMM efficiencies by shape: [M, N, K, fraction of cpu_tflops] on a "
        "grid (calibrate); a text encoder on the CPU runs a few tokens (small M), far from the square matmul's rate")
    cpu_mem_gbps: float | None = Field(None, gt=0, le=1e6, description="the host CPU's bandwidth for memory-bound "
                                       "operators (calibrate); unset: they are not priced on the CPU")
    text_layer_host_us: dict[TextEncoderArch, Annotated[float, Field(gt=0, le=1e6)]] = Field(
        default_factory=dict, description="per text-encoder architecture, host microseconds one layer of its eager "
        "forward dispatches (Python, dispatcher, kernel launches), as calibrate timed it (the architecture at a "
        "small width, all its layers, over its layers): text encoders run a few tokens through many small layers, "
        "so on the GPU their forwards are often bound by the host; an architecture not listed is priced by its "
        "device time alone")
    host_margin: float = Field(1.0, gt=0, le=100, description="how much longer a generation's text-encoder "
                               "forwards take on the host than calibrate timed them (text_layer_host_us): the "
                               "median ratio over generation reports' host-bound forwards, `chunkflow calibrate "
                               "--from-report`; the host CPU's speed varies up to 2x within a process")
    vae_decode: dict[str, "VaeDecodeFit"] = Field(
        default_factory=dict, description="measured VAE decode fits by VAE name (calibrate); they replace the "
        "catalog's for this GPU")
    postprocess_gbps: float = Field(1.0, gt=0, le=1e4, description="GB/s of float32 output (frames x H x W x 3) "
                                    "the pipeline's postprocessing turns into the result on the host after the VAE "
                                    "decode (device to host, numpy); `chunkflow calibrate --from-report` measures it")
    encode_host_s: float = Field(0.0, ge=0, le=60, description="host seconds of the encode phase outside the text "
                                 "encoders' forwards (tokenizers, prompt cleaning, padding); measured from reports")
    startup_s: dict[Annotated[str, StringConstraints(pattern=STARTUP_KEY)], Annotated[float, Field(ge=0, le=600)]] = \
        Field(default_factory=dict, description="one-time seconds a phase (encode, denoise, decode) adds to the first "
              "generation of a process (CUDA kernels loaded on first use, library handles, the allocator's first "
              "growth); `encode:<text encoder archs>` (e.g. encode:qwen2_5_vl) for one pipeline's encoders, which "
              "load kernels of their own; `cold:<phase>` the same on a freshly started machine, its libraries "
              "read from the disk at their first use (calibrate's first cold process, the libraries dropped from the "
              "page cache first). `chunkflow calibrate --from-report` measures them from generations run with "
              "--warmup")
    startup_samples_s: dict[Annotated[str, StringConstraints(pattern=STARTUP_KEY)],
                            Annotated[list[Annotated[float, Field(ge=0, le=600)]], Field(max_length=64)]] = Field(
        default_factory=dict, description="the start-up samples `startup_s` is the mean of, by its key: each a cold "
        "process's first call less its second (`chunkflow calibrate`) or a report's first generation less a later "
        "one (`calibrate --from-report`), the newest 64 kept; their spread is the `startup` fit's")
    page_cache_gbps: float | None = Field(None, gt=0, le=1e4, description="GB/s the loader reads checkpoint files "
                                          "the page cache holds (calibrate); unset: the disk's rate")
    pin_gbps: float | None = Field(None, gt=0, le=1e5, description="GB/s of page-locking host memory (cudaHostRegister "
                                   "of the pinned stores; calibrate on a GPU); unset: not priced")
    host_fault_gbps: float | None = Field(None, gt=0, le=1e5, description="GB/s of new host memory mapped at its "
                                          "first touch, by the loader's threads (calibrate); unset: not priced")
    load_startup_s: float = Field(0.0, ge=0, le=600, description="one-time seconds of building a pipeline outside "
                                  "its reads, copies and page-locking: imports, modules made on the meta device, "
                                  "tokenizers, scheduler (`chunkflow calibrate --from-report` measures it)")
    libraries_warm_share: float | None = Field(None, ge=0, le=1, description="the share of torch's, the NVIDIA "
                                              "libraries' and triton's shared objects in the page cache once a "
                                              "process's kernels ran (calibrate, after its start-up probes): a warm "
                                              "run's share on this machine, which a run's libraries_cached is judged "
                                              "against (many of those files no generation reads); unset: the share "
                                              "of all of them")
    device_is_host: bool = Field(False, description="the 'GPU' is the host CPU (chunkflow's CPU mode): device memory "
                                 "is host memory, and a plan's host figure counts it")


PIPELINE_FIELDS = frozenset(PipelineProfile.model_fields)  # HardwareSpec's flat keys that fill its `pipeline`


def lift_pipeline(data: dict[str, Any]) -> dict[str, Any]:
    """A flat profile mapping with its pipeline keys gathered into `pipeline` (merged over one already there)."""
    flat = {k: v for k, v in data.items() if k in PIPELINE_FIELDS}
    if not flat:
        return data
    out = {k: v for k, v in data.items() if k not in PIPELINE_FIELDS}
    nested = out.get("pipeline")
    if isinstance(nested, PipelineProfile):
        nested = nested.model_dump()
    out["pipeline"] = {**(nested if isinstance(nested, dict) else {}), **flat}
    return out


CORE_FROM_PIPELINE = ("disk_read_gbps",)  # once PipelineProfile's, now the core's (issue 36: the disk is a tier)


def _core_from_pipeline(data: dict[str, Any]) -> dict[str, Any]:
    """A mapping whose nested `pipeline` still holds a figure the core now owns, with that figure moved up (the file
    is flat, so only mappings built in code hold it nested)."""
    nested = data.get("pipeline")
    if not isinstance(nested, dict) or not any(k in nested for k in CORE_FROM_PIPELINE):
        return data
    out = {**data, "pipeline": {k: v for k, v in nested.items() if k not in CORE_FROM_PIPELINE}}
    for k in CORE_FROM_PIPELINE:
        if k in nested and out.get(k) is None:
            out[k] = nested[k]
    return out


# the fits a profile keeps a record of (chunkflow_planner/bands.py FITS: what each measures and moves) and the kinds
# of prediction the planner's own error is kept for; named here so a profile naming another is refused on reading
FIT_NAMES = ("compute", "h2d", "collectives", "block_overhead", "disk_read", "page_cache", "pin", "host_fault",
             "load_startup", "vae_time", "vae_memory", "text_host", "cpu", "codec_decode", "codec_ratio", "context",
             "process_host", "startup", "load")
QUANTITY_KINDS = ("step_time", "phase_time", "generation_time", "peak_memory", "host_memory", "load_time")
FitName = Literal[FIT_NAMES]  # type: ignore[valid-type]
QuantityKind = Literal[QUANTITY_KINDS]  # type: ignore[valid-type]


class FitQuality(_Strict):
    """How closely one of calibrate's fits (or repeated measurements) describes its samples: the band a plan inherits
    from it (chunkflow_planner/bands.py names the fits and what each moves)."""

    samples: int = Field(ge=1, le=10**7, description="measurements the fit was made from")
    spread: float = Field(ge=0, le=10, description="robust relative spread of one sample: 1.4826 x the median of "
                          "|measured / fitted - 1| beyond the parameters fitted (a normal sample's standard deviation; "
                          "bands.spread)")
    residuals: list[float] = Field(default_factory=list, max_length=256, description="each sample's measured / "
                                   "fitted - 1, as fitted (at most 256 kept)")
    flagged: bool = Field(False, description="the spread is too wide to plan with (bands.FLAG_SPREAD)")
    repeat: str = Field("", description="what to measure again to narrow it")
    source: str = Field("", description="how it was measured")
    drift: float | None = Field(None, ge=0, le=10, description="the relative change of the fit's figures from one "
                                "calibration of this machine to the next (root mean square, pooled over `drift_pairs` "
                                "pairs; bands.drift_between); None: calibrated once, the fit's prior stands "
                                "(bands.FITS)")
    drift_pairs: int = Field(0, ge=0, le=10**6, description="pairs of calibrations `drift` was measured over")
    bias: float = Field(0.0, ge=-10, le=10, description="the median of the residuals where they are a model's "
                        "error rather than samples about a fit (the `load` fit: the load path timed against the load "
                        "model's prediction for its bytes, measured / predicted - 1); its spread is about this bias. "
                        "0 for a fit whose residuals are about the fit itself")


class ModelError(_Strict):
    """The planner's error on one kind of prediction, from the run reports a profile was refit from
    (`calibrate --from-report`): measured / predicted - 1."""

    samples: int = Field(ge=1, le=10**7, description="errors it was made from")
    reports: int = Field(1, ge=1, le=10**7, description="run reports those errors came from")
    bias: float = Field(ge=-10, le=10, description="the median of measured / predicted - 1")
    spread: float = Field(ge=0, le=10, description="1.4826 x the median absolute deviation of it about the bias "
                          "(from fewer than 2 reports at least the kind's prior scatter)")
    errors: list[float] = Field(default_factory=list, max_length=256, description="the errors, oldest first (at most "
                                "the newest 256 kept): a later refit adds its own to them")
    source: str = ""


class HardwareSpec(_Strict):
    """One GPU type in a node: rates, links and the planner's efficiency factors, what the transformer-streaming
    model reads; the figures only the whole-pipeline extension reads are its `pipeline` (PipelineProfile)."""

    schema_version: int = CATALOG_SCHEMA_VERSION
    name: str
    description: str = ""
    peak_tflops: float = Field(ge=PEAK_TFLOPS_RANGE[0], le=PEAK_TFLOPS_RANGE[1], description="peak dense BF16 TFLOP/s of one GPU (P_peak)")
    h2d_link_gbps: float = Field(ge=H2D_GBPS_RANGE[0], le=H2D_GBPS_RANGE[1], description="pinned host-to-device GB/s of one host link")
    gpus_per_host_link: int = Field(1, gt=0, le=1024, description="GPUs sharing that host link (root complex)")
    memory_bytes: int = Field(gt=0, le=2**60, description="GPU memory")
    gpus: int = Field(1, gt=0, le=1024, description="GPUs in the node")
    peer_link: PeerLink = Field(description="how GPUs reach each other: nvlink, pcie (shares the host link) or none")
    coll_gbps: float = Field(gt=0, le=1e6, description="effective per-GPU all-to-all bandwidth over the peer link")
    contention: float = Field(1.0, ge=1.0, le=1e3, description="collective slowdown while H2D is in flight on a shared link")
    eta_comp: float = Field(ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1], description="achieved fraction of P_peak on DiT blocks")
    eta_pref: float = Field(ge=EFFICIENCY_RANGE[0], le=EFFICIENCY_RANGE[1], description="achieved fraction of the H2D bandwidth for large copies")
    eta_comp_curve: list[tuple[float, float]] | None = Field(
        None,
        description="measured [F_block, eta_comp] pairs (FLOP, fraction of P_peak), increasing in F; the planner "
        "interpolates eta linearly in log F and clamps at the ends. Without it the scalar eta_comp applies.",
    )
    eta_comp_curves: dict[str, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="per-model eta_comp curves (catalog model name -> [F_block, eta] pairs), measured on that model's "
        "own blocks; a model listed here uses its curve instead of eta_comp_curve",
    )
    gemm_tflops: float | None = Field(None, gt=0, le=1e6, description="measured bf16 GEMM rate (calibrate), for reference")
    gemm_eta: list[tuple[float, float, float, float]] | None = Field(
        None, description="measured bf16 GEMM efficiencies by shape: [M, N, K, fraction of P_peak] on a grid "
        "(calibrate); the operator model (ops.py) interpolates them in log M, log N, log K")
    attn_eta: list[tuple[float, float, float]] | None = Field(
        None, description="measured attention efficiencies by shape: [query tokens, key tokens, fraction of P_peak] "
        "(bf16 SDPA, head dim 128; calibrate)")
    attn_eta_head_dims: dict[int, list[tuple[float, float, float]]] | None = Field(
        None, description="attention efficiencies at head dims other than attn_eta's 128: {head dim: [query tokens, "
        "key tokens, fraction of P_peak]} (calibrate measures 64: LTX-Video's and CogVideoX's attention ran at 0.69x "
        "of head dim 128's rate on an H200); a model's attention uses the nearest head dim measured")
    attn_eta_masked: list[tuple[float, float, float]] | None = Field(
        None, description="the same with a key-padding mask (bf16 SDPA given attn_mask, as HunyuanVideo's "
        "attention runs; calibrate); absent: masked attention is priced as unmasked")
    hbm_gbps: float = Field(3000.0, gt=0, le=1e6, description="achieved device-memory bandwidth for memory-bound "
                            "operators (norms, activations, residuals)")
    fp8_cast_gbps: float | None = Field(None, gt=0, le=1e6, description="bf16 bytes per second a float8 -> bf16 "
                                        "cast of a block's weights produces on the GPU (calibrate measures it); "
                                        "unset: two thirds of hbm_gbps (it reads 1 byte and writes 2 per weight)")
    mem_ops_scale: float = Field(1.0, gt=0, le=100, description="measured block time beyond GEMMs and attention, as "
                                 "a multiple of the memory-bound operators' modelled time (calibrate fits it)")
    context_bytes: int = Field(768 * 2**20, ge=0, le=2**40, description="device memory in use that torch does not "
                               "count: CUDA context, cuBLAS and cuDNN workspaces (calibrate measures it)")
    reserve_fraction: float = Field(0.05, ge=0, le=1, description="allocator reserve beyond torch's peak allocation, "
                                    "as a fraction of it (expandable segments keep it small)")
    alloc_slack: float = Field(ALLOC_SLACK_PRIOR, ge=0, le=10, description="bytes the allocator holds beyond a "
                               "phase's peak allocation, per byte of the phase's activations (freed activations it "
                               "keeps mapped); measured from reports (calibrate --from-report), else the prior")
    disk_read_gbps: float | None = Field(None, gt=0, le=1e4, description="GB/s checkpoint files the page cache does "
                                         "not hold are read at, from the disk the weights are on: the disk tier's "
                                         "link (tiers.py) and the load's (`chunkflow calibrate --weights DIR` "
                                         "measures it; `plan --disk-gbps` supposes one); unset: nothing is planned "
                                         "on disk and load times are not predicted")
    codec_decode_gbps: float | None = Field(None, gt=0, le=1e6, description="GB/s of decoded output the streamed "
                                            "bytes' lossless codec (exponent-pack) decodes at on the GPU: its "
                                            "decode's price (tiers.decode_s); `chunkflow calibrate` measures it; "
                                            "unset: the codec cannot be priced and the planner never picks it")
    format_decode_gbps: dict[QuantFormat, Annotated[float, Field(gt=0, le=1e6)]] = Field(
        default_factory=dict, description="by stored format, GB/s of dequantized output (compute dtype) its layers' "
        "dequantization runs at on the GPU, diffusers' own functions (`chunkflow calibrate` measures them); a "
        "format left out is priced at formats.SUPPOSED_DECODE_SHARE x hbm_gbps, supposed")
    codec_encode_gbps: float | None = Field(None, gt=0, le=1e6, description="GB/s of raw streamed bytes a load "
                                            "encodes with the codec, end to end (to the GPU, encoded, back to "
                                            "pinned memory): the load's price of the codec (pipeline/load.py); "
                                            "unset: a load's time is not predicted with the codec on")
    codec_ratio: float | None = Field(None, gt=0, le=1.0, description="stored / raw bytes of the codec on the "
                                      "weights `chunkflow calibrate --weights DIR` sampled (measured); unset: "
                                      "tiers.SUPPOSED_CODEC_RATIO, supposed for trained bf16 weights")
    host_mem_margin: float = Field(0.05, ge=0, le=0.5, description="the share by which a plan keeps its predicted "
                                   "host peak below --host-mem-budget (peak <= budget / (1 + host_mem_margin)), for "
                                   "the host model's error: the default is the largest under-prediction measured, "
                                   "FLUX.1-dev with fp8 storage planned at 25.92 GB that held 27.14 GB on an H200 "
                                   "host (+4.7%; Wan2.2-TI2V-5B +3.3%, Wan2.1-14B +1.0%, 2026-12-03, "
                                   "docs/tiers-h200.md: the process grows while a first generation loads CUDA's "
                                   "libraries), rounded up")
    mem_margin: float = Field(0.12, ge=0, le=0.5, description="the share by which a plan keeps its predicted GPU "
                              "peak below the budget (peak <= budget / (1 + mem_margin)), for the memory model's error: "
                              "the largest under-prediction of a phase's peak in generation reports, measured by "
                              "`chunkflow calibrate --from-report` (default: that of eight pipelines on an H200)")
    dma_startup_us: float = Field(3.0, ge=0, le=1e6, description="fixed cost per H2D copy (chunk-size efficiency)")
    block_overhead_us: float = Field(30.0, ge=0, le=1e6, description="runtime cost per offloaded block per forward")
    yield_overhead_us: float = Field(10.0, ge=0, le=1e6, description="runtime cost per collective when yielding")
    codec_launch_us: float = Field(50.0, ge=0, le=1e6, description="runtime cost per decode launch of the codec (its "
                                   "events, streams and the launch, on the thread that launches the forward; about "
                                   "50 us a 4 MB chunk on one H200, docs/codec-h200.md)")
    pipeline: PipelineProfile = Field(default_factory=PipelineProfile, description="the figures only the "
                                      "whole-pipeline extension reads; flat in the file, beside these")
    source: str = Field("", description="where these numbers come from")
    fits: dict[FitName, FitQuality] = Field(default_factory=dict, description="calibrate's fits by the name "
                                        "chunkflow_planner/bands.py gives them: samples, spread, residuals; empty for "
                                        "a catalog entry (its figures are supposed, not measured here)")
    model_errors: dict[QuantityKind, ModelError] = Field(default_factory=dict, description="the planner's error by kind of "
                                                "prediction (bands.QUANTITY_KINDS) in run reports of this machine")

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("schema_version", 1) == 1:
            data = migrate_v1(data)
        if isinstance(data, dict) and data.get("schema_version") in READ_AS_IS_VERSIONS:
            data = {**data, "schema_version": CATALOG_SCHEMA_VERSION}
        return lift_pipeline(_core_from_pipeline(data)) if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _flatten(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumped flat, as profile files hold it: the pipeline's figures in place of `pipeline`."""
        out: dict[str, Any] = {}
        for k, v in handler(self).items():
            if k == "pipeline" and isinstance(v, dict):
                out.update(v)
            else:
                out[k] = v
        return out

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> "HardwareSpec":
        """A copy with `update` applied; a pipeline figure among its keys updates the `pipeline` sub-model."""
        if update and PIPELINE_FIELDS & update.keys():
            flat = {k: v for k, v in update.items() if k in PIPELINE_FIELDS}
            update = {k: v for k, v in update.items() if k not in PIPELINE_FIELDS}
            update["pipeline"] = (update.get("pipeline") or self.pipeline).model_copy(update=flat)
        return super().model_copy(update=update, deep=deep)

    def figure(self, key: str) -> Any:
        """A figure by its key in the profile file, whether the transformer's or the pipeline's."""
        return getattr(self.pipeline if key in PIPELINE_FIELDS else self, key)

    @model_validator(mode="after")
    def _check_curve(self) -> "HardwareSpec":
        named = [("eta_comp_curve", self.eta_comp_curve)] + [
            (f"eta_comp_curves[{m}]", c) for m, c in self.eta_comp_curves.items()
        ]
        for what, curve in named:
            if curve is None:
                continue
            if not curve:
                raise ValueError(f"{what} must hold at least one [flops, eta] pair (or be left out)")
            flops = [f for f, _ in curve]
            if any(not 0 < f < 1e30 for f in flops) or any(b <= a for a, b in zip(flops, flops[1:])):
                raise ValueError(f"{what} needs positive FLOP values in strictly increasing order")
            lo, hi = EFFICIENCY_RANGE
            if any(not lo <= e <= hi for _, e in curve):
                raise ValueError(f"{what} efficiencies must be in [{lo:g}, {hi:g}]")
        tables = [("gemm_eta", self.gemm_eta), ("attn_eta", self.attn_eta), ("attn_eta_masked", self.attn_eta_masked),
                  ("cpu_gemm_eta", self.pipeline.cpu_gemm_eta)]
        for hd, table in (self.attn_eta_head_dims or {}).items():
            if not 8 <= hd <= 512 or not table:
                raise ValueError(f"attn_eta_head_dims: head dim {hd} needs to be in [8, 512] with a table")
            tables.append((f"attn_eta_head_dims[{hd}]", table))
        for what, table in tables:
            if table:
                _check_table(what, table)
        return self

    @property
    def cast_gbps(self) -> float:
        """bf16 bytes per second of the fp8 -> bf16 weight cast (measured, else from the memory bandwidth)."""
        return self.fp8_cast_gbps if self.fp8_cast_gbps is not None else self.hbm_gbps * 2 / 3

    @property
    def pace_collectives(self) -> bool:
        """Whether chunk copies should pause for collectives: not over NVLink, where collectives leave the host
        link alone and pausing only adds fences (docs/results.md); elsewhere (PCIe, or unknown) they do."""
        return self.peer_link != "nvlink"

    def for_model(self, model: "str | ModelSpec") -> "HardwareSpec":
        """This hardware as seen by `model`: its own measured eta_comp curve if the profile has one; else, for a
        ModelSpec on a profile with efficiency tables by shape, the curve of its operators (ops.py); else as is."""
        name = model if isinstance(model, str) else model.name
        curve = self.eta_comp_curves.get(name)
        if curve is None and not isinstance(model, str) and self.gemm_eta:
            curve = _operator_curve(model, self)
        if curve is None or curve == self.eta_comp_curve:
            return self
        return self.model_copy(update={"eta_comp_curve": curve})

    def eta_comp_at(self, F: float) -> float:
        """eta_comp for a block of F FLOP (per GPU): the curve interpolated in log F, clamped; else eta_comp."""
        curve = self.eta_comp_curve
        if not curve:
            return self.eta_comp
        if F <= curve[0][0]:
            return curve[0][1]
        if F >= curve[-1][0]:
            return curve[-1][1]
        for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
            if F <= f1:
                u = (math.log(F) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return e0 + u * (e1 - e0)
        return curve[-1][1]  # pragma: no cover

    @property
    def h2d_gbps(self) -> float:
        """Effective per-GPU host-to-device bandwidth BW_h2d (the link shared out among its GPUs)."""
        return self.h2d_link_gbps / self.gpus_per_host_link


_OP_CURVES: dict[tuple[int, str], tuple[HardwareSpec, list[tuple[float, float]]]] = {}


def _operator_curve(spec: ModelSpec, hw: HardwareSpec) -> list[tuple[float, float]]:
    """ops.model_eta_curve, kept per (profile, model) for the life of the profile object."""
    from chunkflow_planner.ops import model_eta_curve

    key = (id(hw), spec.name)
    hit = _OP_CURVES.get(key)
    if hit is None or hit[0] is not hw:
        if len(_OP_CURVES) > 256:
            _OP_CURVES.clear()
        hit = (hw, model_eta_curve(spec, hw))
        _OP_CURVES[key] = hit
    return hit[1]


def _catalog_text(filename: str) -> str:
    return resources.files("chunkflow_planner").joinpath("data", filename).read_text()


# the shipped catalogs are ours: libyaml's parser (about ten times the pure-Python one's speed) where PyYAML has it;
# a user's profile keeps the pure-Python parser, whose depth ends in a RecursionError (refused in one line) where
# libyaml's recursion would overflow the C stack
_CATALOG_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_yaml(text: str, what: str, shipped: bool = False) -> dict[str, Any]:
    """`text` parsed as a YAML mapping (`shipped`: one of the package's own catalogs, parsed by libyaml where
    installed; both parsers build the same values with the same constructor, yaml.SafeConstructor)."""
    try:
        data = yaml.load(text, Loader=_CATALOG_LOADER) if shipped else yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{what} is not valid YAML: {exc}") from None
    except RecursionError:
        raise CatalogError(f"{what} is nested too deeply to be a profile (not what chunkflow writes)") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{what} must be a YAML mapping")
    return data


def _errors(exc: ValidationError) -> str:
    """pydantic's errors as `field: message; ...`, a pipeline figure named by its flat key (as the file holds it)."""
    def where(loc: tuple) -> str:
        loc = loc[1:] if loc[:1] == ("pipeline",) else loc
        return ".".join(str(p) for p in loc if str(p) not in ("", "[key]"))

    return "; ".join(f"{where(tuple(e['loc']))}: {e['msg']}" for e in exc.errors())


@lru_cache(maxsize=None)
def load_models() -> dict[str, ModelSpec]:
    """All models of the shipped `models.yaml`, by canonical name."""
    data = _read_yaml(_catalog_text("models.yaml"), "models.yaml", shipped=True)
    out: dict[str, ModelSpec] = {}
    for name, entry in data.get("models", {}).items():
        try:
            out[name] = ModelSpec(name=name, **entry)
        except ValidationError as exc:
            raise CatalogError(f"models.yaml entry {name!r}: {_errors(exc)}") from None
    return out


@lru_cache(maxsize=None)
def load_hardware() -> dict[str, HardwareSpec]:
    """All hardware of the shipped `hardware.yaml`, by name."""
    data = _read_yaml(_catalog_text("hardware.yaml"), "hardware.yaml", shipped=True)
    out: dict[str, HardwareSpec] = {}
    for name, entry in data.get("hardware", {}).items():
        try:
            out[name] = HardwareSpec(name=name, **entry)
        except ValidationError as exc:
            raise CatalogError(f"hardware.yaml entry {name!r}: {_errors(exc)}") from None
    return out


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name.lower(), choices, n=3, cutoff=0.4)
    return f" Did you mean {', '.join(close)}?" if close else ""


def get_model(name: str) -> ModelSpec:
    """A model by name or alias (case-insensitive); unknown names get close suggestions."""
    models = load_models()
    key = name.lower()
    for spec in models.values():
        if key == spec.name.lower() or key in (a.lower() for a in spec.aliases):
            return spec
    choices = [n.lower() for n in models] + [a.lower() for s in models.values() for a in s.aliases]
    raise CatalogError(
        f"unknown model {name!r}.{_suggest(name, choices)} `chunkflow models` lists the catalog."
    )


def get_hardware(name: str) -> HardwareSpec:
    """A catalog GPU by name (case-insensitive), or a hardware profile file (YAML or JSON) by path."""
    hw = load_hardware()
    for spec in hw.values():
        if spec.name.lower() == name.lower():
            return spec
    path = Path(name).expanduser()
    if path.suffix.lower() in {".yaml", ".yml", ".json"} or path.exists():
        return load_profile(path)
    raise CatalogError(
        f"unknown hardware {name!r}.{_suggest(name, [n.lower() for n in hw])} "
        "`chunkflow hardware` lists the catalog; a path to a profile file from `chunkflow calibrate` also works."
    )


def load_profile(path: Path) -> HardwareSpec:
    """A hardware profile file (what `chunkflow calibrate` writes), validated whole; errors name the file."""
    from chunkflow_planner.files import read_text

    # a profile is ~16 KB (YAML, parsed in Python: a bound in tens of MB would take minutes to refuse)
    data = _read_yaml(read_text(path, "hardware profile", max_bytes=2**20), f"hardware profile {str(path)!r}")
    version = data.get("schema_version", CATALOG_SCHEMA_VERSION)
    if version not in (1, *READ_AS_IS_VERSIONS, CATALOG_SCHEMA_VERSION):  # 1 is migrated (HardwareSpec._migrate)
        raise CatalogError(
            f"hardware profile {str(path)!r} has schema_version {version}; this chunkflow reads "
            f"version {CATALOG_SCHEMA_VERSION} (and {READ_AS_IS_VERSIONS[0]}-{READ_AS_IS_VERSIONS[-1]} as they are, 1 "
            "migrated). Re-run `chunkflow calibrate`."
        )
    try:
        return HardwareSpec(**data)
    except (ValidationError, TypeError, RecursionError) as exc:
        detail = _errors(exc) if isinstance(exc, ValidationError) else "nested too deeply" if isinstance(
            exc, RecursionError) else str(exc)
        raise CatalogError(f"hardware profile {str(path)!r} is malformed: {detail}") from None
