"""Words for the policy's facts: the plan's reason and the Infeasible messages for the transformer (policy.StepFacts),
as `chunkflow plan` and the plan say them; the whole pipeline's (pipeline.PipelineFacts) are pipeline/explain.py's,
in the same words.

The facts carry one budget, the GPU bytes the policy checked; where the user's --mem-budget keeps a margin for the
memory model's error (`MarginKept`), the messages name the budget through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkflow_planner.units import format_bytes, format_seconds, format_seconds_apart

if TYPE_CHECKING:
    from chunkflow_planner.policy import Lever, Point, Setting, StepFacts, Target


@dataclass(frozen=True)
class MarginKept:
    """The user's GPU budget (`given` bytes) and the share of it a plan keeps free for the memory model's error: the
    budget the policy checks is given / (1 + margin). Messages name the budget through it."""

    given: int
    margin: float

    @property
    def usable(self) -> int:
        return int(self.given / (1 + self.margin))

    @property
    def _kept(self) -> str:
        return f"the {self.margin:.1%} kept for the memory model's error"

    def needed(self, need: float) -> str:
        """The budget a need takes with the margin, rounded up to the figure shown (two decimals of its unit)."""
        unit = next((u for u in (1e12, 1e9, 1e6, 1e3) if need * (1 + self.margin) >= u), 1.0)
        step = unit / 100 if unit > 1 else 1.0
        n = math.ceil(need * (1 + self.margin) / step - 1e-9) * step
        return f" With the margin, a --mem-budget of at least {format_bytes(n)} is needed (--mem-margin 0 plans to the byte)."


def budget_said(shown: str, kept: MarginKept | None, *, stated: bool = False, more: bool = False) -> str:
    """How a message names the budget it checked (`shown`, the usable bytes as the message formats them): as is
    without a margin; with one, `stated` (after "the budget is") as the user's budget with the usable part, else the
    usable part with the user's budget (`more`: the sentence goes on, so a comma closes the aside)."""
    if kept is None:
        return shown
    if stated:
        return f"{format_bytes(kept.given)} ({shown} after {kept._kept})"
    return f"{shown}, {format_bytes(kept.given)} less {kept._kept}" + ("," if more else "")


def target_said(target: Target, against: float | None = None) -> str:
    """The step target, with the slowdown over no offload it was set at; with the digits that tell it from
    `against` (a step time the sentence compares with it) where plain rounding would not."""
    shown = format_seconds(target.seconds) if against is None else format_seconds_apart(target.seconds, against)[0]
    return shown + (f" ({target.slowdown:.2f}x no offload)" if target.slowdown else "")


# ----------------------------------------------------------------------------------------------- levers

UNLOCKS = {
    "weight_dtype": " Lossy fp8 weight storage would make it feasible (--weight-dtype auto --allow-fp8).",
    "cfg_batching": " Batched CFG would make it feasible (--cfg-batching auto).",
}


def _cfg_said(lever: Lever, chosen: Setting) -> str:
    """Why the guidance passes run batched or not."""
    other = lever.other
    if lever.asked:
        return "batched CFG as asked"
    if lever.on:
        return "batched CFG (each block streamed once a step for both guidance passes): " + (
            "unbatched meets no target in this budget" if other is None
            else f"unbatched would need residency {other.cfg.residency:.0%}"
            if other.cfg.residency > chosen.cfg.residency
            else f"{other.step_s / chosen.step_s:.2f}x the step time unbatched")
    return "unbatched CFG: " + ("no batched plan meets the target in this budget" if other is None else
                                "batching would not lower residency or shorten the step by "
                                f"{lever.gain:.0%}, and it doubles the activations")


def _dtype_said(lever: Lever) -> str:
    """Why the streamed weights are stored in fp8 or bf16."""
    if lever.asked:
        return "fp8 weight storage as asked"
    if lever.on:
        return "fp8 weight storage (allowed, lossy): " + (
            "bf16 meets no target in this budget" if lever.other is None
            else f"bf16 would need residency {lever.other.cfg.residency:.0%}")
    return "bf16 weights: fp8 storage would not lower residency, so the exact weights are kept"


def _codec_said(lever: Lever, chosen: Setting) -> str:
    """Why the streamed bytes travel encoded or raw."""
    other = lever.other
    if lever.asked:
        return "streamed bytes losslessly encoded as asked (--codec on)"
    if lever.on:
        return "streamed bytes losslessly encoded (fewer bytes on the link and in host memory, decoded on the GPU): " + (
            "raw meets no target in this budget" if other is None
            else f"raw would need residency {other.cfg.residency:.0%}" if other.cfg.residency > chosen.cfg.residency
            else f"{other.step_s / chosen.step_s:.2f}x the step time raw" if other.step_s > chosen.step_s
            else f"raw would take {other.step_s / chosen.step_s:.2f}x the step time, but its host store does not fit "
                 "the host budget")
    return "streamed bytes raw: " + (
        "the codec meets no target in this budget" if other is None
        else f"encoded would need residency {other.cfg.residency:.0%}" if other.cfg.residency > chosen.cfg.residency
        else "the codec would not shorten the step (the copies hide, or its decode costs more than the bytes it saves)")


_LEVER_SAID = {"cfg_batching": _cfg_said, "weight_dtype": lambda lv, chosen: _dtype_said(lv), "codec": _codec_said}


def levers_said(levers: tuple[Lever, ...], chosen: Setting) -> str:
    """The levers of the chosen point, each as "; why"."""
    return "".join(f"; {_LEVER_SAID[lv.name](lv, chosen)}" for lv in levers)


# ------------------------------------------------------------------------------------- the transformer alone


def step_reason(f: StepFacts, kept: MarginKept | None = None) -> str:
    """The plan's reason for the transformer's point."""
    c = f.chosen
    if c.cfg.mode == "none":
        return (f"the model fits without offload (needs {format_bytes(f.need)} of "
                f"{budget_said(format_bytes(f.budget), kept)}): "
                f"offload would only cost time (layerwise {f.layerwise_slowdown:.2f}x)"
                + ("; the guidance passes run as one batched forward" if c.cfg.cfg_batched else "")
                + ("; fp8 storage is not used: nothing is offloaded" if f.fp8_unused else ""))
    if c.cfg.residency == 0:
        why = (f"full offload already meets the target ({c.slowdown:.3f}x no offload, target {target_said(f.target)}); "
               + (f"every chunk size hides, so {format_bytes(c.cfg.chunk_bytes)} (the paper's operating point)"
                  if f.chunk_ties > 1 else f"{format_bytes(c.cfg.chunk_bytes)} chunks give the shortest step"))
    else:
        why = (f"the smallest residency that meets {target_said(f.target)} inside "
               f"{budget_said(format_bytes(f.budget), kept)}: {c.cfg.residency:.0%} resident, {c.slowdown:.3f}x no offload")
    return why + levers_said(f.levers, c)


def step_infeasible(f: StepFacts, kept: MarginKept | None = None) -> str:
    """Why no transformer point fits the budget (binding "memory") or meets the target in it ("latency")."""
    hint = "".join(UNLOCKS[name] for name in f.unlocks)
    if f.binding == "memory":
        return (f"memory is the binding constraint: even full offload needs {format_bytes(f.need)} "
                f"(peak allocation, allocator slack and CUDA context) and the budget is "
                f"{budget_said(format_bytes(f.budget), kept, stated=True)}. Raise --mem-budget, or "
                "shrink the workload (fewer frames, smaller batch or resolution) or raise --sp." + hint
                + (kept.needed(f.need) if kept else ""))
    c = f.chosen
    return (f"latency is the binding constraint: the fastest plan inside "
            f"{budget_said(format_bytes(f.budget), kept, more=True)} takes "
            f"{format_seconds_apart(c.step_s, f.target.seconds)[0]} per step "
            f"(residency {c.cfg.residency:.0%}, {format_bytes(c.cfg.chunk_bytes)} chunks), "
            f"above the target {target_said(f.target, c.step_s)}. The smallest memory any plan needs is {format_bytes(f.need)}. "
            "Raise --mem-budget or relax --max-slowdown / --target-step-time." + hint)


# ------------------------------------------------------------------------------------------------ the disk tier


def disk_said(p: Point, rate: float | None) -> str:
    """The disk tier of a streamed transformer's point in words (empty without one): what it reads, at what rate,
    whether the reads hide behind the step, and the disk rate that would hide them."""
    if not p.cfg.disk_blocks:
        return ""
    where = ("on disk" if not p.memory.codec_spill else
             f"on disk, encoded at the load into a {format_bytes(p.memory.codec_spill)} spill file")
    said = (f"; {p.cfg.disk_blocks} blocks keep their streamed bytes {where} (the host budget holds the rest): "
            f"{format_bytes(p.memory.disk_read)} read each forward at {rate:.2f} GB/s")
    stall = p.time.disk_stall
    if stall <= 0:
        return said + ", hidden behind the compute"
    busy = p.time.total - stall  # the step without waiting: the reads take busy + stall, so hiding them needs
    return said + (f", {format_seconds(stall)} a step exposed (a disk of {rate * (busy + stall) / busy:.2f} GB/s "
                   "would hide it)")


def codec_said(p: Point, ratio: float, measured: bool) -> str:
    """The codec of a streamed transformer's point in words (empty without one): its ratio and the bytes it saves."""
    if p.cfg.codec == "none":
        return ""
    return (f"; codec {p.cfg.codec} at ratio {ratio:.2f} ({'measured' if measured else 'supposed'}): "
            f"{format_bytes(p.memory.codec_saved)} fewer bytes each forward on the link and in the host store")


def host_budget_said(budget: int, margin: float) -> str:
    """The host budget a message names: the user's, and what the plan keeps of it for the host model's error."""
    if margin <= 0:
        return format_bytes(budget)
    return (f"{format_bytes(budget)} ({format_bytes(int(budget / (1 + margin)))} after the {margin:.1%} kept for "
            "the host model's error)")


def host_infeasible(need: float, budget: int, margin: float, disk_blocks: int, n_blocks: int,
                    no_disk: str | None) -> str:
    """Why the transformer alone does not fit the host budget: what it needs, and what the disk tier did or would
    do (`no_disk`: why it was not used, e.g. no disk rate known)."""
    where = (f" even with {disk_blocks} of {n_blocks} blocks' streamed bytes on disk (what remains is the process "
             "and the blocks' resident heads and ring)" if disk_blocks else "")
    return (f"host memory is the binding constraint: the transformer's pinned store and the process need "
            f"{format_bytes(need)}{where} and --host-mem-budget is {host_budget_said(budget, margin)}. "
            "Use a machine with more RAM, or raise --mem-budget so more stays on the GPU"
            + (f"; {no_disk}" if no_disk else "") + ".")
