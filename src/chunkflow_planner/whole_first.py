"""Residency under first-block caching (issue 54): the block every step runs kept whole on the device.

A first-block cache (stepcache.py, diffusers' FirstBlockCacheConfig) runs the first block on every step and, on a hit,
skips the others (the tail block too: its hook returns the cached output). With the first block streamed, a hit step
still copies it (again, for the next step) and the second block, which its forward prefetches; kept whole
(offload.whole_blocks), a hit step copies nothing (StepTime.first_only). The twin of a chosen point keeps block 0
whole and keeps the largest residency of the others that fits the same budget, at each chunk size the policy tries;
the fastest is taken where the cached generation (stepcache.cached_steps) is faster and its step meets the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from chunkflow_planner.policy import CHUNK_CANDIDATES, Point, Problem
from chunkflow_planner.stepcache import cached_steps, runs_when_skipped
from chunkflow_planner.workload import per_forward

BISECTIONS = 24  # residency steps of 2^-24: finer than any chunk of a block


def cached_time_s(problem: Problem, p: Point) -> float:
    """The denoising steps' seconds at point `p` under the workload's cache (its hit rate)."""
    w = problem.workload
    passes = per_forward(w, p.cfg.cfg_batched)[1]
    return cached_steps(w.cache, w.steps, p.step_time, p.time, passes).time_s


def wants_whole_first(problem: Problem, p: Point) -> bool:
    """Whether `p` could keep its first block whole: a cache that runs only the first block on a hit, a chunkflow
    point that streams some of block 0 and keeps no block whole yet."""
    cache = problem.workload.cache
    return (cache is not None and runs_when_skipped(cache.setting) == "first" and p.cfg.mode == "chunkflow"
            and not p.cfg.whole_blocks and p.cfg.residency < 1.0 and problem.spec.n_blocks > 1)


def whole_first(problem: Problem, p: Point, fits: Callable[[Point], bool], target_s: float = math.inf) -> Point:
    """`p`, or its fastest twin with block 0 whole (module docstring): at each chunk size the policy tries, the
    largest residency for the other blocks that `fits` (the caller's budget), taken where its step meets `target_s`
    and the cached generation is faster than `p`'s."""
    if not wants_whole_first(problem, p):
        return p
    best, best_s = p, cached_time_s(problem, p)
    for chunk in CHUNK_CANDIDATES:
        q = _largest_fitting(problem, p, chunk, fits)
        if q is None or q.step_time > target_s:
            continue
        q_s = cached_time_s(problem, q)
        if q_s < best_s:
            best, best_s = q, q_s
    return best


def _largest_fitting(problem: Problem, p: Point, chunk: int, fits: Callable[[Point], bool]) -> Point | None:
    """`p` with chunks of `chunk`, block 0 whole and the largest residency of the others that fits; None where block 0
    whole does not fit at all."""
    def twin(r: float) -> Point:
        return problem.evaluate(p.cfg.with_overrides(chunk_size=chunk, residency=r, whole_blocks=(0,)))

    if not fits(twin(0.0)):
        return None
    low, high = 0.0, 1.0
    for _ in range(BISECTIONS):  # the memory grows with r: the largest r that still fits
        mid = (low + high) / 2
        if fits(twin(mid)):
            low = mid
        else:
            high = mid
    return twin(low)


def whole_said(p: Point) -> str:
    """The plan's words for a point that keeps its first block whole ('' for one that does not)."""
    if 0 not in p.cfg.whole_blocks:
        return ""
    return ("; the first block is kept whole on the GPU (the others at residency "
            f"{p.cfg.residency:.3g}): a first-block cache runs it every step, so a step it skips copies nothing")
