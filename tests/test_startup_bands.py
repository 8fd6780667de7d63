"""A process's first generation: its start-up is a one-sided term with its own band (bands.with_startup), and a run
is judged against the band of the generation it measured (first, or after a warm-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkflow_planner.bands import STARTUP_PRIOR, Z, startup_edges, with_startup
from chunkflow_planner.catalog import FitQuality, get_hardware
from chunkflow_planner.bands import Band


def _band(value: float, rel: float) -> Band:
    return Band(rel=rel, low=value * (1 - rel), high=value * (1 + rel), measured=True, fits=["compute"])


def test_a_first_generations_band_is_its_warm_band_plus_a_one_sided_startup():
    """Warm 2.0 s +-10%, start-up 1.0 s measured at a 30% spread: the first generation's 3.0 s reaches from 1.8 (the
    start-up one-sided: another pipeline's kernels can cost almost none of it) to 2.2 + 1.6 s; the warm band is left
    as it was."""
    hw = get_hardware("h200").model_copy(update={"fits": {"startup": FitQuality(samples=3, spread=0.3, drift=0.0)}})
    found = {"phases.denoise.warm_time_s": _band(2.0, 0.1), "phases.denoise.time_s": _band(3.0, 0.1)}
    values = {"phases.denoise.warm_time_s": 2.0, "phases.denoise.time_s": 3.0}
    out = with_startup(found, values, hw)
    first = out["phases.denoise.time_s"]
    assert first.low == pytest.approx(1.8) and first.high == pytest.approx(2.2 + 1.0 * (1 + Z * 0.3))
    assert first.startup_s == pytest.approx((0.0, 1.6)) and first.contains(3.0) and first.measured
    assert first.contains(2.0)  # a start-up of almost none (PixArt-Sigma's denoise on an H100: 0.03 s of 0.20)
    below, above = first.edges()
    assert below == pytest.approx(0.4) and above == pytest.approx(0.8 / 3.0)  # the warm low edge: none of it below
    assert first.rel == max(below, above) and "startup" in first.fits
    assert out["phases.denoise.warm_time_s"] == found["phases.denoise.warm_time_s"]


def test_a_startup_spread_past_half_reaches_down_to_none_of_it():
    """The start-up never goes negative: at the prior (no record) its low is 0, so the band's low edge is the warm
    band's, and the band says the start-up was supposed."""
    hw = get_hardware("h200").model_copy(update={"fits": {}})
    lo, hi, measured = startup_edges(hw, 0.5)
    assert lo == 0.0 and hi > 0.5 and not measured
    out = with_startup({"generation_warm_time_s": _band(4.0, 0.1), "generation_time_s": _band(4.5, 0.1)},
                       {"generation_warm_time_s": 4.0, "generation_time_s": 4.5}, hw)["generation_time_s"]
    assert out.low == pytest.approx(3.6) and "startup" in out.supposed and not out.measured


def test_a_run_is_judged_against_the_band_of_the_generation_it_measured(workdir):
    """A first generation well over its prediction (a slow start-up) but under its band's high edge is inside; the
    same error after a warm-up is held to the warm band, and is outside; below the band's low edge is outside."""
    from chunkflow.reports import load_reports
    from tests.test_bands import _gpu_report, _hw, _plan

    hw = _hw({"startup": 0.3})
    plan = _plan(hw)
    bands = plan.prediction.bands
    first, warm = bands["phases.encode.time_s"], bands["phases.encode.warm_time_s"]
    assert first.startup_s is not None and warm.startup_s is None and first.low == pytest.approx(warm.low)
    data, path = _gpu_report(workdir)
    data["plan"] = json.loads(plan.to_json())

    def verdict(error: float, warmup: int):
        phase = dict(measured_time_s=1.0, time_error=error)
        data["generation"] = dict(prompt="p", seed=0, steps=8, components={}, phases={"encode": phase},
                                  generation_time_s=1.0, host_peak_bytes=1, warmup_generations=warmup)
        path.write_text(json.dumps(data))
        return load_reports([path])[0].bands["phases.encode.time_s"]

    high = first.rel_high * 0.9
    assert verdict(high, 0).inside and verdict(high, 0).above == pytest.approx(first.rel_high)
    assert not verdict(high, 1).inside and verdict(high, 1).band == warm.rel  # after a warm-up: the warm band
    assert not verdict(-(first.rel_low + 0.01), 0).inside and verdict(-first.rel_low * 0.9, 0).inside


def test_calibrate_measures_the_startup_over_cold_processes_and_records_its_spread():
    """Two new processes of the tiny pipeline on the CPU, each phase's component called twice: a sample a process
    for every phase, the figure their mean, and their spread as the `startup` fit (the encode counted once)."""
    from chunkflow.commands.calibrate.startup import calibrated_startup

    said: list[str] = []
    out, raw = calibrated_startup("tiny-wan", 2, "cpu", said.append)
    assert {"encode", "denoise", "decode"} <= out["startup_s"].keys() and any("cold processes" in s for s in said)
    for key, xs in out["startup_samples_s"].items():
        assert len(xs) == 2 and raw[key] == xs and out["startup_s"][key] == pytest.approx(sum(xs) / 2)
    q = out["fit"]
    assert q is not None and q.samples == 2 * (len(out["startup_s"]) - 1) and "2 cold process(es)" in q.source


def test_a_freshly_started_machines_startup_is_measured_first_and_raises_the_high_edge_alone():
    """calibrate's first cold process runs with the libraries dropped from the page cache (a freshly started machine:
    PixArt-Sigma's first denoise on one paid 0.77 s of start-up, its next process 0.03 s): its samples are kept as
    `cold:<phase>`, outside the `startup` fit, and a first generation's band reaches up by what they add; the low edge
    and the prediction do not move."""
    from chunkflow.commands.calibrate.startup import calibrated_startup, measure_cold_startup
    from chunkflow.loading.libraries import library_files
    from chunkflow_planner.catalog import HardwareSpec

    assert any("torch" in str(p) for p in library_files())
    said: list[str] = []
    cold = measure_cold_startup("tiny-wan", "cpu", said.append, most_cached=1.0)  # a test process maps torch
    assert set(cold) == {"cold:encode", "cold:denoise", "cold:decode"} and "dropped" in said[-1]
    assert measure_cold_startup("tiny-wan", "cpu", said.append, most_cached=-1.0) == {} and "not measured" in said[-1]
    out, _ = calibrated_startup("tiny-wan", 2, "cpu", said.append, cold)
    assert out["startup_s"]["cold:denoise"] == pytest.approx(cold["cold:denoise"][0])
    assert out["fit"].samples == 2 * (len(out["startup_s"]) - 3 - 1)  # the cold keys and the encode's twin left out

    base = get_hardware("h200").model_copy(update={"fits": {"startup": FitQuality(samples=3, spread=0.1, drift=0.0)}})
    found = {"phases.denoise.warm_time_s": _band(0.5, 0.1), "phases.denoise.time_s": _band(0.7, 0.1),
             "generation_warm_time_s": _band(2.0, 0.1), "generation_time_s": _band(2.2, 0.1)}
    values = {"phases.denoise.warm_time_s": 0.5, "phases.denoise.time_s": 0.7, "generation_warm_time_s": 2.0,
              "generation_time_s": 2.2}
    plain = with_startup(found, values, base)
    pipe = base.pipeline.model_copy(update={"startup_s": {"denoise": 0.2, "cold:denoise": 0.9}})
    hw = HardwareSpec.model_validate(base.model_copy(update={"pipeline": pipe}).model_dump())  # the keys validate
    fresh = with_startup(found, values, hw)
    for key in ("phases.denoise.time_s", "generation_time_s"):  # one cold sample: its part at the prior spread
        assert fresh[key].high == pytest.approx(plain[key].high + 0.7 * (1 + Z * STARTUP_PRIOR))
        assert fresh[key].low == plain[key].low == found[key.replace("time_s", "warm_time_s")].low
    assert fresh["phases.denoise.time_s"].contains(0.5 + 0.77) and not plain["phases.denoise.time_s"].contains(1.27)


def test_a_first_generation_is_held_to_the_fresh_machine_edge_only_where_its_libraries_were_not_cached(workdir):
    """A profile with a freshly started machine's start-up (`cold:encode`): the plan's first-generation band carries
    what that adds to its high edge; a run that started with the libraries cached (`libraries_cached`, taken before
    torch was imported) is held to the edge without it, one that started cold (or says nothing) to the edge with it."""
    plan = cold_encode_plan(None)
    first = plan.prediction.bands["phases.encode.time_s"]
    assert first.startup_cold_s == pytest.approx(0.8 * (1 + Z * STARTUP_PRIOR))  # no cold samples: the prior
    warm_edge = first.without_cold()
    assert warm_edge.high == pytest.approx(first.high - first.startup_cold_s) and warm_edge.low == first.low

    def inside(cached: float | None) -> bool:
        return encode_inside(workdir, plan, cached)

    assert inside(0.0) and inside(None) and not inside(0.9)


def test_run_notes_the_libraries_page_cache_before_it_imports_torch():
    """`cached_at_start` is asked before torch is imported (run's import_libraries), in a new process: a share of
    the libraries' bytes; asked once torch is imported, None (its mapped pages would count)."""
    import subprocess
    import sys

    code = ("import sys; from chunkflow.loading.libraries import cached_at_start as c; a = c(); import torch; "
            "from chunkflow.loading import libraries as l; l._AT_START.clear(); print(a, c(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert 0.0 <= float(out[0]) <= 1.0 and out[1:] == ["None", "True"]


def test_a_process_own_host_memory_is_the_start_up_probes_resident_set_after_their_calls():
    """PixArt-Sigma's first generation on an H100 grew its process by about 1 GB over the profile's
    process_host_bytes (taken before any text encoder, block or VAE kernel ran: host memory +11% against a 7% band).
    The start-up probes run every phase's component and then free it: their median resident set is the figure,
    larger than a process that only started (the libraries those calls loaded count), and it lands in the profile."""
    import statistics
    import subprocess
    import sys

    from chunkflow.commands.calibrate.startup import RSS_KEY, calibrated_startup, measure_startup

    raw = measure_startup("tiny-wan", 2, "cpu")
    assert len(raw[RSS_KEY]) == 2 and all(x > 50e6 for x in raw[RSS_KEY])
    said: list[str] = []
    out, kept = calibrated_startup("tiny-wan", 2, "cpu", said.append)
    assert out["process_host_bytes"] == int(statistics.median(kept[RSS_KEY]))
    assert RSS_KEY not in out["startup_s"] and RSS_KEY not in out["startup_samples_s"]
    assert any("own host memory" in s for s in said)
    started = subprocess.run([sys.executable, "-c", "import diffusers, transformers, torch; "
                              "from chunkflow.hostmem import rss_bytes; print(rss_bytes())"],
                             capture_output=True, text=True, check=True, env={**__import__("os").environ,
                                                                              "CUDA_VISIBLE_DEVICES": ""})
    assert out["process_host_bytes"] > int(started.stdout.split()[-1])


def cold_encode_plan(warm_share: float | None):
    """A plan whose encode start-up has a fresh machine's part (`cold:encode`), the machine's warm share given."""
    from chunkflow_planner.planner import ResolvedHardware
    from tests.test_bands import _hw, _plan

    hw = _hw({"startup": 0.3}).spec
    pipe = hw.pipeline.model_copy(update={"startup_s": {**hw.pipeline.startup_s, "encode": 0.2, "cold:encode": 1.0},
                                          "libraries_warm_share": warm_share})
    return _plan(ResolvedHardware(hw.model_copy(update={"pipeline": pipe}), "test"))


def encode_inside(workdir: Path, plan, cached: float | None) -> bool:
    """Whether a report of the plan whose encode took between the cached edge and the fresh machine's, its process
    started with a share `cached` of the libraries cached, is judged inside its encode band."""
    from chunkflow.reports import load_reports
    from tests.test_bands import _gpu_report

    data, path = _gpu_report(workdir)
    first = plan.prediction.bands["phases.encode.time_s"]
    data["plan"] = json.loads(plan.to_json())
    phase = dict(measured_time_s=1.0, time_error=(first.without_cold().edges()[1] + first.edges()[1]) / 2)
    data["generation"] = dict(prompt="p", seed=0, steps=8, components={}, phases={"encode": phase},
                              generation_time_s=1.0, host_peak_bytes=1, warmup_generations=0, libraries_cached=cached)
    path.write_text(json.dumps(data))
    return load_reports([path])[0].bands["phases.encode.time_s"].inside
