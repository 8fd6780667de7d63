"""Words for the whole pipeline's facts (pipeline.decide.PipelineFacts): the plan's reason for a placement and the
Infeasible messages, in the words of the transformer's (chunkflow_planner.explain)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from chunkflow_planner.explain import MarginKept, budget_said, codec_said, host_budget_said, levers_said
from chunkflow_planner.explain import disk_said as core_disk_said
from chunkflow_planner.pipeline.hostinfo import UNCHECKED_HOST_BUDGET
from chunkflow_planner.tiers import DISK_RATE_REMEDY, codec_ratio
from chunkflow_planner.units import format_bytes, format_seconds, format_seconds_apart

if TYPE_CHECKING:
    from chunkflow_planner.pipeline.decide import PipelineFacts
    from chunkflow_planner.pipeline.placement import PipelineEstimate


RELIEF = {
    "decode": "decode fewer frames or a smaller size (the VAE's activations scale with the output)",
    "encode": "the text encoder cannot be made smaller than one streamed layer",
    "denoise": "shrink the workload (fewer frames, smaller batch or resolution) or raise --sp",
}


def placement_said(e: PipelineEstimate) -> str:
    """Where each component runs, the transformer by its offload where streamed."""
    pl = e.placements
    word = (lambda where: "device" if where == "gpu" else where) if e.hw.pipeline.device_is_host else (lambda w: w)
    tr = word(pl.transformer) if pl.transformer != "stream" else e.transformer.cfg.label
    if pl.mixed:  # each expert's own, with its share of the steps
        tr = ", ".join(f"{r.name} {r.point.cfg.label if r.placement == 'stream' else word(r.placement)} "
                       f"({r.steps} steps)" for r in e.experts)
    else:
        tr = f"transformer {tr}"
    return (f"text encoder {'/'.join(map(word, pl.text_encoders))}, {tr}, "
            f"VAE {word(pl.vae)}{' tiled' if pl.vae_tiling else ''}")


def experts_said(e: PipelineEstimate) -> str:
    """Why the experts are placed apart (empty where they are not): the one on disk runs fewer steps."""
    if not e.placements.mixed:
        return ""
    disk = [r for r in e.experts if r.placement == "disk"]
    return "".join(f"; {r.name} runs {r.steps} of {sum(x.steps for x in e.experts)} steps and reads every block "
                   f"from the checkpoint's files at each of its forwards ({format_bytes(e.disk_bytes.get(r.name, 0))} "
                   "a generation), the other expert streams from pinned host memory (what is read less often goes "
                   "to disk first)" for r in disk)


def disk_said(e: PipelineEstimate) -> str:
    """The codec and the disk tier of a streamed transformer in words (empty without them): explain.codec_said,
    explain.disk_said."""
    return codec_said(e.transformer, *codec_ratio(e.hw)) + core_disk_said(e.transformer, e.hw.disk_read_gbps)


def pipeline_reason(f: PipelineFacts) -> str:
    """The plan's reason for the placement chosen, and for its transformer's point."""
    e, t = f.placement, f.transformer
    slow = f.time_s / f.base_time_s
    goal = f", target {format_seconds(f.target.seconds)}" if math.isfinite(f.target.seconds) else ""
    versus = f", {slow:.3f}x everything on the GPU" if not e.hw.pipeline.device_is_host and slow >= 0.995 else ""
    why = (f"the fastest placement inside the budgets: {placement_said(e)}; {format_seconds(f.time_s)} "
           f"per generation{versus}{goal}; its peak is the {e.binding_phase} phase")
    if f.disk_passed is not None:
        q = f.disk_passed
        why = (f"the placement inside the budgets that reads the least from disk among those near the fastest: "
               f"{placement_said(e)}; {format_seconds(f.time_s)} per generation{versus}{goal}, reading "
               f"{format_bytes(e.disk_read)} from disk a generation; its peak is the {e.binding_phase} phase; "
               f"{placement_said(q)} would take {format_seconds(q.generation_time)} "
               f"({q.generation_time / f.time_s - 1:+.1%}) but reads {format_bytes(q.disk_read)} from disk (what is "
               "read once a generation goes to disk before what is read every step: a disk's rate varies more "
               "than the host link's)")
    why += experts_said(e)
    if e.placements.transformer == "stream" and not f.step_met:
        target, step = format_seconds_apart(f.step_target_s, t.step_s)
        return why + (f"; no streamed setting inside the budget meets the step target "
                      f"{target} (--max-slowdown x no offload): the fastest that "
                      f"fits takes {step} a step, {t.slowdown:.3f}x no offload" + disk_said(e))
    if e.placements.transformer == "stream":
        return why + levers_said(f.levers, t) + disk_said(e)
    if t.cfg.cfg_batched:
        return why + "; the guidance passes run as one batched forward (faster at this size)"
    return why


def host_split_said(e: PipelineEstimate) -> str:
    """Under SP, the host's memory in words (hostshare.py, eq. H1): "X per host: S shared once + n x R per rank"."""
    split = e.host_split
    shared = f"{format_bytes(split.shared)} shared once + " if split.shared else ""
    return f"{format_bytes(split.per_host)} per host: {shared}{split.ranks} x {format_bytes(split.per_rank)} per rank"


def _share_remedy(e: PipelineEstimate) -> str:
    """Under SP without sharing, what sharing the host's copies would save (hostshare.py)."""
    shareable = sum(e.shared_bytes.values())
    if e.ranks <= 1 or e.share_host or shareable <= 0:
        return ""
    return (f", or leave out --no-share-host: the host's {e.ranks} ranks would share one copy of "
            f"{format_bytes(shareable)}, {format_bytes((e.ranks - 1) * shareable)} less")


def pipeline_infeasible(f: PipelineFacts, kept: MarginKept | None = None,
                        host_kept: tuple[int, float] | None = None) -> str:
    """Why no placement meets the target ("latency"), fits the host budget ("host memory") or the GPU's ("memory");
    `host_kept`: the user's host budget and the margin kept of it (f.host_budget is what is left)."""
    e = f.placement
    gpu = budget_said(format_bytes(f.budget), kept, more=True)
    if f.binding == "latency":
        took, target = format_seconds_apart(f.time_s, f.target.seconds)
        host = ("no host budget" if f.host_budget >= UNCHECKED_HOST_BUDGET
                else f"{format_bytes(f.host_budget)} of host memory")
        return (f"latency is the binding constraint: the fastest generation inside {gpu} of {e.hw_word} memory and "
                f"{host} takes {took} ({placement_said(e)}), "
                f"above the target {target}{disk_said(e)}. Raise --mem-budget, or relax "
                "--max-slowdown / --target-time" + (
                    f", or use a faster disk: {format_bytes(e.disk_read)} read from disk a generation, a disk of "
                    f"{f.disk_meets_gbps:.2f} GB/s would meet the target" if f.disk_meets_gbps is not None else
                    ", or use a faster disk" if e.disk_read > 0 else "") + ".")
    if f.binding == "host memory":
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in e.host_bytes.items() if v > 0)
        if e.ranks > 1:
            parts = f"{host_split_said(e)}; a rank holds {parts}"
        return (f"host memory is the binding constraint: the placement needing the least host memory inside "
                f"{gpu} of {e.hw_word} memory ({placement_said(e)}) needs {format_bytes(e.host_memory)} ({parts}) and "
                f"--host-mem-budget is "
                f"{host_budget_said(*host_kept) if host_kept else format_bytes(f.host_budget)}. "
                + ("Use a machine with more RAM: on the CPU the device's memory is host memory too."
                   if e.hw.pipeline.device_is_host else
                   "Use a machine with more RAM, or raise --mem-budget so more stays on the GPU")
                + _share_remedy(e) + _disk_remedy(e, f))
    phase = e.binding_phase
    return (f"{e.hw_word} memory is the binding constraint: even the smallest placement ({placement_said(e)}) needs "
            f"{format_bytes(f.need)} in its {phase} phase and --mem-budget is "
            f"{budget_said(format_bytes(f.budget), kept, stated=True)}. Raise --mem-budget, or {RELIEF[phase]}."
            + (kept.needed(f.need) if kept else ""))


def _disk_remedy(e: PipelineEstimate, f: PipelineFacts) -> str:
    """What the disk tier could still do where host memory binds: with no disk rate known, what would go to disk at
    a supposed rate (and how to give the real one)."""
    if e.hw.pipeline.device_is_host:
        return ""
    if e.hw.disk_read_gbps is None:
        would = f.disk_would
        if would is None:
            return f", or use the disk tier: {DISK_RATE_REMEDY}."
        on_disk = [k for k, v in would.disk_bytes.items() if v > 0]
        blocks = would.transformer.cfg.disk_blocks
        placed = {r.name: r.placement for r in would.experts}
        what = ", ".join(k if placed.get(k, "disk") == "disk" else f"{blocks} {k} blocks" for k in on_disk)
        return (f". With the disk tier it would fit: at a disk of {would.hw.disk_read_gbps:.2f} GB/s (supposed) "
                f"{what} on disk, {format_bytes(would.disk_read)} read a generation, "
                f"{format_seconds(would.generation_time)} per generation, {format_bytes(would.host_memory)} of host "
                f"memory ({placement_said(would)}); {DISK_RATE_REMEDY}.")
    if e.transformer.cfg.disk_blocks:
        return (f" (already with {e.transformer.cfg.disk_blocks} blocks' streamed bytes on disk: what remains is the "
                "process, the other components and the blocks' resident heads).")
    return "."
