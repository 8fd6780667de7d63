"""A plan checked whole against the catalog model it names, before anything is loaded: a plan file is JSON a user
may edit (or be handed), and every field `run` acts on must describe a run that can happen.

The plan's description of the model (block count and bytes, the pipeline's components) must be the catalog's; its
workload's token count must follow from its resolution and frames; its offload setting must fit the model (no
more disk blocks than blocks, chunks no smaller than a run can stream); its steps, batch and tokens stay within
the bounds `chunkflow plan` takes (workload.MAX_STEPS, MAX_BATCH, MAX_TOKENS); the transformer it describes must
fit the budget it was planned for. Each check returns what is wrong ("field: why; what to do") or None;
`chunkflow_planner.plan.check_plan` raises it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import ValidationError

from chunkflow_planner.catalog import HardwareSpec, ModelSpec
from chunkflow_planner.memory import block_volumes, estimate_memory
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.units import format_bytes
from chunkflow_planner.workload import MAX_BATCH, MAX_STEPS, MAX_TOKENS, tokens

if TYPE_CHECKING:
    from chunkflow_planner.plan import Plan

# Chunks a block is cut into: the planner's smallest chunk (4 MB) cuts the largest catalog block (703 MB, Wan 14B)
# into 168; a copy pays a fixed DMA start-up (~3 us) and the runtime's bookkeeping, so thousands a block make a
# forward crawl. 4096 leaves 24 times the planner's count (16 KB chunks on a 64 MB block, 4 KB on the tiny models).
MAX_CHUNKS_PER_BLOCK = 4096



def _replan(flags: str = "") -> str:
    return f"re-plan with `chunkflow plan{' ' + flags if flags else ''}`"


def plan_problem(plan: Plan, spec: ModelSpec) -> str | None:
    """The first thing wrong with `plan` for the catalog model `spec` (its name resolved), or None."""
    for check in (_model, _workload, _offload, _pipeline, _hardware, _memory):
        problem = check(plan, spec)
        if problem is not None:
            return problem
    return None


def _model(plan: Plan, spec: ModelSpec) -> str | None:
    for field in ("n_blocks", "block_bytes_total", "non_block_bytes"):
        have, want = getattr(plan.model, field), getattr(spec, field)
        if have != want:
            return (f"model.{field} is {have}, but {spec.name} in this chunkflow's catalog has {want} (the plan was "
                    f"edited, or written by another chunkflow); {_replan('--model ' + spec.name)}")
    return None


def _workload(plan: Plan, spec: ModelSpec) -> str | None:
    w = plan.workload
    if w.steps > MAX_STEPS:
        return f"workload.steps is {w.steps}, more than {MAX_STEPS} (pipelines use 4-100); {_replan('--steps N')}"
    if w.batch > MAX_BATCH:
        return f"workload.batch is {w.batch}, more than {MAX_BATCH}; {_replan('--batch N')}"
    derived = tokens(spec, w.to_workload())
    if w.tokens != derived:
        return (f"workload.tokens is {w.tokens}, but {w.width}x{w.height}" + (f" x{w.frames}" if spec.is_video else "")
                + f" is {derived} tokens for {spec.name} (the plan was edited); {_replan()}")
    if derived > MAX_TOKENS:
        return (f"workload {w.width}x{w.height}" + (f" x{w.frames}" if spec.is_video else "") + f" is {derived} "
                f"tokens a sample, more than {MAX_TOKENS}, beyond any real generation; {_replan()} at a smaller size")
    return None


def offload_problem(cfg: OffloadConfig, spec: ModelSpec, field: str = "offload") -> str | None:
    """What is wrong with running `spec` under `cfg` (`field` names where the setting came from: the plan's
    "offload" section or a flag such as "--chunk-size"), or None."""
    if cfg.disk_blocks > spec.n_blocks:
        return (f"{field}.disk_blocks is {cfg.disk_blocks}, but {spec.name} has {spec.n_blocks} blocks; {_replan()} "
                "(it picks the disk blocks)")
    past = [i for i in cfg.whole_blocks if i >= spec.n_blocks]
    if past:
        return (f"{field}.whole_blocks names block {past[0]}, but {spec.name} has {spec.n_blocks} blocks "
                f"(0-{spec.n_blocks - 1}); {_replan()}")
    if cfg.chunk_bytes is not None:
        largest = max(block_volumes(spec))
        chunks = math.ceil(largest / cfg.chunk_bytes)
        if chunks > MAX_CHUNKS_PER_BLOCK:
            name = f"{field}.chunk_bytes" if not field.startswith("-") else field
            least = math.ceil(largest / MAX_CHUNKS_PER_BLOCK)
            return (f"{name} {cfg.chunk_bytes} cuts {spec.name}'s largest block ({format_bytes(largest)}) into "
                    f"{chunks} chunks, more than {MAX_CHUNKS_PER_BLOCK}: the run would crawl. Give at least "
                    f"{least} bytes (the planner picks 4MB-256MB)")
    return None


def _offload(plan: Plan, spec: ModelSpec) -> str | None:
    return offload_problem(plan.offload, spec)


def _pipeline(plan: Plan, spec: ModelSpec) -> str | None:
    if plan.pipeline is None:
        return None
    pipe = spec.pipeline
    if pipe is None:
        return f"pipeline: {spec.name} has no pipeline in the catalog, yet the plan places one; {_replan()}"
    want = {te.component: ("text_encoder", te.nbytes) for te in pipe.text_encoders}
    want.update({("transformer" if k == 0 else f"transformer_{k + 1}"): ("transformer", spec.nbytes)
                 for k in range(pipe.experts)})
    want[pipe.vae.component] = ("vae", pipe.vae.nbytes)
    have = [c.name for c in plan.pipeline.components]
    if sorted(have) != sorted(want):
        return (f"pipeline.components are {', '.join(map(repr, have))}, but {spec.name}'s pipeline has "
                f"{', '.join(map(repr, sorted(want)))}; {_replan()}")
    for c in plan.pipeline.components:
        kind, nbytes = want[c.name]
        if (c.kind, c.bytes) != (kind, nbytes):
            return (f"pipeline component {c.name!r} is a {c.kind} of {c.bytes} bytes, but {spec.name}'s is a {kind} "
                    f"of {nbytes} bytes (the plan was edited, or written by another chunkflow); {_replan()}")
    return None


def _hardware(plan: Plan, spec: ModelSpec) -> str | None:
    if not plan.hardware.spec:
        return None
    try:
        HardwareSpec(**plan.hardware.spec)
    except (ValidationError, TypeError) as exc:
        from chunkflow_planner.versioned import field_errors

        detail = field_errors(exc) if isinstance(exc, ValidationError) else str(exc)
        return f"hardware.spec (the profile planned with) is malformed: {detail}; {_replan()} or run with --profile"
    return None


def pricing_problem(cfg: OffloadConfig, hw: HardwareSpec, where: str = "hardware.spec (the profile planned with)",
                    fix: str = "") -> str | None:
    """What the profile `hw` lacks to price running under `cfg` (a codec's decode rate, a disk tier's read rate), or
    None: a run measures against that price once it has run, so a plan that cannot be priced is refused before."""
    from chunkflow_planner.tiers import CODEC_RATE_REMEDY, DISK_RATE_REMEDY, codec_known, disk_known

    fix = fix or _replan()
    if cfg.codec != "none" and not codec_known(hw):
        return (f"offload.codec is {cfg.codec!r}, but {where} has no codec_decode_gbps to price its decode (the plan "
                f"was edited, or the profile lost it); {fix}, or {CODEC_RATE_REMEDY}")
    if cfg.disk_blocks and not disk_known(hw):
        return (f"offload.disk_blocks is {cfg.disk_blocks}, but {where} has no disk_read_gbps to price the reads; "
                f"{fix}, or {DISK_RATE_REMEDY}")
    return None


def _memory(plan: Plan, spec: ModelSpec) -> str | None:
    budget = plan.memory_budget_bytes or plan.hardware.memory_bytes
    if not budget:
        return None
    need = estimate_memory(spec, plan.workload.to_workload(), plan.offload, plan.parallel.sp_degree).peak
    if need > budget:
        return (f"its transformer needs {format_bytes(need)} of device memory for this workload and offload setting, "
                f"more than the plan's budget of {format_bytes(budget)}: a plan never holds that (edited, or "
                f"written by another chunkflow); {_replan()}")
    return None
