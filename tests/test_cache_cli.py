"""`--cache KIND[:PARAMS]` (issue 54): parsed once into a validated pydantic model with a schema; a bad one is one
line naming what is accepted."""

from __future__ import annotations

import json

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
