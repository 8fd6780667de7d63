"""Step caching planned (issue 54, the planner's part): `plan --cache KIND[:PARAMS] [--cache-hit-rate R]` prices the
steps a cache computes and skips; the computed-step count of a schedule known ahead (TaylorSeer; MagCache with its
ratios) is diffusers' own (counted on a tiny pipeline running diffusers' cache), a hit-rate cache's is bounded as
diffusers bounds it, the denoise phase and the generation shrink by what the skipped steps no longer run, and what
cannot be planned is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from chunkflow_planner.cache import CacheSpecError
from chunkflow_planner.stepcache import FLUX_MAG_RATIOS, computed_steps, plan_cache
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

    cache = plan_cache(f"taylorseer:{interval},disable_cache_before_step={before},lite")
    ran = _computed_forwards(TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=before,
                                                   use_lite_mode=True), steps)
    assert 0 < ran < steps and computed_steps(cache, steps) == ran


@pytest.mark.parametrize("spec,steps", [("mag:ratios=flux", 28), ("mag:0.12,max_skip_steps=2,ratios=flux", 20),
                                        ("mag:0.5,max_skip_steps=2,retention_ratio=0.25,ratios=R", 12),
                                        ("mag:0.02,ratios=flux", 9)])
def test_mag_cache_computes_the_steps_diffusers_computes(spec, steps, tmp_path):
    """MagCache decides each step from the model's ratios (FLUX's, stretched to the steps; or a file's): the plan
    runs diffusers' arithmetic on them ahead and computes the steps diffusers' own cache computes."""
    from diffusers import MagCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS as theirs

    assert list(FLUX_MAG_RATIOS) == pytest.approx(theirs.tolist(), abs=1e-6)
    (tmp_path / "r.json").write_text(json.dumps([1.0, 0.99, 1.02, 0.97, 1.0, 1.05]))
    cache = plan_cache(spec.replace("ratios=R", f"ratios={tmp_path / 'r.json'}"))
    s = cache.setting
    ratios = theirs if s.ratios == "flux" else s.ratios
    ran = _computed_forwards(MagCacheConfig(threshold=s.threshold, max_skip_steps=s.max_skip_steps,
                                            retention_ratio=s.retention_ratio, num_inference_steps=steps,
                                            mag_ratios=ratios), steps)
    assert cache.hit_rate is None and computed_steps(cache, steps) == ran


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
    assert cached["workload"]["cache"]["setting"]["kind"] == "first-block" and cached["schema_version"] == 7
    assert c["computed_steps"] == steps - round(0.4 * steps) and c["skipped_steps"] == round(0.4 * steps)
    step = cached["prediction"]["step_time_s"]
    assert c["uncached_steps_s"] == pytest.approx(steps * step)
    assert c["computed_steps"] * step < c["steps_s"] < c["uncached_steps_s"]  # the skipped steps cost something
    den, den0 = cached["prediction"]["phases"]["denoise"], plain["prediction"]["phases"]["denoise"]
    assert den["parts_s"]["cached steps"] > 0
    saved = plain["prediction"]["generation_time_s"] - cached["prediction"]["generation_time_s"]
    # the other phases change only with the placement (the cached plan may keep its first block whole, whole_first.py,
    # in the room another placement leaves)
    others = [sum(p["time_s"] for name, p in plan["prediction"]["phases"].items() if name != "denoise")
              for plan in (plain, cached)]
    assert saved == pytest.approx(den0["time_s"] - den["time_s"] + others[0] - others[1]) and saved > 0
    assert den0["time_s"] - den["time_s"] > 0
    from chunkflow_planner.plan import load_plan

    assert load_plan(Path("p.json")).workload.to_workload().cache.hit_rate == 0.4


def test_a_whole_step_skip_costs_nothing_of_the_blocks_and_the_prior_has_a_range(cli):
    c = _plan(cli, "--cache", "sea:0.3")["prediction"]["cache"]
    assert c["hit_rate_source"] == "prior" and c["computed_steps_range"][0] < c["computed_steps"] < \
        c["computed_steps_range"][1]
    assert c["steps_s_range"][0] < c["steps_s"] < c["steps_s_range"][1]
    lite = _plan(cli, "--cache", "taylorseer:4,lite")["prediction"]["cache"]
    full = _plan(cli, "--cache", "taylorseer:4")["prediction"]["cache"]
    assert lite["computed_steps"] == full["computed_steps"]
    assert lite["steps_s"] < full["steps_s"] == pytest.approx(full["uncached_steps_s"])  # every block still streams


@pytest.mark.parametrize("args,said", [
    (["--cache", "tea"], "unknown cache 'tea'; give one of first-block, mag, taylorseer, sea"),
    (["--cache", "sea:0"], "never fires"),
    (["--cache", "taylorseer:1"], "computes every step"),
    (["--cache", "taylorseer:3,disable_cache_before_step=0"], "predicts before any step was computed"),
    (["--cache", "mag:calibrate"], "calibrating MagCache skips nothing"),
    (["--cache", "taylorseer", "--cache-hit-rate", "0.5"], "leave --cache-hit-rate out"),
    (["--cache", "mag:ratios=flux", "--cache-hit-rate", "0.5"], "leave --cache-hit-rate out"),
    (["--cache", "first-block", "--cache-hit-rate", "1.5"], "from 0 to below 1"),
    (["--cache", "mag:speed=3"], "mag takes threshold"),
    (["--cache-hit-rate", "0.3"], "give the cache with --cache KIND"),
    (["--cache", "first-block", "--cache-hit-rate", "0.35+-x"], "a rate and its spread are two numbers"),
    (["--cache", "first-block", "--cache-hit-rate", "0.35+-1.5"], "the spread 1.5 is a share of the steps"),
    (["--cache", "first-block", "--cache-hit-rate", "0.35±nan"], "the spread nan is a share of the steps"),
])
def test_what_cannot_be_planned_is_one_line(cli, args, said):
    result = cli("plan", "--model", "flux", "--hardware", "h100-sxm", *args)
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and said in out and "Traceback" not in result.output, result.output


def test_a_planned_cache_is_the_setting_run_takes_and_reads_back():
    c = plan_cache("taylorseer:6,disable_cache_before_step=1,lite")
    assert (c.setting.cache_interval, c.setting.disable_cache_before_step, c.setting.lite) == (6, 1, True)
    assert type(c).model_validate_json(c.model_dump_json()) == c and hash(c) == hash(type(c).model_validate_json(
        c.model_dump_json()))
    with pytest.raises(CacheSpecError):
        plan_cache("first-block:0.1,threshold=0.2")


def test_the_hit_rate_spread_widens_the_generation_band(cli):
    """A given rate with no spread leaves the generation's band as the fits make it; the prior's spread widens it
    by the steps' seconds at its ends, names the cache among the band's fits and marks it supposed."""
    given = _plan(cli, "--cache", "sea:0.3", "--cache-hit-rate", "0.35")["prediction"]
    prior = _plan(cli, "--cache", "sea:0.3")["prediction"]
    assert given["generation_time_s"] == pytest.approx(prior["generation_time_s"])
    g, p = given["bands"]["generation_time_s"], prior["bands"]["generation_time_s"]
    c = prior["cache"]
    moved = max(c["steps_s"] - c["steps_s_range"][0], c["steps_s_range"][1] - c["steps_s"])
    assert p["rel"] == pytest.approx((g["rel"] ** 2 + (moved / prior["generation_time_s"]) ** 2) ** 0.5)
    assert "cache hit rate" in p["fits"] and "cache hit rate" in p["supposed"] and "cache hit rate" not in g["fits"]
    # a spread given with the rate (a probe's, a user's own runs) widens it as the prior's does: the prior is 0.35+-0.2
    spread = _plan(cli, "--cache", "sea:0.3", "--cache-hit-rate", "0.35+-0.2")
    assert spread["workload"]["cache"]["hit_rate_spread"] == 0.2
    assert spread["workload"]["cache"]["hit_rate_source"] == "given"
    s = spread["prediction"]["bands"]["generation_time_s"]
    assert s["rel"] == pytest.approx(p["rel"]) and "cache hit rate" in s["fits"] and "cache hit rate" not in s["supposed"]
    assert spread["prediction"]["cache"]["computed_steps_range"] == c["computed_steps_range"]


def test_a_run_of_a_cached_plan_runs_its_cache_and_reports_the_hit_rate_against_the_plan(cli, workdir):
    """`plan --cache` then `run --plan` (no --cache): the run enables the plan's cache and its report gives the
    measured share of skipped steps beside the planned one; for a schedule known ahead (MagCache on its ratios:
    all 1, so it skips all it may) the computed steps are the plan's exactly."""
    (workdir / "r.json").write_text(json.dumps([1.0] * 8))
    spec = f"mag:0.5,max_skip_steps=2,retention_ratio=0.25,ratios={workdir / 'r.json'}"
    result = cli("plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--steps", "8", "--cache",
                 spec, "--out", "plan.json")
    assert result.exit_code == 0, result.output
    planned = json.loads(Path("plan.json").read_text())["prediction"]["cache"]
    with one_thread():
        ran = cli("run", "--plan", "plan.json", "--prompt", "a red fox", "--report", "r.json")
    assert ran.exit_code == 0, ran.output
    c = json.loads(Path("r.json").read_text())["generation"]["cache"]
    assert c["setting"]["kind"] == "mag" and c["planned_source"] == "schedule"
    assert c["planned_computed_steps"] == planned["computed_steps"] < 8
    assert c["planned_hit_rate"] == pytest.approx(planned["skipped_steps"] / 8)
    assert c["measured_hit_rate"] == pytest.approx(c["forwards_skipped"] / c["forwards"])
    assert c["forwards_skipped"] == planned["skipped_steps"] * c["forwards_per_step"]
    assert c["measured_hit_rate"] == pytest.approx(c["planned_hit_rate"])


def test_a_run_report_gives_the_next_plan_its_hit_rate(cli, workdir):
    """`run --cache first-block:0.3 --report R` measures the share of steps skipped; `plan --cache first-block:0.3
    --cache-hit-rate R` plans with it (source `reports`, no prior spread); a report of another cache, or of none, is
    one line."""
    assert cli("plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--steps", "8",
               "--out", "p.json").exit_code == 0
    with one_thread():
        ran = cli("run", "--plan", "p.json", "--prompt", "a red fox", "--cache", "first-block:0.3", "--report",
                  "r.json")
    assert ran.exit_code == 0, ran.output
    measured = json.loads(Path("r.json").read_text())["generation"]["cache"]["measured_hit_rate"]
    assert 0 < measured < 1
    d = _plan(cli, "--cache", "first-block:0.3", "--cache-hit-rate", "r.json")
    wc = d["workload"]["cache"]
    assert wc["hit_rate"] == pytest.approx(measured) and wc["hit_rate_source"] == "reports"
    assert wc["hit_rate_spread"] == 0
    # several reports (other prompts, seeds): their mean, and half their range as the spread the band takes
    other = json.loads(Path("r.json").read_text())
    for name, share in (("r2.json", measured / 2), ("0.3+-a.json", measured / 4)):  # a name that reads as a number
        other["generation"]["cache"]["measured_hit_rate"] = share
        Path(name).write_text(json.dumps(other))
    wc = _plan(cli, "--cache", "first-block:0.3", "--cache-hit-rate", "r.json, r2.json")["workload"]["cache"]
    assert wc["hit_rate"] == pytest.approx(0.75 * measured) and wc["hit_rate_spread"] == pytest.approx(measured / 4)
    assert wc["hit_rate_source"] == "reports"
    # three: the mean, and the farthest from it as the spread, so that each report's rate is inside the band
    wc = _plan(cli, "--cache", "first-block:0.3", "--cache-hit-rate", "r.json,r2.json,0.3+-a.json")["workload"]["cache"]
    mean = (1 + 1 / 2 + 1 / 4) / 3 * measured
    assert wc["hit_rate"] == pytest.approx(mean) and wc["hit_rate_spread"] == pytest.approx(measured - mean)
    assert _plan(cli, "--cache", "first-block:0.3", "--cache-hit-rate", "0.3+-a.json")["workload"]["cache"][
        "hit_rate"] == pytest.approx(measured / 4)  # a file of that name is read as the report it is
    bad = cli("plan", "--model", "flux", "--cache", "first-block", "--cache-hit-rate", "0.3,0.4")
    assert bad.exit_code == 2 and "give one number" in " ".join(bad.output.split()), bad.output
    for spec, said in (("sea:0.3", "the report's cache is first-block, not sea"),):
        bad = cli("plan", "--model", "flux", "--cache", spec, "--cache-hit-rate", "r.json")
        assert bad.exit_code == 2 and said in " ".join(bad.output.split()), bad.output
    Path("none.json").write_text(json.dumps({"generation": {}}))
    bad = cli("plan", "--model", "flux", "--cache", "first-block", "--cache-hit-rate", "none.json")
    assert bad.exit_code == 2 and "ran no step cache" in bad.output


@pytest.mark.parametrize("spec,steps,said", [
    ("taylorseer:5,lite", 3, "with 3 steps taylorseer computes every one"),
    ("first-block:0.1", 1, "with 1 step first-block has no step to skip"),
    ("mag:0.05,ratios=R", 8, "MagCache's decisions on these ratios skip no step"),
])
def test_a_cache_that_skips_no_step_of_a_few_step_schedule_is_refused(cli, workdir, spec, steps, said):
    """A distilled few-step schedule (FLUX schnell's 4 steps) leaves a cache nothing to skip: `plan` and `run` say
    so in one line before anything is built, rather than run a cache that changes nothing."""
    (workdir / "ratios.json").write_text(json.dumps([1.5] * 8))  # every step far from the last: MagCache never skips
    spec = spec.replace("ratios=R", f"ratios={workdir / 'ratios.json'}")
    planned = cli("plan", "--model", "flux", "--hardware", "h100-sxm", "--steps", str(steps), "--cache", spec)
    out = " ".join(planned.output.split())
    assert planned.exit_code == 2 and said in out and "would change nothing" in out, planned.output
    assert cli("plan", "--model", "demo", "--hardware", "cpu", "--out", "p.json").exit_code == 0
    ran = cli("run", "--plan", "p.json", "--prompt", "a fox", "--steps", str(steps), "--cache", spec, "--report",
              "r.json")
    out = " ".join(ran.output.split())
    assert ran.exit_code == 2 and said in out and not Path("r.json").exists(), ran.output


@pytest.mark.parametrize("args", [["--cache", "first-block", "--cache-hit-rate", "/dev/zero"],
                                  ["--cache", "mag:ratios=/dev/zero"], ["--cache", "mag:ratios=FIFO"],
                                  ["--cache", "sea", "--cache-hit-rate", "FIFO"]])
def test_a_device_or_fifo_given_as_a_file_is_refused_without_reading_it(cli, workdir, args):
    """`--cache-hit-rate` (a run report) and `ratios=` (a JSON file) read the user's files: a FIFO or /dev/zero is
    refused from its kind, one line, rather than block or read for ever."""
    import os

    os.mkfifo(workdir / "fifo")
    args = [a.replace("FIFO", str(workdir / "fifo")) for a in args]
    result = cli("plan", "--model", "flux", "--hardware", "h100-sxm", *args)
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "not a regular file" in out and "Traceback" not in result.output, result.output


# ------------------------------------------------------------------ residency under first-block caching (whole_first.py)

def _problem(cache: str | None, hit_rate: float | None = None):
    from chunkflow_planner.catalog import Workload, get_hardware, get_model
    from chunkflow_planner.policy import Problem

    w = Workload(height=1024, width=1024, steps=28, cache=plan_cache(cache, hit_rate, steps=28) if cache else None)
    return Problem(get_model("flux"), w, get_hardware("h100-sxm"))


def test_a_hit_step_prices_the_copies_the_runtime_makes():
    """A first-block hit runs block 0 alone: streamed, it takes its own copy again and block 1's (link-bound here, at
    FLUX's 6 GB residencies); kept whole, no copy, only its compute window (tests/test_caches.py counts the bytes)."""
    from chunkflow_planner.memory import stored_volumes
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.steptime import link_s

    problem = _problem("first-block:0.1", 0.4)
    streamed = problem.evaluate(OffloadConfig("chunkflow", "16MB", 0.1))
    whole = problem.evaluate(OffloadConfig("chunkflow", "16MB", 0.1, whole_blocks=(0,)))
    V = stored_volumes(problem.spec, streamed.cfg)
    links = [link_s(v, streamed.cfg, problem.hw) for v in V[:2]]
    assert streamed.time.first_only >= sum(links) > streamed.time.per_block[0]  # both copies, more than one block's
    assert whole.time.first_only < whole.time.per_block[0]  # block 1's copy is not a hit's
    assert 0 < whole.time.first_only < streamed.time.first_only / 5


def test_first_block_caching_keeps_the_first_block_whole_where_that_is_faster(cli):
    """Under a first-block cache a streamed plan keeps block 0 whole and the largest residency of the others the
    budget holds; the cached steps take less than at the setting the plan picks without the cache, with the same
    cache; a cache that skips whole steps (MagCache) and a plan that streams nothing keep no block whole."""
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.whole_first import cached_time_s

    plain = _plan(cli)
    cached = _plan(cli, "--cache", "first-block:0.1", "--cache-hit-rate", "0.4")
    assert plain["offload"]["whole_blocks"] == [] and cached["offload"]["whole_blocks"] == [0]
    assert "first block is kept whole" in cached["reason"]
    text = cli("plan", "--model", "flux", "--hardware", "h100-sxm", "--mem-budget", "6GB", "--cache", "first-block:0.1",
               "--cache-hit-rate", "0.4").output
    assert "(block 0 whole)" in " ".join(text.split())  # the plan's line says so
    problem = _problem("first-block:0.1", 0.4)
    chosen = problem.evaluate(OffloadConfig.model_validate(cached["offload"]))
    before = problem.evaluate(OffloadConfig.model_validate(plain["offload"]))
    assert cached_time_s(problem, chosen) < cached_time_s(problem, before)
    assert _plan(cli, "--cache", "mag:ratios=flux")["offload"]["whole_blocks"] == []
    assert _plan(cli, "--cache", "first-block:0.1", "--mem-budget", "80GB")["offload"]["mode"] == "none"


def test_whole_blocks_are_a_chunkflow_setting_said_in_its_label_and_kept_by_overrides():
    from chunkflow_planner.offload import OffloadConfig, OffloadConfigError

    cfg = OffloadConfig("chunkflow", "16MB", 0.2, whole_blocks=[2, 0, 2])
    assert cfg.whole_blocks == (0, 2) and cfg.label.endswith(" whole=0,2")
    assert OffloadConfig.model_validate(json.loads(cfg.model_dump_json())) == cfg  # a plan file's round trip
    assert cfg.with_overrides(residency=0.5).whole_blocks == (0, 2)
    assert cfg.with_overrides(mode="layerwise").whole_blocks == ()  # it keeps no residency: nothing carried
    for bad, said in (([-1], "0 or more"), ("0", "list of block indices"), ([True], "0 or more")):
        with pytest.raises(OffloadConfigError, match=said):
            OffloadConfig("chunkflow", "16MB", 0.2, whole_blocks=bad)
    with pytest.raises(OffloadConfigError, match="that is mode chunkflow, not layerwise"):
        OffloadConfig("layerwise", whole_blocks=(0,))


@pytest.mark.parametrize("cache", ["sea:0.3", "sea:0.1,retention_steps=2"])
def test_a_data_driven_cache_under_sequence_parallelism_is_refused_in_one_line(cli, cache):
    """A cache that decides from the data would decide on each rank's share of the tokens: the plan refuses it
    rather than price a run whose ranks could disagree, and says which caches do go with --sp (first-block, whose
    measure the ranks sum together, among them)."""
    result = cli("plan", "--model", "wan2.1-14b", "--hardware", "h200-x2", "--sp", "2", "--cache", cache)
    assert result.exit_code != 0, result.output
    said = " ".join(result.output.split())
    assert "with --sp 2:" in said and "from the data" in said and "mag:ratios=" in said, said
    assert "or first-block (its measure is summed over the processes)" in said
    assert "Traceback" not in result.output
    assert cli("plan", "--model", "wan2.1-14b", "--hardware", "h200-x2", "--sp", "2").exit_code == 0


@pytest.mark.parametrize("cache", ["mag:ratios=flux", "taylorseer:3,lite", "first-block:0.1"])
def test_a_cache_every_rank_decides_alike_is_planned_under_sequence_parallelism_as_on_one_gpu(cli, workdir, cache):
    """A schedule known ahead decides the same on every rank, and so does first-block caching from its measure
    summed over the ranks: --sp 2 plans it, computing the steps one GPU's plan
    computes, in less time than the same --sp 2 plan without the cache."""
    def plan(out, *extra):
        result = cli("plan", "--model", "wan2.1-14b", "--hardware", "h200-x2", "--out", out, *extra)
        assert result.exit_code == 0, result.output
        return json.loads(Path(out).read_text())

    sp, one, plain = plan("sp.json", "--sp", "2", "--cache", cache), plan("one.json", "--cache", cache), \
        plan("plain.json", "--sp", "2")
    assert sp["parallel"]["sp_degree"] == 2 and sp["workload"]["cache"] == one["workload"]["cache"]
    c = sp["prediction"]["cache"]
    assert c["computed_steps"] == one["prediction"]["cache"]["computed_steps"] < sp["workload"]["steps"]
    assert c["steps_s"] < c["uncached_steps_s"] and plain["prediction"]["cache"] is None
    assert sp["prediction"]["generation_time_s"] < plain["prediction"]["generation_time_s"]


def test_a_plan_naming_a_whole_block_the_model_lacks_is_refused_before_the_load(cli):
    """A plan file edited to keep a block whole past the model's blocks: `run` says so in one line, exit 2, before it
    reads any weights (plan_checks.offload_problem; offload() refuses it too, for a module given directly)."""
    assert cli("plan", "--model", "flux", "--hardware", "h100-sxm", "--mem-budget", "6GB", "--out", "p.json").exit_code == 0
    data = json.loads(Path("p.json").read_text())
    data["offload"]["whole_blocks"] = [0, 57]
    Path("bad.json").write_text(json.dumps(data))
    result = cli("run", "--plan", "bad.json", "--device", "cpu", "--prompt", "a fox", "--weights", "no-such-folder")
    assert result.exit_code == 2 and "whole_blocks names block 57, but" in " ".join(result.output.split())
    assert "Traceback" not in result.output
