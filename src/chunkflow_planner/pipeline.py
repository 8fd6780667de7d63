"""The whole generation: encode (text encoders), denoise (the transformer plan), decode (the VAE), with a placement
for every component, GPU memory per phase, host memory, and the policy that picks the placements.

Placements:
- `gpu`: on the GPU for the whole generation;
- `phase`: in (pinned) host memory, on the GPU for its own phase only (chunkflow parks it outside);
- `stream`: chunkflow streams its layers from pinned host memory (the transformer as the plan says; a text
  encoder layer by layer), parked outside its phase;
- `cpu`: runs on the CPU (text encoders).
The VAE may decode tiled.

Per phase the prediction is its time and its peak GPU memory, where peak memory is what runs out: torch's peak
allocation, what the allocator keeps of freed activations (`alloc_slack`; memory.device_need) and the device memory
torch does not count (`context_bytes`). Host memory is every host copy (pinned
stores of streamed and parked components, CPU components) plus what the process holds besides weights
(`process_host_bytes`). Times come from the operator model (ops.py) for text encoders, the transformer's step
model (steptime.py) for denoising, and the VAE's measured decode fit (catalog.VaeDecodeFit) for decoding; each phase
adds its measured one-time start-up cost (HardwareSpec.startup_s): the times are those of a process's first
generation, and a later one is faster by the start-up.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, VaeDecodeFit, Workload, encode_startup_key
from chunkflow_planner.components import TextEncoderSpec
from chunkflow_planner import explain
from chunkflow_planner.memory import allocation_within, device_need
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.ops import ops_time, ops_time_cpu, text_encoder_ops
from chunkflow_planner.overlap import GB
from chunkflow_planner.policy import (
    BATCHING_GAIN,
    Facts,
    Infeasible,
    Lever,
    Point,
    Problem,
    Setting,
    Target,
    best_of,
    candidates,
    chunk_tie,
    levers_of,
    setting,
)

PHASES = ("encode", "denoise", "decode")
TEXT_PLACEMENTS = ("gpu", "phase", "stream", "cpu")
TRANSFORMER_PLACEMENTS = ("gpu", "phase", "stream")
VAE_PLACEMENTS = ("gpu", "phase")
TEXT_STREAM_CHUNK = 16 * 10**6


class PipelineError(ChunkflowError):
    """A model without a pipeline in the catalog, or a VAE without a decode measurement."""


@dataclass(frozen=True)
class Placements:
    text_encoders: tuple[str, ...]
    transformer: str
    vae: str
    vae_tiling: bool


@dataclass
class Phase:
    """One phase's predicted time and peak allocation (torch's bytes); `peak_memory` adds reserve and context."""

    time_s: float = 0.0
    allocated_bytes: float = 0.0
    detail: dict[str, float] = field(default_factory=dict)
    startup_s: float = 0.0  # part of time_s paid only by a process's first generation (HardwareSpec.startup_s)
    activation_bytes: float = 0.0  # of allocated_bytes, the activations (the allocator's slack scales with them)


@dataclass
class PipelineEstimate:
    placements: Placements
    transformer: Point
    phases: dict[str, Phase]
    host_bytes: dict[str, float]
    hw: HardwareSpec

    def peak_memory(self, phase: str) -> int:
        """Device memory in use at the phase's peak: allocation, the allocator's slack over the activations (what
        it keeps mapped of freed ones, `alloc_slack`), its reserve and the context."""
        ph = self.phases[phase]
        return device_need(ph.allocated_bytes, ph.activation_bytes, self.hw)

    @property
    def gpu_need(self) -> int:
        return max(self.peak_memory(p) for p in PHASES)

    @property
    def binding_phase(self) -> str:
        return max(PHASES, key=self.peak_memory)

    @property
    def generation_time(self) -> float:
        return sum(p.time_s for p in self.phases.values())

    @property
    def host_memory(self) -> int:
        return int(sum(self.host_bytes.values()))


# The decoded frames in host memory at the end of a generation, as float32 RGB: diffusers' postprocessing holds
# two copies (the tensor brought to the CPU and the stacked numpy array) and writing the file a third (its
# conversion). On the 61 generation reports of H200s in docs/data, with process_host_bytes refit for each, the peak
# host memory is predicted within 5.9% (worst) with three copies, within 16.2% with one
# (docs/data/host-model-2026-12-02).
OUTPUT_HOST_COPIES = 3


def output_host_bytes(w: Workload) -> float:
    """Host bytes of the decoded output at the end of a generation (OUTPUT_HOST_COPIES float32 RGB copies)."""
    return OUTPUT_HOST_COPIES * w.batch * w.frames * w.height * w.width * 3 * 4


def vae_fit(spec: ModelSpec, hw: HardwareSpec) -> VaeDecodeFit:
    """The VAE's decode fit measured on this GPU (profile), else the catalog's (measured on the GPU it names)."""
    vae = spec.pipeline.vae
    if vae.name in hw.vae_decode:
        return hw.vae_decode[vae.name]
    if vae.decode is None:
        raise PipelineError(f"{spec.name}'s VAE {vae.name} has no decode measurement; run `chunkflow calibrate` on a "
                            "GPU to measure it")
    return VaeDecodeFit(**vae.decode)


def output_bytes(w: Workload) -> float:
    """The decoded output as float32 RGB: what the pipeline's postprocessing turns into the result."""
    return w.batch * w.frames * w.height * w.width * 3 * 4


def decode_calls(spec: ModelSpec, w: Workload) -> int:
    """Work units of a tiled decode of `w`'s output: diffusers' decoder calls times the batch (each call decodes the
    batch's tiles together; the fits are measured at batch 1 and priced per tile decoded). 0 where the catalog has
    no tiling for the VAE."""
    tiling = spec.pipeline.vae.tiling
    if tiling is None:
        return 0
    vt = spec.vae_temporal
    lf = (w.frames - 1) // vt + 1 if vt else 1
    return w.batch * tiling.decoder_calls(w.height, w.width, lf, spec.vae_spatial, vt)


def decode_cost(spec: ModelSpec, w: Workload, hw: HardwareSpec, tiled: bool) -> tuple[float, float]:
    """(seconds, peak activation bytes) of decoding `w`'s output, from the VAE's fit (tiled or not), and of the
    pipeline's postprocessing of it (output_bytes at postprocess_gbps)."""
    fit = vae_fit(spec, hw)
    if tiled:
        if fit.tiled is None:
            raise PipelineError(f"the decode fit of {spec.pipeline.vae.name} has no tiled measurement")
        fit = fit.tiled
    calls = decode_calls(spec, w) if fit.time_per_call > 0 else 0
    if fit.time_per_call > 0 and not calls:
        raise PipelineError(f"the decode fit of {spec.pipeline.vae.name} is per decoder call, but the catalog has "
                            "no tiling for it to count them (models.yaml: pipeline.vae.tiling)")
    px = w.height * w.width
    voxels = w.batch * w.frames * px
    mem = fit.mem_const + fit.mem_per_px * px + fit.mem_per_voxel * voxels
    post = output_bytes(w) / (hw.postprocess_gbps * GB)
    # a negative intercept (a fit of older calibrations) is not subtracted: small decodes would cost nothing
    seconds = max(0.0, fit.time_const) + fit.time_per_voxel * voxels + fit.time_per_call * calls
    return seconds + post, max(0.0, mem)


# -------------------------------------------------------------------------------------------- pieces


def _text_act(te: TextEncoderSpec) -> float:
    """Peak activation bytes of one text-encoder forward (hidden states, MLP, materialised attention scores)."""
    a = te.shape()
    n = te.tokens
    act = n * (6 * a["d"] + 2 * a["ff"]) * te.dtype_bytes
    if a["eager_attention"]:
        act += 2 * a["heads"] * n * n * 4
    return act


def text_device_s(te: TextEncoderSpec, hw: HardwareSpec) -> float:
    """Seconds one forward of a text encoder keeps the GPU busy: its operators' device time (ops.py)."""
    return ops_time(text_encoder_ops(te, 1, te.tokens), hw)


def text_host_s(te: TextEncoderSpec, hw: HardwareSpec) -> float:
    """Host seconds one eager forward of a text encoder dispatches in a generation: its layers at the host cost of
    one as calibrate timed it for its architecture (HardwareSpec.text_layer_host_us; 0 where unmeasured), times the
    reports' host_margin."""
    return te.shape()["layers"] * hw.text_layer_host_us.get(te.arch, 0.0) * 1e-6 * hw.host_margin


def text_forward_s(te: TextEncoderSpec, hw: HardwareSpec, on_cpu: bool = False) -> float:
    """Seconds of one forward of a text encoder: on the GPU the longer of its device time and its host dispatch,
    on the CPU its operators' time at the CPU's measured rates plus that dispatch (text_host_s, ops.py)."""
    if on_cpu:
        return ops_time_cpu(text_encoder_ops(te, 1, te.tokens), hw) + text_host_s(te, hw)
    return max(text_device_s(te, hw), text_host_s(te, hw))


def _text_cost(te: TextEncoderSpec, placement: str, passes: int,
               hw: HardwareSpec) -> tuple[float, float, float, float]:
    """(seconds, device bytes while it runs, host bytes, the share of those seconds spent moving its parked part to
    the device) of one text encoder in its placement."""
    bw = hw.h2d_gbps * GB
    if placement == "cpu":
        return passes * text_forward_s(te, hw, on_cpu=True), 0.0, float(te.nbytes), 0.0
    t_fwd = text_forward_s(te, hw)
    act = _text_act(te)
    if placement == "gpu":
        return passes * t_fwd, te.nbytes + act, 0.0, 0.0
    if placement == "phase":
        return passes * t_fwd + te.nbytes / bw, te.nbytes + act, float(te.nbytes), te.nbytes / bw
    # stream: each layer waits for the longer of its compute and its transfer; non-layer tensors come back once
    layers = te.shape()["layers"]
    layer_bytes = te.layer_params * te.dtype_bytes
    rest = te.nbytes - layers * layer_bytes
    t_layer = t_fwd / layers
    per_fwd = layers * max(t_layer, layer_bytes / bw + math.ceil(layer_bytes / TEXT_STREAM_CHUNK) * hw.dma_startup_us * 1e-6)
    return passes * per_fwd + rest / bw, rest + 2 * layer_bytes + act, float(te.nbytes), rest / bw


def _transformer_host(spec: ModelSpec, placement: str, point: Point) -> float:
    """Host bytes of the transformer(s): none on the GPU, a full copy when moved per phase, the pinned store
    (halved by fp8 storage) plus the non-block tensors when streamed."""
    if placement == "gpu":
        return 0.0
    if placement == "stream":
        return float((spec.non_block_bytes + point.memory.pinned_host) * spec.pipeline.experts)
    return float(spec.nbytes * spec.pipeline.experts)


def _unpark_bytes(spec: ModelSpec, point: Point) -> float:
    """Bytes one expert copies to the device when it takes its turn: non-block tensors and resident chunks."""
    m = point.memory
    return m.non_block_weights + m.resident_block_weights


@dataclass(frozen=True)
class _Transformer:
    """The transformer's candidates, evaluated once for every placement combination."""

    none: Point  # no offload, the guidance passes as is fastest: the reference
    points: list[Point]
    target: float  # the step target of every point (Problem.target)
    nones: tuple[Point, ...]  # no offload in every CFG evaluation the levers allow

    def meets(self, p: Point) -> bool:
        return p.step_time <= self.target


def transformer_candidates(problem: Problem, max_slowdown: float | None, target_step_time: float | None) -> _Transformer:
    return _Transformer(problem.fastest_none(), candidates(problem), problem.target(max_slowdown, target_step_time),
                        tuple(problem.none(b) for b in problem.levers.cfg_batched))


def _pick_stream(cands: _Transformer, room: float) -> Point | None:
    """The plan's rule for a streamed transformer in `room` allocated bytes: the smallest residency that meets the
    step target (then the shortest step), else the fastest that fits."""
    fits = [p for p in cands.points if p.memory.peak <= room]
    if not fits:
        return None
    meet = [p for p in fits if cands.meets(p)]
    if meet:  # the plan's policy order: smallest residency, bf16 before fp8, shortest step, chunk nearest 16 MB
        return best_of(meet)
    return min(fits, key=lambda p: (p.step_time, p.memory.peak, chunk_tie(p)))


TextCosts = dict[tuple[int, str], tuple[float, float, float, float]]


def text_costs(spec: ModelSpec, w: Workload, hw: HardwareSpec) -> TextCosts:
    """(seconds, device bytes, host bytes, seconds moving to the device) of every text encoder in every placement:
    (index, placement) -> cost."""
    return {(i, p): _text_cost(te, p, w.cfg_passes, hw)
            for i, te in enumerate(spec.pipeline.text_encoders) for p in TEXT_PLACEMENTS}


def estimate(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, point: Point,
             costs: TextCosts | None = None) -> PipelineEstimate:
    """Phases, times and memory of one placement with the transformer at `point` (`costs`: text_costs(), to
    evaluate many placements quickly)."""
    pipe = spec.pipeline
    costs = costs if costs is not None else text_costs(spec, w, hw)
    bw = hw.h2d_gbps * GB
    vae_bytes = pipe.vae.nbytes
    t_model = spec.nbytes
    always = 0.0  # bytes on the GPU in every phase
    host: dict[str, float] = {"process": float(hw.process_host_bytes)}
    text = [costs[(i, p)] for i, p in enumerate(pl.text_encoders)]
    for te, p, (_, dev, h, _) in zip(pipe.text_encoders, pl.text_encoders, text):
        host[te.component] = h
        if p == "gpu":
            always += te.nbytes
    if pl.transformer == "gpu":
        always += t_model
    if pl.vae == "gpu":
        always += vae_bytes
    host["transformer"] = _transformer_host(spec, pl.transformer, point)
    host["vae"] = 0.0 if pl.vae == "gpu" else float(vae_bytes)
    host["output"] = output_host_bytes(w)

    # encode: the encoders one after another; those placed `phase` or `stream` stay on the device until the phase
    # ends (a pipeline may call one twice, for the negative prompt), their activations come and go
    enc = Phase()
    held = 0.0
    for te, p, (t, dev, _, move) in zip(pipe.text_encoders, pl.text_encoders, text):
        enc.time_s += t
        enc.detail[te.component] = t - move  # its forwards; a parked one's move to the device on its own
        if move:
            enc.detail[f"{te.component} to device"] = move
        if p in ("phase", "stream"):
            held += dev - _text_act(te)
        if p != "cpu":
            enc.activation_bytes = max(enc.activation_bytes, _text_act(te))
    enc.time_s += hw.encode_host_s
    enc.detail["host"] = hw.encode_host_s
    enc.allocated_bytes = always + held + enc.activation_bytes
    _add_startup(enc, "encode", hw, spec)

    # denoise: the transformer's plan (one expert at a time); parked outside, so it copies its device part back
    den = Phase()
    steps = w.steps
    den.detail["steps"] = steps * point.step_time
    if pl.transformer == "phase":
        den.detail["unpark"] = pipe.experts * t_model / bw
    elif pl.transformer == "stream":
        den.detail["unpark"] = pipe.experts * _unpark_bytes(spec, point) / bw
    den.time_s = sum(den.detail.values())
    den.allocated_bytes = (always - (t_model if pl.transformer == "gpu" else 0.0)) + point.memory.peak
    den.activation_bytes = point.memory.activations
    _add_startup(den, "denoise", hw, spec)

    # decode: the VAE's measured fit
    dec = Phase()
    t_dec, act = decode_cost(spec, w, hw, pl.vae_tiling)
    dec.detail["vae"] = t_dec
    if pl.vae == "phase":
        dec.detail["unpark"] = vae_bytes / bw
    dec.time_s = sum(dec.detail.values())
    dec.allocated_bytes = always + (vae_bytes if pl.vae == "phase" else 0.0) + act
    dec.activation_bytes = act
    _add_startup(dec, "decode", hw, spec)
    phases = {"encode": enc, "denoise": den, "decode": dec}
    if hw.device_is_host:  # the device's peak is host memory too
        host["device"] = max(ph.allocated_bytes for ph in phases.values())
    return PipelineEstimate(pl, point, phases, host, hw)


def startup_of(spec: ModelSpec, phase: str, hw: HardwareSpec) -> float | None:
    """The phase's measured one-time cost in a process's first generation (None where the profile has none); for
    encode, the one measured with this pipeline's text encoders if the profile has it."""
    own = encode_startup_key(spec) if phase == "encode" else None
    if own in hw.startup_s:
        return hw.startup_s[own]
    return hw.startup_s.get(phase)


def _add_startup(phase: Phase, name: str, hw: HardwareSpec, spec: ModelSpec) -> None:
    """Add the phase's one-time cost in a process's first generation (startup_of; 0 where unmeasured)."""
    phase.startup_s = startup_of(spec, name, hw) or 0.0
    phase.time_s += phase.startup_s
    phase.detail["startup"] = phase.startup_s


def _placements(spec: ModelSpec, hw: HardwareSpec) -> list[Placements]:
    pipe = spec.pipeline
    tilings = (False, True) if vae_fit(spec, hw).tiled is not None else (False,)
    out = []
    for tes in itertools.product(TEXT_PLACEMENTS, repeat=len(pipe.text_encoders)):
        for tr in TRANSFORMER_PLACEMENTS:
            for vae in VAE_PLACEMENTS:
                for tiling in tilings:
                    out.append(Placements(tuple(tes), tr, vae, tiling))
    return out


@dataclass(frozen=True, kw_only=True)
class PipelineFacts(Facts):
    """The facts of the whole pipeline: `placement`, the estimate chosen (or, where none is feasible, the one
    nearest the binding limit) and `transformer`, its transformer's point; `host_budget` against the placement's host
    memory; `base_time_s`, the generation with everything on the GPU; the per-step target of a streamed transformer
    (`step_target_s`), whether its point meets it (`step_met`) and its levers."""

    placement: PipelineEstimate
    transformer: Setting
    host_budget: int
    base_time_s: float
    step_target_s: float
    step_met: bool = True
    levers: tuple[Lever, ...] = ()


@dataclass(frozen=True)
class PipelineDecision:
    chosen: PipelineEstimate
    baseline: PipelineEstimate  # everything on the GPU, no offload, no tiling: what the target is relative to
    target_s: float
    gpu_budget: int
    host_budget: int
    reason: str  # the facts in words (explain.py)
    facts: PipelineFacts | None = None


def _room(other_alloc: float, budget: int, hw: HardwareSpec, point: Point) -> float:
    """Allocated bytes the transformer may use in the denoise phase inside `budget` beside `other_alloc` (what the
    phase allocates besides it), with `point`'s activations' allocator slack (the slack of every candidate is about
    the same, its activations barely depend on the offload)."""
    return allocation_within(budget, point.memory.activations, hw) - other_alloc


def generation_target(base: PipelineEstimate, target_time: float | None, generation_slowdown: float | None) -> float:
    """The whole generation's target: `target_time`, else generation_slowdown x everything on the GPU, else none."""
    if target_time is not None:
        return target_time
    return base.generation_time * generation_slowdown if generation_slowdown is not None else math.inf


def _estimates(spec: ModelSpec, w: Workload, hw: HardwareSpec, cands: _Transformer, costs: TextCosts,
               gpu_budget: int) -> tuple[list[PipelineEstimate], dict[Placements, float]]:
    """Every placement estimated: a transformer on the GPU or moved per phase in each CFG evaluation allowed, a
    streamed one by the plan's rule in the room its placement leaves (returned per placement, allocated bytes)."""
    seen: list[PipelineEstimate] = []
    rooms: dict[Placements, float] = {}
    for pl in _placements(spec, hw):
        if pl.transformer in ("gpu", "phase"):  # each CFG evaluation allowed: batched needs more memory
            seen.extend(estimate(spec, w, hw, pl, none, costs) for none in cands.nones)
            continue
        probe = estimate(spec, w, hw, pl, cands.none, costs)
        other = probe.phases["denoise"].allocated_bytes - cands.none.memory.peak
        rooms[pl] = _room(other, gpu_budget, hw, cands.none)
        point = _pick_stream(cands, rooms[pl])
        if point is None:
            point = min(cands.points, key=lambda p: p.memory.peak)
        seen.append(estimate(spec, w, hw, pl, point, costs))
    return seen, rooms


def _fastest(fits: list[PipelineEstimate]) -> PipelineEstimate:
    """The fastest placement, then the smallest; a whole transformer batches CFG only for a real gain."""
    best = min(fits, key=lambda e: (round(e.generation_time, 6), e.gpu_need, e.host_memory))
    if best.transformer.cfg.cfg_batched and best.placements.transformer in ("gpu", "phase"):
        plain = [e for e in fits if e.placements == best.placements and not e.transformer.cfg.cfg_batched]
        if plain and plain[0].generation_time <= best.generation_time * (1 + BATCHING_GAIN):
            return plain[0]  # batching doubles the activations: only for a real gain
    return best


def _stream_levers(best: PipelineEstimate, cands: _Transformer, room: float, problem: Problem) -> tuple[Lever, ...]:
    """The levers of a streamed transformer that meets the step target, against the points that do in its room."""
    feasible = [p for p in cands.points if cands.meets(p) and p.memory.peak <= room]
    return levers_of(best.transformer, feasible, problem.levers, cands.none)


def _facts(e: PipelineEstimate, *, cands: _Transformer, base: PipelineEstimate, target: float, gpu_budget: int,
           host_budget: int, binding: str | None, time_s: float | None = None,
           levers: tuple[Lever, ...] = ()) -> PipelineFacts:
    """The facts of placement `e` against the budgets and targets."""
    return PipelineFacts(
        binding=binding, budget=gpu_budget, need=e.gpu_need, target=Target(seconds=target), time_s=time_s,
        placement=e, transformer=setting(e.transformer, cands.none), host_budget=host_budget,
        base_time_s=base.generation_time, step_target_s=cands.target, step_met=cands.meets(e.transformer),
        levers=levers)


def _shortfall(best: PipelineEstimate | None, fits_gpu: list[PipelineEstimate], seen: list[PipelineEstimate],
               facts_of: Callable[..., PipelineFacts]) -> PipelineFacts:
    """Why no placement is feasible: latency binds where the fastest inside both budgets (`best`) misses the target,
    host memory where some fit the GPU budget (`fits_gpu`) and none the host's, else GPU memory."""
    if best is not None:
        return facts_of(best, binding="latency", time_s=best.generation_time)
    if fits_gpu:
        return facts_of(min(fits_gpu, key=lambda e: e.host_memory), binding="host memory")
    return facts_of(min(seen, key=lambda e: e.gpu_need), binding="memory")


def decide_pipeline(
    spec: ModelSpec,
    w: Workload,
    hw: HardwareSpec,
    problem: Problem,
    gpu_budget: int,
    host_budget: int,
    max_slowdown: float | None = 1.05,
    target_step_time: float | None = None,
    target_time: float | None = None,
    generation_slowdown: float | None = None,
) -> PipelineDecision:
    """The fastest placement that fits the GPU budget (the device bytes checked) in every phase and the host budget,
    and meets the latency target for the whole generation if one is set (`target_time`, or `generation_slowdown` x
    everything on the GPU without offload); the transformer streamed by the plan's rule (the smallest residency
    meeting max_slowdown x no offload per step, else the fastest that fits). Raises Infeasible naming the binding
    constraint; the reason and the error word the facts as explain.py does without a margin."""
    if spec.pipeline is None:
        raise PipelineError(f"{spec.name} has no pipeline in the catalog; plan the transformer alone "
                            "(--transformer-only)")
    cands = transformer_candidates(problem, max_slowdown, target_step_time)
    costs = text_costs(spec, w, hw)
    base = estimate(spec, w, hw, Placements(("gpu",) * len(spec.pipeline.text_encoders), "gpu", "gpu", False),
                    cands.none, costs)
    target = generation_target(base, target_time, generation_slowdown)
    facts_of = partial(_facts, cands=cands, base=base, target=target, gpu_budget=gpu_budget, host_budget=host_budget)
    seen, rooms = _estimates(spec, w, hw, cands, costs, gpu_budget)
    fits_gpu = [e for e in seen if e.gpu_need <= gpu_budget]
    fits = [e for e in fits_gpu if e.host_memory <= host_budget]
    best = _fastest(fits) if fits else None
    if best is None or best.generation_time > target:
        facts = _shortfall(best, fits_gpu, seen, facts_of)
        raise Infeasible(facts, explain.pipeline_infeasible(facts))
    streamed = best.placements.transformer == "stream" and cands.meets(best.transformer)
    facts = facts_of(best, binding=None, time_s=best.generation_time,
                     levers=_stream_levers(best, cands, rooms[best.placements], problem) if streamed else ())
    return PipelineDecision(best, base, target, gpu_budget, host_budget, explain.pipeline_reason(facts), facts)


__all__ = ["PHASES", "Placements", "PipelineEstimate", "PipelineDecision", "decide_pipeline", "estimate",
           "decode_cost", "vae_fit", "output_host_bytes", "PipelineError"]
