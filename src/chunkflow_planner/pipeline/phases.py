"""One placement's phases: encode (the text encoders), denoise (the transformer's plan), decode (the VAE), each
with its time, its peak allocation and its measured one-time start-up (PipelineProfile.startup_s: the times are
those of a process's first generation, a later one is faster by the start-up), and the host memory of the
placement: every host copy (pinned stores of streamed and parked components, CPU components) plus what the process
holds besides weights (`process_host_bytes`). Times come from the operator model for text encoders (text.py), the
transformer's step model (steptime.py) for denoising and the VAE's decode fit (decode.py) for decoding.
"""

from __future__ import annotations

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload, encode_startup_key
from chunkflow_planner.offload import DISK_RING_BLOCKS, disk_block_indices
from chunkflow_planner.pipeline.decode import decode_cost, decode_slack, output_host_bytes
from chunkflow_planner.pipeline.experts import expert_names, expert_steps
from chunkflow_planner.pipeline.hostshare import shared_host_bytes
from chunkflow_planner.pipeline.placement import ON_DISK, ExpertRun, Phase, PipelineEstimate, Placements
from chunkflow_planner.stepcache import cached_steps
from chunkflow_planner.tiers import read_s
from chunkflow_planner.workload import per_forward
from chunkflow_planner.pipeline.text import TextCosts, text_act_bytes, text_costs
from chunkflow_planner.policy import Point


def _transformer_host(spec: ModelSpec, placement: str, point: Point) -> float:
    """Host bytes of one expert (or the transformer): none on the GPU, a full copy when moved per phase, the pinned
    store (halved by fp8 storage; a disk tier's ring for its disk blocks' tails) plus the non-block tensors when
    streamed, the pinned store alone on disk (its non-block tensors are read from the files at its turn)."""
    if placement == "gpu":
        return 0.0
    if placement == "stream":
        return float(spec.non_block_bytes + point.memory.pinned_host)
    if placement == ON_DISK:
        return float(point.memory.pinned_host)
    return float(spec.nbytes)


def expert_runs(spec: ModelSpec, w: Workload, pl: Placements, point: Point,
                disk_point: Point | None = None) -> tuple[ExpertRun, ...]:
    """Each expert's placement, point and steps (experts.expert_steps): `point`, or `disk_point` (the same setting
    with every block on disk) for one placed on disk beside a streamed one."""
    if pl.mixed and disk_point is None:
        raise ValueError("experts placed differently need the disk expert's point (disk_point)")
    places = pl.of_experts(spec.pipeline.experts)
    return tuple(ExpertRun(name, p, disk_point if pl.mixed and p == ON_DISK else point, steps)
                 for name, p, steps in zip(expert_names(spec.pipeline.experts), places,
                                           expert_steps(spec.pipeline, w.steps)))


def _unpark_s(spec: ModelSpec, placement: str, point: Point, hw: HardwareSpec) -> float:
    """Seconds one expert takes to reach the device when it takes its turn: its non-block tensors (from pinned host
    memory, or from the files on disk) and its resident chunks (pinned host memory)."""
    m = point.memory
    return (read_s(m.non_block_weights, "disk" if placement == ON_DISK else "host", hw)
            + read_s(m.resident_block_weights, "host", hw))


def estimate(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, point: Point,
             costs: TextCosts | None = None, disk_point: Point | None = None, *, ranks: int = 1,
             share_host: bool = True) -> PipelineEstimate:
    """Phases, times and memory of one placement with the transformer at `point` (`costs`: text_costs(), to
    evaluate many placements quickly; `disk_point`: an expert's on disk beside a streamed one, expert_runs); under
    Ulysses SP of degree `ranks` (the point's step and memory are one rank's) each rank runs every phase and the host
    memory is the host's, the shareable bytes once where `share_host` (hostshare.py)."""
    pipe = spec.pipeline
    runs = expert_runs(spec, w, pl, point, disk_point)
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
    always += t_model * sum(r.placement == "gpu" for r in runs)  # every expert on the GPU is there in every phase
    if pl.vae == "gpu":
        always += vae_bytes
    host["transformer"] = sum(_transformer_host(spec, r.placement, r.point) for r in runs)
    host["vae"] = 0.0 if pl.vae in ("gpu", ON_DISK) else float(vae_bytes)
    host["output"] = output_host_bytes(w)

    enc = _encode(spec, hw, pl, text, always)
    den = _denoise(spec, w, hw, pl, runs, always)
    dec = _decode(spec, w, hw, pl, always)
    phases = {"encode": enc, "denoise": den, "decode": dec}
    if hw.pipeline.device_is_host:  # the device's peak is host memory too
        host["device"] = max(ph.allocated_bytes for ph in phases.values())
    return PipelineEstimate(pl, point, phases, host, hw, _disk_reads(spec, w, pl, runs), runs, ranks, share_host,
                            shared_host_bytes(spec, pl, runs, hw))


def _disk_reads(spec: ModelSpec, w: Workload, pl: Placements, runs: tuple[ExpertRun, ...]) -> dict[str, float]:
    """Bytes each component reads from the checkpoint's files a generation: a text encoder on disk its layers at
    each forward and its other tensors once; the VAE on disk once; an expert's disk blocks' tails at each of its own
    forwards, plus the reader's read-ahead of DISK_RING_BLOCKS tails at the end of its turn (for a forward that
    does not come: measured on an H200, docs/data/h200-disk: 4 x 19 + 2 tails read in a 2-step generation), plus,
    on disk, its non-block tensors at its turn; an expert that runs no step reads nothing."""
    out: dict[str, float] = {}
    for te, p in zip(spec.pipeline.text_encoders, pl.text_encoders):
        if p == ON_DISK:
            layers = te.layer_params * te.dtype_bytes * te.shape()["layers"]
            out[te.component] = w.cfg_passes * layers + (te.nbytes - layers)
    for r in runs:
        k = r.point.cfg.disk_blocks
        if k and r.placement in ("stream", ON_DISK) and r.steps:
            reads = r.point.memory.disk_read * (r.forwards(w.cfg_passes) + min(DISK_RING_BLOCKS, k) / k)
            out[r.name] = reads + (r.point.memory.non_block_weights if r.placement == ON_DISK else 0.0)
    if pl.vae == ON_DISK:
        out[spec.pipeline.vae.component] = float(spec.pipeline.vae.nbytes)
    return out


def _encode(spec: ModelSpec, hw: HardwareSpec, pl: Placements, text: list, always: float) -> Phase:
    """The encode phase: the encoders one after another; those placed `phase` or `stream` stay on the device until
    the phase ends (a pipeline may call one twice, for the negative prompt), their activations come and go."""
    enc = Phase()
    held = 0.0
    for te, p, (t, dev, _, move) in zip(spec.pipeline.text_encoders, pl.text_encoders, text):
        enc.time_s += t
        enc.detail[te.component] = t - move  # its forwards; a parked one's move to the device on its own
        if move:
            enc.detail[f"{te.component} {'from disk' if p == ON_DISK else 'to device'}"] = move
        if p in ("phase", "stream", ON_DISK):
            held += dev - text_act_bytes(te)
        if p != "cpu":
            enc.activation_bytes = max(enc.activation_bytes, text_act_bytes(te))
    enc.time_s += hw.pipeline.encode_host_s
    enc.detail["host"] = hw.pipeline.encode_host_s
    enc.allocated_bytes = always + held + enc.activation_bytes
    _add_startup(enc, "encode", hw, spec)
    return enc


def _denoise(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, runs: tuple[ExpertRun, ...],
             always: float) -> Phase:
    """The denoise phase: each expert's steps at its point, one expert at a time, each brought to the device at its
    turn (an expert that runs no step takes none); parked outside, so it copies its device part back. Under a step
    cache (w.cache) the steps it skips cost what they still run (stepcache.cached_steps)."""
    den = Phase()
    turns = [r for r in runs if r.steps]
    steps = [cached_steps(w.cache, r.steps, r.point.step_time, r.point.time,
                          per_forward(w, r.point.cfg.cfg_batched)[1]) for r in runs]
    den.detail["steps"] = sum(s.computed_s for s in steps)
    if w.cache is not None:
        den.detail["cached steps"] = sum(s.skipped_s for s in steps)
    unpark = sum(read_s(spec.nbytes, "host", hw) if r.placement == "phase" else _unpark_s(spec, r.placement,
                                                                                          r.point, hw)
                 for r in turns if r.placement != "gpu")
    if any(r.placement != "gpu" for r in runs):
        den.detail["unpark"] = unpark
    den.time_s = sum(den.detail.values())
    den.allocated_bytes = ((always - (spec.nbytes if pl.transformer == "gpu" else 0.0))
                           + max(r.point.memory.peak for r in runs))
    den.activation_bytes = max(r.point.memory.activations for r in runs)
    _add_startup(den, "denoise", hw, spec)
    first = sum(_disk_first_read(r.point, hw) for r in turns)
    if first > 0:  # a start-up of the first generation: later ones find the read-ahead of the one before
        den.detail["disk first read"] = first
        den.startup_s += first
        den.time_s += first
    return den


def _disk_first_read(point: Point, hw: HardwareSpec) -> float:
    """Seconds a process's first forward of a transformer with disk blocks waits for its first disk block: nothing
    is read ahead yet (runtime/disk.py restarts its reader at that block), so its tail's read is exposed but for
    the blocks computed before it. Later forwards, and later generations, find it read ahead."""
    k = point.cfg.disk_blocks
    if not k:
        return 0.0
    n = len(point.time.per_block)
    first = disk_block_indices(n, k)[0]
    tail = point.memory.disk_read / k  # the disk blocks' mean tail (alike blocks: their tail)
    return max(0.0, read_s(tail, "disk", hw) - sum(point.time.per_block[:first]))


def _decode(spec: ModelSpec, w: Workload, hw: HardwareSpec, pl: Placements, always: float) -> Phase:
    """The decode phase: the VAE's measured fit, after its move to the device if it is placed per phase (from pinned
    host memory) or on disk (read from the files)."""
    dec = Phase()
    vae_bytes = spec.pipeline.vae.nbytes
    t_dec, act = decode_cost(spec, w, hw, pl.vae_tiling)
    dec.detail["vae"] = t_dec
    if pl.vae == "phase":
        dec.detail["unpark"] = read_s(vae_bytes, "host", hw)
    elif pl.vae == ON_DISK:
        dec.detail["from disk"] = read_s(vae_bytes, "disk", hw)
    dec.time_s = sum(dec.detail.values())
    dec.allocated_bytes = always + (vae_bytes if pl.vae in ("phase", ON_DISK) else 0.0) + act
    dec.activation_bytes = act
    dec.alloc_slack = decode_slack(spec, hw, pl.vae_tiling)
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
