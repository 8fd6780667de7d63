"""Step caching planned with the streaming (issue 54): a cache (chunkflow_planner/cache.py's CacheSetting, as
`--cache KIND[:PARAMS]` gives it), its expected hit rate, and what it saves a generation.

A cache (diffusers' `transformer.enable_cache(...)`) skips work on some steps and reuses what an earlier step
computed; a skipped block needs no weights, so under streaming it can save its copies as well as its FLOPs. What a
skipped step still runs, per kind (`runs_when_skipped`), and how many steps compute:

- `first-block` (FirstBlockCacheConfig): every step runs the first block, compares its residual with the last computed
  step's, and skips the other blocks where they differ by less than the threshold: a skipped step costs the first
  block's forward(s). Decided only after the first block, so its hit rate is given (`--cache-hit-rate`, from a run's
  report) or the prior CACHE_PRIOR_HIT_RATE with a wide spread.
- `mag` (MagCacheConfig): decided at each step's start (the head block's entry) from the model's magnitude ratios; a
  skipped step runs no block. With the ratios known (`ratios=flux` or a file) the decisions are diffusers' own
  arithmetic on them (`mag_schedule`, its nearest-neighbour stretch to the steps included): known ahead, exactly.
- `taylorseer` with `lite`: a fixed schedule (diffusers' `_measure_should_compute`: steps 0..before-1 computed, then
  step k where (k - before - 1) % interval == 0); the others predict the output projection: no block runs.
  Without `lite` only the attention modules are predicted and every block still runs, so under streaming a predicted
  step copies every block as a computed one does: priced as a computed step (its attention FLOPs saved are not
  priced, so where the copies hide the plan is pessimistic) and said so.
- `sea` (SeaCacheConfig): the repeated blocks replaced by a cached residual while a spectral indicator stays under the
  threshold; decided per step from the data: a hit rate, bounded by the retained first and last steps and the most
  reuses in a row.

The skipped steps' time: the blocks that still run, as the plan's step streams them (StepTime.per_block, each block's
compute and exposed copy; StepTime.first_only, the first block alone with the copies a hit step makes: none where the
first block is kept whole, offload.whole_blocks). Formulas here, used by pipeline/phases.py's denoise phase.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from chunkflow_planner.cache import CacheSetting, CacheSpecError, cache_label, parse_cache

if TYPE_CHECKING:  # steptime imports the catalog, whose Workload holds a StepCache
    from chunkflow_planner.steptime import StepTime

__all__ = ["StepCache", "CacheError", "plan_cache", "does_nothing", "computed_steps", "CachedSteps", "cached_steps", "mag_schedule",
           "runs_when_skipped", "parse_hit_rate", "CACHE_SCHEMA_VERSION", "CACHE_PRIOR_HIT_RATE", "FLUX_MAG_RATIOS"]

CACHE_SCHEMA_VERSION = 1
CACHE_PRIOR_HIT_RATE = (0.35, 0.2)  # a hit-rate cache's rate where nothing measured it: (mean, spread), supposed
# diffusers.hooks.mag_cache.FLUX_MAG_RATIOS (diffusers 0.42.1), here for a planner that never imports torch; a test
# checks them against diffusers'
FLUX_MAG_RATIOS = (1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344,
                   0.98047, 1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047,
                   0.98828, 0.96484, 0.95703, 0.93359, 0.89062)


class CacheError(CacheSpecError):
    """A cache that cannot be planned; the message says what and what to do, in one line."""


class StepCache(BaseModel):
    """A cache as planned: its setting and the share of steps it is expected to skip (with a spread and where the
    figure comes from); the plan file's `workload.cache`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: int = CACHE_SCHEMA_VERSION
    setting: CacheSetting
    hit_rate: float | None = Field(None, ge=0.0, lt=1.0, description="expected share of steps skipped; None for a "
                                   "schedule known ahead (computed from the setting and the steps)")
    hit_rate_spread: float = Field(0.0, ge=0.0, le=1.0, description="+- around hit_rate the band takes")
    hit_rate_source: Literal["schedule", "given", "reports", "prior"] = "prior"

    def __hash__(self) -> int:  # a Workload's field: hashable although a setting may hold a list of ratios
        return hash(self.model_dump_json())

    @property
    def kind(self) -> str:
        return self.setting.kind

    def label(self) -> str:
        return cache_label(self.setting)


def runs_when_skipped(setting: CacheSetting) -> Literal["first", "none", "all"]:
    """Which blocks a skipped step still runs (module docstring)."""
    if setting.kind == "first-block":
        return "first"
    if setting.kind == "taylorseer" and not setting.lite:
        return "all"
    return "none"


def schedule_known(setting: CacheSetting) -> bool:
    """Whether the cache's decisions follow from its setting and the steps alone (taylorseer; mag with its ratios),
    never from the data: the same on every rank of a sequence-parallel run, whatever share of the tokens it holds."""
    return setting.kind == "taylorseer" or (setting.kind == "mag" and setting.ratios is not None)


def parallel_problem(setting: CacheSetting) -> str | None:
    """Why this cache cannot run under sequence parallelism, in one sentence; None where it can: a schedule known
    ahead, or first-block caching, whose measure the ranks sum together (chunkflow/cache_ranks.py). Another cache
    that decides from the data (sea) decides from each rank's share of the tokens (mag:calibrate measures its ratios
    from it): the ranks could decide differently, then skip different steps or wait on each other's collectives."""
    if schedule_known(setting) or setting.kind == "first-block":
        return None
    verb = "measures its ratios from" if getattr(setting, "calibrate", False) else "decides from"
    return (f"{cache_label(setting)} {verb} the data, and under sequence parallelism each process holds a "
            "share of the tokens, so the processes could decide differently; use a cache whose schedule is known "
            "ahead (mag:ratios=..., taylorseer:...) or first-block (its measure is summed over the processes), or "
            "run it in one process")


def _refuse(setting: CacheSetting, text: str) -> None:
    """A setting that skips nothing, or that diffusers fails on, as one line."""
    threshold = getattr(setting, "threshold", None)
    if threshold is not None and threshold <= 0:
        raise CacheError(f"--cache {text}: a threshold of {threshold:g} never fires (no step is ever that close to "
                         "the last computed one): give a positive threshold")
    if setting.kind == "taylorseer" and setting.cache_interval < 2:
        raise CacheError(f"--cache {text}: cache_interval {setting.cache_interval} computes every step: give 2 or more")
    if setting.kind == "taylorseer" and setting.disable_cache_before_step < 1:
        raise CacheError(f"--cache {text}: disable_cache_before_step 0 predicts before any step was computed (diffusers "
                         "raises there): give 1 or more")
    if setting.kind == "mag" and setting.calibrate:
        raise CacheError(f"--cache {text}: calibrating MagCache skips nothing (it measures the ratios): plan without "
                         "--cache, or with ratios=FILE of what the calibration printed")


_SPREAD_SIGNS = ("+-", "±", "+/-")


def parse_hit_rate(text: str) -> tuple[float, float] | None:
    """`--cache-hit-rate` as a number: `0.35` or `0.35+-0.1` (also `±`, `+/-`) as (rate, spread); None where the
    text is no number (a report's path). A number out of range is left to plan_cache, which says so."""
    rate, spread = text.strip(), "0"
    for sign in _SPREAD_SIGNS:
        if sign in rate:
            rate, spread = rate.split(sign, 1)
            break
    try:
        value = float(rate)
    except ValueError:
        return None
    try:
        return value, float(spread)
    except ValueError:
        raise CacheError(f"--cache-hit-rate {text!r}: a rate and its spread are two numbers, as 0.35+-0.1") from None


def plan_cache(text: str, hit_rate: float | None = None, source: str = "given", steps: int | None = None,
               spread: float = 0.0) -> StepCache:
    """`--cache KIND[:PARAMS]` (cache.parse_cache) with `--cache-hit-rate` and its spread, checked for planning
    (`steps`: refused where it can skip none of them)."""
    setting = parse_cache(text)
    _refuse(setting, text)
    why = does_nothing(setting, steps) if steps is not None else None
    if why:
        raise CacheError(f"--cache {text}: {why}, so it would change nothing; plan without --cache, or with more steps")
    if hit_rate is not None and schedule_known(setting):
        raise CacheError(f"--cache-hit-rate: {setting.kind}'s schedule is known ahead from its setting and the steps; "
                         "leave --cache-hit-rate out")
    if hit_rate is not None and not 0.0 <= hit_rate < 1.0:
        raise CacheError(f"--cache-hit-rate {hit_rate:g}: a share of the steps skipped, from 0 to below 1")
    if not 0.0 <= spread <= 1.0:  # nan fails both
        raise CacheError(f"--cache-hit-rate: the spread {spread:g} is a share of the steps, from 0 to 1")
    if schedule_known(setting):
        return StepCache(setting=setting, hit_rate=None, hit_rate_source="schedule")
    if hit_rate is None:
        mean, spread = CACHE_PRIOR_HIT_RATE
        return StepCache(setting=setting, hit_rate=mean, hit_rate_spread=spread, hit_rate_source="prior")
    return StepCache(setting=setting, hit_rate=hit_rate, hit_rate_spread=spread,  # type: ignore[arg-type]
                     hit_rate_source=source)


def _stretch(ratios: list[float] | tuple[float, ...], steps: int) -> list[float]:
    """diffusers' nearest_interp: the ratios stretched to `steps` by rounding (src - 1) / (steps - 1) x i."""
    if len(ratios) == steps:
        return list(ratios)
    if steps == 1:
        return [ratios[-1]]
    scale = (len(ratios) - 1) / (steps - 1)
    return [ratios[round(i * scale)] for i in range(steps)]  # torch.round and round() both round half to even


def mag_schedule(setting: CacheSetting, steps: int) -> list[bool]:
    """Each step computed (True) or skipped, as diffusers' MagCacheHeadHook decides from the ratios."""
    ratios = _stretch(FLUX_MAG_RATIOS if setting.ratios == "flux" else setting.ratios, steps)
    retention = int(setting.retention_ratio * steps + 0.5)
    acc_ratio, acc_steps, acc_err, out = 1.0, 0, 0.0, []
    for i in range(steps):
        compute = True
        if i >= retention:
            acc_ratio *= ratios[i] if i < len(ratios) else 1.0
            acc_steps += 1
            acc_err += abs(1.0 - acc_ratio)
            if out and acc_err <= setting.threshold and acc_steps <= setting.max_skip_steps:
                compute = False
            else:
                acc_ratio, acc_steps, acc_err = 1.0, 0, 0.0
        out.append(compute)
    return out


def _max_skipped(setting: CacheSetting, steps: int) -> int:
    """The most steps a hit-rate kind can skip in `steps`."""
    if setting.kind == "sea":
        free = max(0, steps - setting.retention_steps - setting.cache_end_steps)
        run = setting.max_consecutive_cached
        return free - free // (run + 1) if run else free
    return max(0, steps - 1)  # first-block: every step after the first may hit


def computed_steps(cache: StepCache | None, steps: int, hit_rate: float | None = None) -> int:
    """How many of `steps` run the whole transformer (`hit_rate`: instead of the cache's own, for a band's edge)."""
    if cache is None or steps <= 0:
        return steps
    s = cache.setting
    if s.kind == "taylorseer":  # steps 0..before-1, then k with (k - before - 1) % interval == 0
        before, interval = s.disable_cache_before_step, s.cache_interval
        return min(steps, before) + max(0, math.ceil((steps - before - 1) / interval))
    if s.kind == "mag" and s.ratios is not None:
        return sum(mag_schedule(s, steps))
    rate = cache.hit_rate if hit_rate is None else hit_rate
    return steps - min(_max_skipped(s, steps), round((rate or 0.0) * steps))


def does_nothing(setting: CacheSetting, steps: int) -> str | None:
    """Why `setting` can skip no step of `steps` (a distilled few-step schedule, a schedule that computes every
    step), as words; None where it can skip some."""
    known = schedule_known(setting)
    cache = StepCache(setting=setting, hit_rate=None if known else 0.99, hit_rate_source="schedule" if known else
                      "given")
    if computed_steps(cache, steps) < steps:
        return None
    if setting.kind == "taylorseer":
        return (f"with {steps} steps taylorseer computes every one (its first {setting.disable_cache_before_step} "
                f"always, then one in {setting.cache_interval})")
    if setting.kind == "mag" and setting.ratios is not None:
        return f"with {steps} steps MagCache's decisions on these ratios skip no step (threshold {setting.threshold:g})"
    return f"with {steps} step{'s' if steps != 1 else ''} {setting.kind} has no step to skip"


class CachedSteps(BaseModel):
    """One expert's steps under a cache: how many computed and skipped, and their seconds."""

    computed: int
    skipped: int
    computed_s: float
    skipped_s: float

    @property
    def time_s(self) -> float:
        return self.computed_s + self.skipped_s


def skipped_step_s(cache: StepCache, time: StepTime, passes: int) -> float:
    """A skipped step's seconds, each forward of the step: the blocks it still runs (runs_when_skipped) as the plan's
    step `time` streams them: the first block alone (StepTime.first_only: with a first block that streams, its own
    copy again and the second's), or every block (per_block, compute and exposed copy)."""
    runs = runs_when_skipped(cache.setting)
    if runs == "first" and time.per_block:
        return time.first_only * passes
    if runs == "all":
        return sum(time.per_block) * passes
    return 0.0


def cached_steps(cache: StepCache | None, steps: int, step_s: float, time: StepTime, passes: int,
                 hit_rate: float | None = None) -> CachedSteps:
    """`steps` at `step_s` each, `cache` skipping some (computed_steps) at skipped_step_s each (`time`: the step's
    StepTime, per forward)."""
    c = computed_steps(cache, steps, hit_rate)
    skip = skipped_step_s(cache, time, passes) if cache is not None else 0.0
    return CachedSteps(computed=c, skipped=steps - c, computed_s=c * step_s, skipped_s=(steps - c) * skip)