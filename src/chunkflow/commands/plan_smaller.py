"""An infeasible plan of a folder's model: the workload it assumed (the folder's defaults or the flags) said in the
error, and the nearest smaller one that fits the same budgets (fewer frames first, then a smaller size), found by
planning a few smaller workloads (each checked by make_workload, so only sizes the model takes are tried)."""

from __future__ import annotations

from typing import Callable

from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.policy import Infeasible
from chunkflow_planner.workload import Workload, WorkloadError, make_workload

MAX_TRIES = 30  # plans tried at most (a failing one is a fraction of a second)


def workload_words(spec, w: Workload) -> str:
    """`161 frames at 704x480, 50 steps` (`1024x1024, 28 steps` for an image model)."""
    size = f"{w.width}x{w.height}"
    frames = f"{w.frames} frame{'' if w.frames == 1 else 's'} at {size}"
    return (frames if spec.is_video else size) + f", {w.steps} steps"


def _flags(spec, w: Workload) -> str:
    return (f"--frames {w.frames} " if spec.is_video else "") + f"--height {w.height} --width {w.width}"


def _taken(spec, w: Workload, frames: int, height: int, width: int) -> Workload | None:
    try:
        return make_workload(spec, batch=w.batch, frames=frames if spec.is_video else None, height=height,
                             width=width, steps=w.steps)
    except (WorkloadError, ValueError):
        return None


def _frame_counts(spec, w: Workload, height: int, width: int) -> list[int]:
    """The frame counts tried: halved each time, each snapped down to one the model takes (LTX: 8k+1)."""
    if not spec.is_video:
        return [w.frames]
    out, target = [w.frames], w.frames
    while target > 1:
        target = max(1, target // 2)
        snapped = next((f for f in range(target, 0, -1) if _taken(spec, w, f, height, width) is not None), None)
        if snapped is not None and snapped not in out:
            out.append(snapped)
    return out


def _smaller(spec, w: Workload) -> list[Workload]:
    """Smaller workloads the model takes, the largest output first (frames x height x width): frame counts halved
    and sizes halved, combined; at most MAX_TRIES."""
    sizes = [(w.height, w.width)]
    while sizes[-1][0] >= 64 and sizes[-1][1] >= 64:
        sizes.append((sizes[-1][0] // 2, sizes[-1][1] // 2))
    cands = []
    for h, wd in sizes:
        for f in _frame_counts(spec, w, h, wd):
            cand = _taken(spec, w, f, h, wd) if (f, h, wd) != (w.frames, w.height, w.width) else None
            if cand is not None:
                cands.append(cand)
    cands.sort(key=lambda c: -(c.frames * c.height * c.width))
    return cands[:MAX_TRIES]


def explain_infeasible(spec, w: Workload, exc: Infeasible, plan_at: Callable[[Workload], object]) -> Infeasible:
    """`exc` with the workload it planned and the nearest smaller one that fits (or that none tried does)."""
    fits = None
    for cand in _smaller(spec, w):
        try:
            plan_at(cand)
        except ChunkflowError:  # infeasible too, or a size this model's plan refuses: the next
            continue
        fits = cand
        break
    said = f"{exc} (planned for {workload_words(spec, w)}"
    if fits is not None:
        said += f"; {workload_words(spec, fits)} fits these budgets: {_flags(spec, fits)})"
    else:
        said += "; no smaller size or fewer frames tried fits these budgets either)"
    return Infeasible(exc.facts, said)
