"""Step caching planned (issue 54, the planner's part): `plan --cache KIND[:PARAMS] [--cache-hit-rate R]` prices the
steps a cache computes and skips; the computed-step count of a schedule known ahead is diffusers' own (counted on a
tiny pipeline running diffusers' cache), a hit-rate cache's is bounded as diffusers bounds it, the denoise phase and
the generation shrink by what the skipped steps no longer run, and what cannot be planned is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chunkflow_planner.stepcache import CACHE_KINDS, CacheError, computed_steps, parse_cache
from pipelines import call_kwargs, one_thread, tiny_pipeline


def _computed_forwards(config, steps: int) -> int:
    """How many of `steps` ran the tiny FLUX pipeline's first block's feed-forward with diffusers' cache `config`
    (a predicted or skipped step does not run it)."""
    pipe = tiny_pipeline("flux", torch.bfloat16)
    t = pipe.transformer
    t.enable_cache(config)
    calls = []
    ff = t.transformer_blocks[0].ff
    ff.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad(), one_thread():
        pipe(**call_kwargs("flux", num_inference_steps=steps))
    return len(calls)


@pytest.mark.parametrize("interval,before,steps", [(3, 2, 10), (4, 1, 9), (5, 3, 28), (2, 1, 7)])
def test_a_fixed_schedule_computes_the_steps_diffusers_computes(interval, before, steps):
    from diffusers import TaylorSeerCacheConfig

    cache = parse_cache(f"taylorseer-lite:{interval},{before}")
    ran = _computed_forwards(TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=before,
                                                   use_lite_mode=True), steps)
    assert 0 < ran < steps and computed_steps(cache, steps) == ran


def test_mag_cache_never_skips_more_than_its_bound():
    """With every step's magnitude ratio 1 (nothing changes) diffusers' MagCache skips all it may: the retained
    first steps compute, then runs of max_skip_steps skips each ended by a computed step; the plan at a hit rate of
    (nearly) 1 computes exactly that many."""
    from diffusers import MagCacheConfig

    steps, cache = 12, parse_cache("mag:threshold=0.5,max_skip_steps=2,retention_ratio=0.25", hit_rate=0.99)
    ran = _computed_forwards(MagCacheConfig(threshold=0.5, max_skip_steps=2, retention_ratio=0.25,
                                            num_inference_steps=steps, mag_ratios=[1.0] * steps), steps)
    assert computed_steps(cache, steps) == ran < steps


def _plan(cli, *extra) -> dict:
    result = cli("plan", "--model", "flux", "--hardware", "h100-sxm", "--mem-budget", "6GB", "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_plan_prices_what_the_skipped_steps_still_run(cli):
    """first-block: a skipped step runs the first block, so the steps cost computed x step + skipped x that block;
    the denoise phase and the generation shrink by the difference; the hit rate's spread gives the range; the plan
    file keeps the cache (schema 6) and reads back."""
    plain = _plan(cli)
    cached = _plan(cli, "--cache", "first-block:0.1", "--cache-hit-rate", "0.4", "--out", "p.json")
    c, steps = cached["prediction"]["cache"], cached["workload"]["steps"]
    assert cached["workload"]["cache"]["kind"] == "first-block" and cached["schema_version"] == 6
    assert c["computed_steps"] == steps - round(0.4 * steps) and c["skipped_steps"] == round(0.4 * steps)
    step = cached["prediction"]["step_time_s"]
    assert c["uncached_steps_s"] == pytest.approx(steps * step)
    assert c["computed_steps"] * step < c["steps_s"] < c["uncached_steps_s"]  # the skipped steps cost something
    den, den0 = cached["prediction"]["phases"]["denoise"], plain["prediction"]["phases"]["denoise"]
    assert den["parts_s"]["cached steps"] > 0
    saved = plain["prediction"]["generation_time_s"] - cached["prediction"]["generation_time_s"]
    assert saved == pytest.approx(den0["time_s"] - den["time_s"]) and saved > 0
    from chunkflow_planner.plan import load_plan

    assert load_plan(Path("p.json")).workload.to_workload().cache.hit_rate == 0.4


def test_a_whole_step_skip_costs_nothing_of_the_blocks_and_the_prior_has_a_range(cli):
    c = _plan(cli, "--cache", "mag")["prediction"]["cache"]
    assert c["hit_rate_source"] == "prior" and c["computed_steps_range"][0] < c["computed_steps"] < \
        c["computed_steps_range"][1]
    assert c["steps_s_range"][0] < c["steps_s"] < c["steps_s_range"][1]
    lite = _plan(cli, "--cache", "taylorseer-lite:4,2")["prediction"]["cache"]
    full = _plan(cli, "--cache", "taylorseer:4,2")["prediction"]["cache"]
    assert lite["computed_steps"] == full["computed_steps"]
    assert lite["steps_s"] < full["steps_s"] == pytest.approx(full["uncached_steps_s"])  # every block still streams


@pytest.mark.parametrize("args,said", [
    (["--cache", "tea"], "not a cache chunkflow plans; use one of " + ", ".join(CACHE_KINDS)),
    (["--cache", "first-block:0"], "never fires"),
    (["--cache", "taylorseer-lite:1"], "computes every step"),
    (["--cache", "taylorseer-lite:3,0"], "predicts before any step was computed"),
    (["--cache", "taylorseer-lite", "--cache-hit-rate", "0.5"], "leave --cache-hit-rate out"),
    (["--cache", "first-block", "--cache-hit-rate", "1.5"], "from 0 to below 1"),
    (["--cache", "first-block:x"], "threshold must be a number"),
    (["--cache", "mag:speed=3"], "mag takes threshold, max_skip_steps, retention_ratio"),
    (["--cache-hit-rate", "0.3"], "give the cache with --cache KIND"),
])
def test_what_cannot_be_planned_is_one_line(cli, args, said):
    result = cli("plan", "--model", "flux", "--hardware", "h100-sxm", *args)
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and said in out and "Traceback" not in result.output, result.output


def test_parse_reads_positional_and_named_parameters():
    c = parse_cache("taylorseer-lite:6,disable_cache_before_step=1")
    assert dict(c.params) == {"cache_interval": 6.0, "disable_cache_before_step": 1.0}
    with pytest.raises(CacheError):
        parse_cache("first-block:0.1,0.2")


def test_the_hit_rate_spread_widens_the_generation_band(cli):
    """A given rate with no spread leaves the generation's band as the fits make it; the prior's spread widens it
    by the steps' seconds at its ends, names the cache among the band's fits and marks it supposed."""
    given = _plan(cli, "--cache", "mag:0.1", "--cache-hit-rate", "0.35")["prediction"]
    prior = _plan(cli, "--cache", "mag:0.1")["prediction"]
    assert given["generation_time_s"] == pytest.approx(prior["generation_time_s"])
    g, p = given["bands"]["generation_time_s"], prior["bands"]["generation_time_s"]
    c = prior["cache"]
    moved = max(c["steps_s"] - c["steps_s_range"][0], c["steps_s_range"][1] - c["steps_s"])
    assert p["rel"] == pytest.approx((g["rel"] ** 2 + (moved / prior["generation_time_s"]) ** 2) ** 0.5)
    assert "cache hit rate" in p["fits"] and "cache hit rate" in p["supposed"] and "cache hit rate" not in g["fits"]
