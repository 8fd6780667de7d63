"""Step caching planned with the streaming (issue 54): a cache kind, its parameters and its expected hit rate, and
what it saves a generation.

A cache (diffusers' `transformer.enable_cache(...)`) skips work on some steps and reuses what an earlier step
computed; a skipped block needs no weights, so under streaming it saves its copies as well as its FLOPs. What a
skipped step still runs, per kind (`CacheKind.runs_when_skipped`):

- `first-block` (FirstBlockCacheConfig(threshold)): every step runs the first block, compares its residual with the
  last computed step's, and skips the other blocks where they differ by less than the threshold: a skipped step
  costs the first block's forward(s). The decision is known only after the first block, so its hit rate comes from a
  calibration, earlier run reports or the user (`--cache-hit-rate`); the prior is CACHE_PRIOR_HIT_RATE with a wide
  spread.
- `taylorseer-lite` (TaylorSeerCacheConfig(cache_interval, disable_cache_before_step, use_lite_mode=True)): a fixed
  schedule (diffusers' `_measure_should_compute`: steps 0..before-1 computed, then step k where (k - before - 1) %
  interval == 0), the others predicted from the cached output projection: no block runs. Known ahead exactly.
- `taylorseer` (the same without lite mode): only the attention modules are predicted; every block still runs, so
  under streaming a predicted step copies every block as a computed one does. Priced as a computed step (the copies
  are the same; the attention FLOPs it saves are not priced, so where the copies hide the plan is pessimistic) and
  said so.
- `mag` (MagCacheConfig(threshold, max_skip_steps, retention_ratio)): the decision is taken at each step's start
  (the head block's entry) from calibrated magnitude ratios; a skipped step runs no block. The first
  round(retention_ratio x steps) steps always compute and at most `max_skip_steps` skip in a row: the hit rate is
  bounded by that, and given or calibrated below the bound.

The skipped steps' time: the blocks that still run at their place in the plan's step (StepTime.per_block, which
includes each one's exposed copy), so a streamed skipped step pays only what it streams. Formulas here, used by
pipeline/phases.py's denoise phase.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["CACHE_KINDS", "CacheKind", "StepCache", "CacheError", "parse_cache", "computed_steps", "CachedSteps",
           "cached_steps", "CACHE_SCHEMA_VERSION", "CACHE_PRIOR_HIT_RATE"]

CACHE_SCHEMA_VERSION = 1
CACHE_PRIOR_HIT_RATE = (0.35, 0.2)  # first-block's hit rate where nothing measured it: (mean, spread), supposed


class CacheError(ValueError):
    """A cache spec that cannot be planned or run; the message says what and what to do, in one line."""


class CacheKind(BaseModel):
    """One cache kind: diffusers' config class, its parameters in the order `KIND:a,b` gives them (defaults as
    diffusers'), which blocks a skipped step still runs, and whether its schedule is known ahead."""

    model_config = ConfigDict(frozen=True)
    config_class: str
    params: tuple[tuple[str, float], ...]
    runs_when_skipped: Literal["first", "none", "all"]
    schedule_known: bool


CACHE_KINDS: dict[str, CacheKind] = {
    "first-block": CacheKind(config_class="FirstBlockCacheConfig", params=(("threshold", 0.05),),
                             runs_when_skipped="first", schedule_known=False),
    "taylorseer-lite": CacheKind(config_class="TaylorSeerCacheConfig",
                                 params=(("cache_interval", 5), ("disable_cache_before_step", 3)),
                                 runs_when_skipped="none", schedule_known=True),
    "taylorseer": CacheKind(config_class="TaylorSeerCacheConfig",
                            params=(("cache_interval", 5), ("disable_cache_before_step", 3)),
                            runs_when_skipped="all", schedule_known=True),
    "mag": CacheKind(config_class="MagCacheConfig",
                     params=(("threshold", 0.06), ("max_skip_steps", 3), ("retention_ratio", 0.2)),
                     runs_when_skipped="none", schedule_known=False),
}


class StepCache(BaseModel):
    """A cache as planned: its kind, parameters, and the share of steps it is expected to skip (with a spread and
    where the figure comes from). Stored in the plan file (`workload.cache`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # a Workload's field: hashable
    schema_version: int = CACHE_SCHEMA_VERSION
    kind: str
    params: tuple[tuple[str, float], ...] = Field((), description="(name, value) in the kind's order")
    hit_rate: float | None = Field(None, ge=0.0, lt=1.0, description="expected share of steps skipped; None for a "
                                   "schedule known ahead (computed from the parameters and the steps)")
    hit_rate_spread: float = Field(0.0, ge=0.0, le=1.0, description="+- around hit_rate the band takes")
    hit_rate_source: Literal["schedule", "given", "calibrated", "reports", "prior"] = "prior"

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in CACHE_KINDS:
            raise ValueError(f"cache kind {kind!r} is not one chunkflow plans; use {', '.join(CACHE_KINDS)}")
        return kind

    @property
    def spec(self) -> CacheKind:
        return CACHE_KINDS[self.kind]

    def param(self, name: str) -> float:
        return dict(self.params)[name]

    def label(self) -> str:
        """'first-block (threshold 0.1)'."""
        args = ", ".join(f"{k} {v:g}" for k, v in self.params)
        return f"{self.kind} ({args})" if args else self.kind


def _params(kind: str, text: str) -> tuple[tuple[str, float], ...]:
    """`a,b` or `name=a,name=b` after the kind's colon, as numbers, defaults filled in."""
    names = [n for n, _ in CACHE_KINDS[kind].params]
    out = dict(CACHE_KINDS[kind].params)
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        name = name.strip() or (names[i] if i < len(names) else "")
        if name not in out:
            raise CacheError(f"--cache {kind}:{text}: {kind} takes {', '.join(names)} (in that order, or name=value)")
        try:
            out[name] = float(value)
        except ValueError:
            raise CacheError(f"--cache {kind}:{text}: {name} must be a number, got {value.strip()!r}") from None
    return tuple(out.items())


def parse_cache(text: str, hit_rate: float | None = None, source: str = "given") -> StepCache:
    """`KIND[:PARAMS]` (e.g. `first-block:0.1`, `taylorseer:4,2`, `mag:threshold=0.08`) as a StepCache, checked:
    a threshold that cannot fire, an interval of one, a hit rate the kind cannot reach are refused in one line."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower().replace("_", "-")
    if kind not in CACHE_KINDS:
        raise CacheError(f"--cache {text!r}: not a cache chunkflow plans; use one of {', '.join(CACHE_KINDS)} "
                         "(e.g. first-block:0.1, taylorseer:5,3, mag:0.06)")
    pairs = _params(kind, rest)
    params = dict(pairs)
    if "threshold" in params and params["threshold"] <= 0:
        raise CacheError(f"--cache {text}: a threshold of {params['threshold']:g} never fires (no step is ever that "
                         "close to the last computed one): give a positive threshold, e.g. 0.05-0.2")
    if kind.startswith("taylorseer") and params["cache_interval"] < 2:
        raise CacheError(f"--cache {text}: cache_interval {params['cache_interval']:g} computes every step: give 2 or "
                         "more")
    if kind.startswith("taylorseer") and params["disable_cache_before_step"] < 1:
        raise CacheError(f"--cache {text}: disable_cache_before_step {params['disable_cache_before_step']:g} predicts "
                         "before any step was computed (diffusers raises there): give 1 or more")
    if hit_rate is not None and CACHE_KINDS[kind].schedule_known:
        raise CacheError(f"--cache-hit-rate: {kind}'s schedule is fixed by its parameters and the steps; leave "
                         "--cache-hit-rate out")
    if hit_rate is not None and not 0.0 <= hit_rate < 1.0:
        raise CacheError(f"--cache-hit-rate {hit_rate:g}: a share of the steps skipped, from 0 to below 1")
    if CACHE_KINDS[kind].schedule_known:
        return StepCache(kind=kind, params=pairs, hit_rate=None, hit_rate_source="schedule")
    if hit_rate is None:
        mean, spread = CACHE_PRIOR_HIT_RATE
        return StepCache(kind=kind, params=pairs, hit_rate=mean, hit_rate_spread=spread, hit_rate_source="prior")
    return StepCache(kind=kind, params=pairs, hit_rate=hit_rate, hit_rate_source=source)  # type: ignore[arg-type]


def _max_skipped(cache: StepCache, steps: int) -> int:
    """The most steps the kind can skip in `steps` (mag: the retained first steps always compute, and at most
    max_skip_steps skip in a row; first-block: all but the first)."""
    if cache.kind == "mag":
        kept = int(cache.param("retention_ratio") * steps + 0.5)  # as diffusers' MagCacheHeadHook rounds it
        run = int(cache.param("max_skip_steps"))
        free = max(0, steps - kept)
        return free - free // (run + 1)  # runs of `run` skips, each ended by a computed step
    return max(0, steps - 1)


def computed_steps(cache: StepCache | None, steps: int, hit_rate: float | None = None) -> int:
    """How many of `steps` run the whole transformer (`hit_rate`: instead of the cache's own, for a band's edge)."""
    if cache is None or steps <= 0:
        return steps
    if cache.spec.schedule_known:  # taylorseer: steps 0..before-1, then k with (k - before - 1) % interval == 0
        before = int(cache.param("disable_cache_before_step"))
        interval = int(cache.param("cache_interval"))
        return min(steps, before) + max(0, math.ceil((steps - before - 1) / interval))
    rate = cache.hit_rate if hit_rate is None else hit_rate
    skipped = min(_max_skipped(cache, steps), round((rate or 0.0) * steps))
    return steps - skipped


class CachedSteps(BaseModel):
    """One expert's steps under a cache: how many computed and skipped, and their seconds."""

    computed: int
    skipped: int
    computed_s: float
    skipped_s: float

    @property
    def time_s(self) -> float:
        return self.computed_s + self.skipped_s


def skipped_step_s(cache: StepCache, per_block: list[float], passes: int) -> float:
    """A skipped step's seconds: the blocks it still runs (the first under first-block caching, each forward of the
    step), at their time in the plan's step (compute and exposed copy)."""
    if cache.spec.runs_when_skipped == "first" and per_block:
        return per_block[0] * passes
    if cache.spec.runs_when_skipped == "all":
        return sum(per_block) * passes
    return 0.0


def cached_steps(cache: StepCache | None, steps: int, step_s: float, per_block: list[float], passes: int,
                 hit_rate: float | None = None) -> CachedSteps:
    """`steps` at `step_s` each, `cache` skipping some (computed_steps) at skipped_step_s each."""
    c = computed_steps(cache, steps, hit_rate)
    skip = skipped_step_s(cache, per_block, passes) if cache is not None else 0.0
    return CachedSteps(computed=c, skipped=steps - c, computed_s=c * step_s, skipped_s=(steps - c) * skip)
