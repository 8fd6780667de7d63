"""`--cache KIND[:PARAMS]` (issue 54): parsed once into a validated pydantic model with a schema; a bad one is one
line naming what is accepted; `chunkflow run --prompt --cache` enables it on the pipeline's transformer and gives the
latents of the same cache with the transformer whole on the device, bit for bit, the report counting the blocks
computed and skipped (the same count as the runtime's) and the bytes copied for the skipped ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from chunkflow_planner.cache import (KINDS, CacheSetting, CacheSpecError, FirstBlockCache, MagCache, SeaCache,
                                     TaylorSeerCache, cache_label, parse_cache)


@pytest.mark.parametrize("text,want", [
    ("first-block:0.1", FirstBlockCache(threshold=0.1)),
    ("first-block", FirstBlockCache()),
    ("mag:ratios=flux", MagCache(ratios="flux")),
    ("mag:0.1,max_skip_steps=2,retention-ratio=0.3,ratios=flux", MagCache(threshold=0.1, max_skip_steps=2,
                                                                           retention_ratio=0.3, ratios="flux")),
    ("mag:calibrate", MagCache(calibrate=True)),
    ("taylorseer:2,lite", TaylorSeerCache(cache_interval=2, lite=True)),
    ("taylorseer:disable_cache_after_step=10", TaylorSeerCache(disable_cache_after_step=10)),
    ("sea:0.3,residual_order=0", SeaCache(threshold=0.3, residual_order=0)),
])
def test_a_spec_parses_into_its_model_and_its_label_parses_back(text, want):
    got = parse_cache(text)
    assert got == want
    assert parse_cache(cache_label(got)) == got


def test_ratios_from_a_file(tmp_path):
    (tmp_path / "r.json").write_text("[1.0, 1.2, 0.9]")
    assert parse_cache(f"mag:ratios={tmp_path / 'r.json'}").ratios == [1.0, 1.2, 0.9]
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(CacheSpecError, match="no list of numbers"):
        parse_cache(f"mag:ratios={tmp_path / 'bad.json'}")


@pytest.mark.parametrize("text,words", [
    ("first:0.1", "unknown cache 'first'; give one of first-block, mag, taylorseer, sea"),
    ("", "unknown cache ''"),
    ("first-block:0", "threshold: Input should be greater than 0"),
    ("first-block:nan", "threshold: Input should be a finite number"),
    ("first-block:0.1,0.2", "threshold is given twice"),
    ("first-block:0.1,foo=2", "first-block takes threshold; 'foo' is not one of them"),
    ("mag", "mag needs the model's magnitude ratios"),
    ("mag:ratios=flux,calibrate", "mag needs the model's magnitude ratios"),
    ("mag:ratios=missing.json", "neither 'flux' nor a readable JSON file"),
    ("mag:retention_ratio=2,ratios=flux", "retention_ratio: Input should be less than or equal to 1"),
    ("taylorseer:0", "cache_interval: Input should be greater than or equal to 1"),
    ("taylorseer:2.5", "cache_interval: Input should be a valid integer"),
    ("sea:residual_order=2", "residual_order: Input should be less than or equal to 1"),
])
def test_a_bad_spec_is_one_line_saying_what_is_accepted(text, words):
    with pytest.raises(CacheSpecError) as exc:
        parse_cache(text)
    msg = str(exc.value)
    assert words in msg and "\n" not in msg and msg.startswith(f"--cache {text!r}")


def test_the_setting_has_a_schema_with_every_kind_and_its_parameters_described():
    schema = TypeAdapter(CacheSetting).json_schema()
    kinds = {d["properties"]["kind"]["const"] for d in schema["$defs"].values()}
    assert kinds == set(KINDS)
    for d in schema["$defs"].values():
        assert all("description" in p for name, p in d["properties"].items() if name != "kind")


# ----------------------------------------------------------------------------------------------- the command


@pytest.fixture
def plans(cli, workdir):
    """The README's demo planned twice: its transformer streamed (7 MB) and whole on the device (1 GB)."""
    for name, budget in (("stream", "7MB"), ("gpu", "1GB")):
        result = cli("plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", budget, "--out", f"{name}.json")
        assert result.exit_code == 0, result.output
    placement = {n: {c["name"]: c["placement"] for c in json.loads((workdir / f"{n}.json").read_text())["pipeline"]
                     ["components"]}["transformer"] for n in ("stream", "gpu")}
    assert placement == {"stream": "stream", "gpu": "gpu"}
    return workdir


def test_run_with_a_cache_gives_the_latents_of_the_same_cache_not_streamed_and_counts_its_skips(cli, plans):
    from safetensors.torch import load_file

    from pipelines import one_thread

    got = {}
    for name in ("stream", "gpu"):
        with one_thread():
            result = cli("run", "--plan", f"{name}.json", "--prompt", "a red fox in the snow", "--steps", "8",
                         "--cache", "first-block:0.3", "--latents", f"{name}.safetensors", "--report", f"{name}-r.json")
        assert result.exit_code == 0, result.output
        assert "cache first-block:threshold=0.3 on transformer:" in " ".join(result.output.split())
        got[name] = (load_file(f"{name}.safetensors")["latents"], json.loads((plans / f"{name}-r.json").read_text()))
    assert got["stream"][0].equal(got["gpu"][0])
    streamed, whole = got["stream"][1], got["gpu"][1]
    c, w = streamed["generation"]["cache"], whole["generation"]["cache"]
    assert c["setting"] == {"kind": "first-block", "threshold": 0.3} and c["forwards"] == 16  # 8 steps, 2 passes
    assert c["blocks_skipped"] > 0 and c["blocks_computed"] + c["blocks_skipped"] == 16 * 4
    for key in ("blocks_computed", "blocks_skipped", "skipped_per_forward", "skipped_by_block"):
        assert c[key] == w[key]  # the cache skipped the same blocks wherever the transformer was
    assert sum(c["skipped_per_forward"]) == c["blocks_skipped"] == sum(c["skipped_by_block"].values())
    st = streamed["stats"]  # the runtime's own count, and the bytes it copied for the blocks skipped
    assert (st["blocks_computed"], st["blocks_skipped"]) == (c["blocks_computed"], c["blocks_skipped"])
    block_bytes = st["streamed_bytes_per_step"] // 4  # the demo's 4 blocks are alike
    # a skipped block is copied only where its prefetch was issued before the cache decided (runtime/hooks.py):
    # first-block skips three blocks in a row here, so less than each skipped block's bytes
    assert 0 < c["skipped_h2d_bytes"] == st["skipped_h2d_bytes"] < c["blocks_skipped"] * block_bytes
    assert w["skipped_h2d_bytes"] is None  # nothing streamed, nothing copied
    # the median step the report compares with the plan's step is a computed step's: the steps in which the cache
    # skipped blocks (cheaper than any the plan prices) are left out of it, and the report says over how many
    import statistics

    m, per = streamed["measured"], c["forwards_per_step"]
    computed = [t for i, t in enumerate(m["step_times_s"]) if not any(c["skipped_per_forward"][i * per:(i + 1) * per])]
    assert 0 < len(computed) < len(m["step_times_s"]) == 8
    assert m["median_steps_counted"] == len(computed) and m["median_step_s"] == statistics.median(computed)


def test_the_median_step_leaves_out_only_steps_a_cache_skipped_blocks_in():
    from chunkflow.reports import CacheResult, computed_step_times
    from chunkflow_planner.cache import parse_cache

    def result(skipped: list[int], per: int) -> CacheResult:
        return CacheResult(setting=parse_cache("first-block:0.3"), label="first-block:threshold=0.3",
                           transformers=["transformer"], forwards=len(skipped), forwards_per_step=per,
                           blocks_computed=1, blocks_skipped=sum(skipped), skipped_per_forward=skipped)

    times = [1.0, 0.1, 0.6, 1.2]
    # two passes a step: step 1 skipped in both, step 2 in one of them: each is left out
    assert computed_step_times(times, result([0, 0, 3, 3, 3, 0, 0, 0], 2)) == [1.0, 1.2]
    assert computed_step_times(times, result([0, 0, 0, 0], 1)) is None  # nothing skipped: every step counts
    assert computed_step_times(times, result([0, 3, 0], 1)) is None  # forwards that do not line up with the steps
    assert computed_step_times(times, None) is None


@pytest.mark.parametrize("args,words", [
    (["--prompt", "a cat", "--cache", "first:1"], "unknown cache 'first'; give one of first-block, mag"),
    (["--prompt", "a cat", "--cache", "mag"], "mag needs the model's magnitude ratios"),
    (["--cache", "first-block"], "--cache goes with --prompt"),
    (["--prompt", "a cat", "--cache", "taylorseer"], "it hooks no module of transformer (WanTransformer3DModel)"),
])
def test_a_cache_the_run_cannot_take_is_refused_in_one_line_before_the_load(cli, plans, args, words):
    (plans / "p.txt").write_text("a cat\n")
    result = cli("run", "--plan", "stream.json", *args)
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split())
    assert "built the" not in result.output and "Traceback" not in result.output


def test_a_report_written_before_the_computed_median_is_read_with_it(tmp_path):
    """Run 4's report (issue 54, Wan2.2-5B with first-block caching on an H100) has the median over every step,
    skipped ones too (-22.4% against the plan's step); read back, its median and step-time error are the computed
    steps', as `calibrate --from-report` and the bands then take them. A report without a cache reads as written."""
    import statistics

    from chunkflow.reports import load_reports

    root = Path(__file__).resolve().parent.parent / "docs/data/gpu-cache"
    raw = json.loads((root / "run-4-h100/report-wan-first-block.json").read_text())
    m, c = raw["measured"], raw["generation"]["cache"]
    per = c["forwards_per_step"]
    computed = [t for i, t in enumerate(m["step_times_s"]) if not any(c["skipped_per_forward"][i * per:(i + 1) * per])]
    assert "median_steps_counted" not in m and m["median_step_s"] != statistics.median(computed)
    report = load_reports([root / "run-4-h100/report-wan-first-block.json"])[0]
    assert report.measured.median_steps_counted == len(computed) < len(m["step_times_s"])
    assert report.measured.median_step_s == statistics.median(computed)
    assert report.rel_error.step_time == pytest.approx(statistics.median(computed) / raw["predicted"]["step_time_s"] - 1)
    assert report.measured.step_times_s == m["step_times_s"]  # the raw times kept
    plain = json.loads((root / "run-3-h100/report-wan-none.json").read_text())
    again = load_reports([root / "run-3-h100/report-wan-none.json"])[0]
    assert again.measured.median_step_s == plain["measured"]["median_step_s"]
    assert again.rel_error.step_time == plain["rel_error"]["step_time"]
