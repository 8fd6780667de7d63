"""One placement's phases: encode (the text encoders), denoise (the transformer's plan), decode (the VAE), each
with its time, its peak allocation and its measured one-time start-up (PipelineProfile.startup_s: the times are
those of a process's first generation, a later one is faster by the start-up), and the host memory of the
placement: every host copy (pinned stores of streamed and parked components, CPU components) plus what the process
holds besides weights (`process_host_bytes`). Times come from the operator model for text encoders (text.py), the
transformer's step model (steptime.py) for denoising and the VAE's decode fit (decode.py) for decoding.
"""

from __future__ import annotations

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload, encode_startup_key
from chunkflow_planner.overlap import GB
from chunkflow_planner.pipeline.decode import decode_cost, output_host_bytes
from chunkflow_planner.pipeline.placement import Phase, PipelineEstimate, Placements
from chunkflow_planner.pipeline.text import TextCosts, text_act_bytes, text_costs
from chunkflow_planner.policy import Point


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


def estimate(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, point: Point,
             costs: TextCosts | None = None) -> PipelineEstimate:
    """Phases, times and memory of one placement with the transformer at `point` (`costs`: text_costs(), to
    evaluate many placements quickly)."""
    pipe = spec.pipeline
    costs = costs if costs is not None else text_costs(spec, w, hw)
    vae_bytes = pipe.vae.nbytes
    t_model = spec.nbytes
    always = 0.0  # bytes on the GPU in every phase
    host: dict[str, float] = {"process": float(hw.pipeline.process_host_bytes)}
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

    enc = _encode(spec, hw, pl, text, always)
    den = _denoise(spec, w, hw, pl, point, always)
    dec = _decode(spec, w, hw, pl, always)
    phases = {"encode": enc, "denoise": den, "decode": dec}
    if hw.pipeline.device_is_host:  # the device's peak is host memory too
        host["device"] = max(ph.allocated_bytes for ph in phases.values())
    return PipelineEstimate(pl, point, phases, host, hw)


def _encode(spec: ModelSpec, hw: HardwareSpec, pl: Placements, text: list, always: float) -> Phase:
    """The encode phase: the encoders one after another; those placed `phase` or `stream` stay on the device until
    the phase ends (a pipeline may call one twice, for the negative prompt), their activations come and go."""
    enc = Phase()
    held = 0.0
    for te, p, (t, dev, _, move) in zip(spec.pipeline.text_encoders, pl.text_encoders, text):
        enc.time_s += t
        enc.detail[te.component] = t - move  # its forwards; a parked one's move to the device on its own
        if move:
            enc.detail[f"{te.component} to device"] = move
        if p in ("phase", "stream"):
            held += dev - text_act_bytes(te)
        if p != "cpu":
            enc.activation_bytes = max(enc.activation_bytes, text_act_bytes(te))
    enc.time_s += hw.pipeline.encode_host_s
    enc.detail["host"] = hw.pipeline.encode_host_s
    enc.allocated_bytes = always + held + enc.activation_bytes
    _add_startup(enc, "encode", hw, spec)
    return enc


def _denoise(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, point: Point, always: float) -> Phase:
    """The denoise phase: the transformer's plan (one expert at a time); parked outside, so it copies its device
    part back."""
    den = Phase()
    bw = hw.h2d_gbps * GB
    den.detail["steps"] = w.steps * point.step_time
    if pl.transformer == "phase":
        den.detail["unpark"] = spec.pipeline.experts * spec.nbytes / bw
    elif pl.transformer == "stream":
        den.detail["unpark"] = spec.pipeline.experts * _unpark_bytes(spec, point) / bw
    den.time_s = sum(den.detail.values())
    den.allocated_bytes = (always - (spec.nbytes if pl.transformer == "gpu" else 0.0)) + point.memory.peak
    den.activation_bytes = point.memory.activations
    _add_startup(den, "denoise", hw, spec)
    return den


def _decode(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, always: float) -> Phase:
    """The decode phase: the VAE's measured fit, after its move to the device if it is placed per phase."""
    dec = Phase()
    vae_bytes = spec.pipeline.vae.nbytes
    t_dec, act = decode_cost(spec, w, hw, pl.vae_tiling)
    dec.detail["vae"] = t_dec
    if pl.vae == "phase":
        dec.detail["unpark"] = vae_bytes / (hw.h2d_gbps * GB)
    dec.time_s = sum(dec.detail.values())
    dec.allocated_bytes = always + (vae_bytes if pl.vae == "phase" else 0.0) + act
    dec.activation_bytes = act
    _add_startup(dec, "decode", hw, spec)
    return dec


def startup_of(spec: ModelSpec, phase: str, hw: HardwareSpec) -> float | None:
    """The phase's measured one-time cost in a process's first generation (None where the profile has none); for
    encode, the one measured with this pipeline's text encoders if the profile has it."""
    own = encode_startup_key(spec) if phase == "encode" else None
    if own in hw.pipeline.startup_s:
        return hw.pipeline.startup_s[own]
    return hw.pipeline.startup_s.get(phase)


def _add_startup(phase: Phase, name: str, hw: HardwareSpec, spec: ModelSpec) -> None:
    """Add the phase's one-time cost in a process's first generation (startup_of; 0 where unmeasured)."""
    phase.startup_s = startup_of(spec, name, hw) or 0.0
    phase.time_s += phase.startup_s
    phase.detail["startup"] = phase.startup_s
