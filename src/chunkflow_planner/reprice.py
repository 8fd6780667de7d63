"""A plan's predictions priced again on another hardware profile with everything the plan decided held (its chunk
size, residency, disk blocks, codec; the pipeline's placements: pipeline/assemble.repriced_whole), what the bands of
bands.py are made from: the point's prediction, the values a plan carries bands for, the transformer alone priced
again, and the figures the planner supposes written into a profile."""

from __future__ import annotations

from dataclasses import replace

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, VaeDecodeFit
from chunkflow_planner.memory import host_need
from chunkflow_planner.plan import Plan, Prediction
from chunkflow_planner.policy import Point, Problem
from chunkflow_planner.tiers import codec_ratio


def point_prediction(p: Point, hw: HardwareSpec | None = None, passes: int = 1) -> Prediction:
    """A point's prediction; with a disk tier, its reads a step (`passes` forwards unless CFG is batched); with a
    codec, its ratio (measured or supposed), decode rate, the bytes it saves a step and in host memory, and its spill
    file's size (the disk tier's tails encoded)."""
    disk = {}
    forwards = 1 if p.cfg.cfg_batched else passes
    if p.cfg.disk_blocks and hw is not None:
        disk = dict(disk_read_bytes_per_step=int(p.memory.disk_read * forwards),
                    disk_read_gbps=hw.disk_read_gbps, disk_stall_s=p.time.disk_stall)
    if p.cfg.codec != "none" and hw is not None:
        ratio, measured = codec_ratio(hw)
        disk.update(codec_ratio=ratio, codec_ratio_measured=measured, codec_decode_gbps=hw.codec_decode_gbps,
                    codec_saved_bytes_per_step=int(p.memory.codec_saved_link * forwards),
                    codec_saved_host_bytes=int(p.memory.codec_saved), codec_staging_bytes=int(p.memory.codec_staging),
                    codec_spill_bytes=int(p.memory.codec_spill))
    return Prediction(step_time_s=p.step_time, peak_memory_bytes=p.memory.peak,
                      pinned_host_bytes=int(p.memory.pinned_host), **disk)


def prediction_values(plan: Plan) -> dict[str, float]:
    """The predictions a plan carries bands for, by their path in its `prediction` section (None and 0 left out)."""
    p = plan.prediction
    out: dict[str, float | None] = {"step_time_s": p.step_time_s, "peak_memory_bytes": p.peak_memory_bytes,
                                    "pinned_host_bytes": p.pinned_host_bytes, "generation_time_s": p.generation_time_s,
                                    "host_memory_bytes": p.host_memory_bytes}
    if p.phases is not None:
        startup = 0.0
        for name in ("encode", "denoise", "decode"):
            ph = getattr(p.phases, name)
            out[f"phases.{name}.time_s"] = ph.time_s
            out[f"phases.{name}.peak_memory_bytes"] = ph.peak_memory_bytes
            if ph.startup_s > 0:  # a later generation of the process: what a run after --warmup compares
                out[f"phases.{name}.warm_time_s"] = ph.time_s - ph.startup_s
                startup += ph.startup_s
        if startup > 0 and p.generation_time_s is not None:
            out["generation_warm_time_s"] = p.generation_time_s - startup
    if p.load is not None:
        out.update({"load.time_cold_s": p.load.time_cold_s, "load.time_warm_s": p.load.time_warm_s,
                    "load.host_peak_bytes": p.load.host_peak_bytes,
                    "load.host_peak_per_host_bytes": p.load.host_peak_per_host_bytes})
    return {k: float(v) for k, v in out.items() if v}


def repriced_alone(plan: Plan, problem: Problem, chosen: Point, hw: HardwareSpec, host_alone: bool = False) -> Plan:
    """A transformer-only `plan` (made for `problem` with the transformer at `chosen`) with its predictions priced on
    `hw` instead, its setting held. `host_alone`: held to a host budget (its host memory is the transformer's)."""
    point = replace(problem, hw=hw).evaluate(chosen.cfg)
    pred = plan.prediction.model_copy(update=point_prediction(point, hw, problem.workload.cfg_passes).model_dump())
    if host_alone:
        pred = pred.model_copy(update={"host_memory_bytes": int(host_need(point.memory, hw))})
    return plan.model_copy(update={"prediction": pred})


def with_supposed(hw: HardwareSpec, spec: ModelSpec) -> HardwareSpec:
    """`hw` with the figures the planner supposes where the profile has none written in: the catalog's decode fit of
    the model's VAE (pipeline/decode.vae_fit) and the supposed codec ratio (codec.codec_ratio). It prices the same;
    its fits can then be moved, at their priors, where the profile's own figures are absent."""
    update = {}
    pipe = spec.pipeline
    if pipe is not None and pipe.vae.name not in hw.pipeline.vae_decode and pipe.vae.decode is not None:
        update["vae_decode"] = {**hw.pipeline.vae_decode, pipe.vae.name: VaeDecodeFit(**pipe.vae.decode)}
    if hw.codec_ratio is None:
        update["codec_ratio"] = codec_ratio(hw)[0]
    return hw.model_copy(update=update) if update else hw
