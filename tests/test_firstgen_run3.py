"""Issue 55's third GPU round (one H100, 2026-12-07, docs/data/gpu-firstgen/run-3) judged again after three fixes:
the load's host peak priced with a process before its first kernels (process_start_host_bytes), a freshly started
machine's extra start-up given a spread of its own (bands.cold_spread), and a run's cached libraries judged against
the machine's warm share (libraries_warm_share)."""

from __future__ import annotations

import json
import statistics

import pytest

from chunkflow_planner.bands import STARTUP_PRIOR, Z, cold_edge, cold_spread, spread, with_startup
from chunkflow_planner.catalog import CATALOG_SCHEMA_VERSION, HardwareSpec, get_hardware, load_profile
from chunkflow_planner.claims import ROOT
from chunkflow_planner.plan import load_plan, model_of
from chunkflow_planner.planner import ResolvedHardware, make_plan

RUN = ROOT / "docs" / "data" / "gpu-firstgen" / "run-3"
PROFILE = RUN / "profile.yaml"  # schema 8: process_host_bytes from the start-up probes (1.90 GB), no start figure
PIPELINES = ("pixart-sigma", "sd3-medium")
LOAD_PEAK = "load.host_peak_bytes"
DENOISE = "phases.denoise.time_s"


def _replanned(name: str, hw: HardwareSpec):
    """Run-3's plan of `name` made again on `hw` (its model entry, workload, budget and bytes read)."""
    plan = load_plan(RUN / f"plan-{name}.json")
    again, _, _ = make_plan(model_of(plan), plan.workload.to_workload(), ResolvedHardware(hw, "test"),
                            budget=plan.memory_budget_bytes, read_bytes=plan.prediction.load.read_bytes)
    return again


def _reports(name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RUN.glob(f"report-*-{name}.json"))]


def _load_errors(plan, name: str) -> list[float]:
    """Each run-3 report's load host peak against `plan`'s."""
    predicted = plan.prediction.load.host_peak_bytes
    return [r["generation"]["load"]["host_peak_bytes"] / predicted - 1 for r in _reports(name)]


# ------------------------------------------------------------------------ the load's process before its kernels


def test_the_loads_host_peak_counts_the_process_before_its_first_kernels():
    """process_start_host_bytes replaces process_host_bytes in the load's host peak (eq. L3) alone: the generation's
    host memory keeps the process after its kernels; unset, the load uses process_host_bytes as before."""
    base = get_hardware("h200")
    plan = _replanned("pixart-sigma", base)
    same = _replanned("pixart-sigma", base.model_copy(update={"process_start_host_bytes": None}))
    less = 10**9
    start = base.model_copy(update={"process_start_host_bytes": base.pipeline.process_host_bytes - less})
    started = _replanned("pixart-sigma", start)
    assert same.prediction.load.host_peak_bytes == plan.prediction.load.host_peak_bytes
    assert started.prediction.load.host_peak_bytes == pytest.approx(plan.prediction.load.host_peak_bytes - less, abs=1)
    assert started.prediction.host_memory_bytes == plan.prediction.host_memory_bytes
    assert started.prediction.bands[LOAD_PEAK].rel == pytest.approx(plan.prediction.bands[LOAD_PEAK].rel, rel=0.05)


def test_run3s_load_host_peaks_fall_inside_with_the_process_started_before_its_kernels():
    """Run-3's profile took process_host_bytes from the start-up probes after their kernels (1.90 GB): the load,
    which runs before any kernel, came out 7.2% under its plan for PixArt-Sigma (band +-7.1%). With the figure
    calibrate measured before the probes' kernels (run-2's profile holds it: 0.92 GB, the same _process_rss) as the
    load's process, every load of both pipelines falls inside its band, PixArt's from -7.2% to about +1.3%."""
    hw = load_profile(PROFILE)
    started = load_profile(RUN.parent / "run-2" / "profile.yaml").pipeline.process_host_bytes
    assert hw.pipeline.process_start_host_bytes is None and started < hw.pipeline.process_host_bytes
    fixed = hw.model_copy(update={"process_start_host_bytes": started})
    for name in PIPELINES:
        before, after = _replanned(name, hw), _replanned(name, fixed)
        assert after.prediction.host_memory_bytes == before.prediction.host_memory_bytes
        errors = _load_errors(after, name)
        assert all(after.prediction.bands[LOAD_PEAK].holds(e) for e in errors), (name, errors)
        assert all(0 < e < max(_load_errors(before, name), key=abs) + 0.1 for e in errors)
    pixart = _replanned("pixart-sigma", hw)
    assert not any(pixart.prediction.bands[LOAD_PEAK].holds(e) for e in _load_errors(pixart, "pixart-sigma"))


def test_calibrate_from_report_refits_the_process_before_its_kernels_from_the_loads():
    """`calibrate --from-report` with run-3's twelve reports: the loads' host peaks less their other bytes give a
    process before its kernels well under the generation's own figure, and with it every load is inside its band."""
    from chunkflow.commands.calibrate.refit import refit, refit_load
    from chunkflow.reports import load_reports

    hw = load_profile(PROFILE)
    reports = load_reports(sorted(RUN.glob("report-*.json")))
    update = refit_load(hw, reports)
    start = update["process_start_host_bytes"]
    assert 0 < start < update["process_host_bytes"] and start < hw.pipeline.process_host_bytes
    fixed = hw.model_copy(update={"process_start_host_bytes": start})
    for name in PIPELINES:
        plan = _replanned(name, fixed)
        assert all(plan.prediction.bands[LOAD_PEAK].holds(e) for e in _load_errors(plan, name))
    # the refit's figure is the one that centres the loads: their median error on its plan is near 0
    errors = [e for name in PIPELINES for e in _load_errors(_replanned(name, fixed), name)]
    assert abs(statistics.median(errors)) < 0.02
    assert refit(hw, reports)[0].pipeline.process_start_host_bytes == start


def test_a_version_8_profile_reads_as_it_is_and_the_new_figures_round_trip():
    hw = load_profile(PROFILE)  # schema 8
    assert hw.schema_version == CATALOG_SCHEMA_VERSION >= 9  # read as the current version
    assert hw.pipeline.process_start_host_bytes is None and hw.pipeline.libraries_warm_share is None
    again = HardwareSpec.model_validate(hw.model_copy(update={"process_start_host_bytes": 923377664,
                                                              "libraries_warm_share": 0.33}).model_dump(mode="json"))
    assert again.pipeline.process_start_host_bytes == 923377664 and again.pipeline.libraries_warm_share == 0.33
    with pytest.raises(ValueError):
        HardwareSpec.model_validate({**again.model_dump(mode="json"), "libraries_warm_share": 1.5})


# ---------------------------------------------------------------------------- the cold start-up's own spread


def _with_startup(hw: HardwareSpec, st: dict[str, float], samples: dict[str, list[float]]) -> HardwareSpec:
    pipe = hw.pipeline.model_copy(update={"startup_s": st, "startup_samples_s": samples})
    return HardwareSpec.model_validate(hw.model_copy(update={"pipeline": pipe}).model_dump())  # the keys validate


def test_one_cold_sample_leaves_the_cold_part_at_the_prior_spread():
    """calibrate measures one cold process: the warm start-up's tight spread (0.6% on the H100) says nothing of how
    far the next fresh machine's extra moves, so that part's edge is at STARTUP_PRIOR and the band says a prior
    stood in; the warm part keeps its own spread."""
    hw = load_profile(PROFILE)
    assert cold_spread(hw) == (STARTUP_PRIOR, False)
    c = hw.pipeline.startup_s["cold:denoise"] - hw.pipeline.startup_s["denoise"]
    assert cold_edge(hw, c) == pytest.approx(c * (1 + Z * STARTUP_PRIOR))
    found = {"phases.denoise.warm_time_s": _band(0.5, 0.1), DENOISE: _band(0.7, 0.1)}
    band = with_startup(found, {"phases.denoise.warm_time_s": 0.5, DENOISE: 0.7}, hw)[DENOISE]
    sd = hw.fits["startup"].spread
    assert band.high == pytest.approx(0.55 + 0.2 * (1 + Z * sd) + c * (1 + Z * STARTUP_PRIOR))
    assert band.startup_cold_s == pytest.approx(c * (1 + Z * STARTUP_PRIOR))
    assert "startup" in band.supposed and not band.measured


def test_several_cold_samples_give_the_cold_part_its_own_spread():
    """Cold samples of 0.5, 0.6 and 0.7 s over a warm 0.2 s: c = 0.4 s, the samples 0.1 s about their mean, so the
    cold part's spread is its samples' (shares of c, one mean fitted) and the band counts it measured; with two
    samples, too few, the prior stands."""
    base = get_hardware("h200")
    st = {"denoise": 0.2, "cold:denoise": 0.6}
    hw = _with_startup(base, st, {"denoise": [0.2, 0.2, 0.2], "cold:denoise": [0.5, 0.6, 0.7]})
    sd, measured = cold_spread(hw)
    assert measured and sd == pytest.approx(spread([-0.25, 0.0, 0.25], fitted=1)) and sd < STARTUP_PRIOR
    assert cold_edge(hw, 0.4) == pytest.approx(0.4 * (1 + Z * sd))
    two = _with_startup(base, st, {"cold:denoise": [0.5, 0.7]})
    assert cold_spread(two) == (STARTUP_PRIOR, False)
    # pooled over keys, each about its own mean: two keys of two samples make four
    pooled = _with_startup(base, {**st, "decode": 0.1, "cold:decode": 0.3},
                           {"cold:denoise": [0.5, 0.7], "cold:decode": [0.25, 0.35]})
    sd, measured = cold_spread(pooled)
    assert measured and sd == pytest.approx(spread([-0.25, 0.25, -0.25, 0.25], fitted=2))


def _band(value: float, rel: float):
    from chunkflow_planner.bands import Band

    return Band(rel=rel, low=value * (1 - rel), high=value * (1 + rel), measured=True, fits=["compute"])


def test_run3s_cold_first_denoise_falls_inside_the_band_made_again(workdir):
    """PixArt-Sigma's first denoise on a freshly started H100 (report-fresh1: libraries 0.0 cached) took 1.39 s, 0.91 s
    over the warm prediction, where calibrate's one cold process had paid 0.28 s over the warm start-up: +105%
    against a band to +49%. Its plan made again (the cold part at the prior spread) holds it; so does the report
    judged against that plan, and the generation's time (+74% against +53%) too."""
    from chunkflow.reports import load_reports

    hw = load_profile(PROFILE)
    old, new = load_plan(RUN / "plan-pixart-sigma.json"), _replanned("pixart-sigma", hw)
    data = json.loads((RUN / "report-fresh1-pixart-sigma.json").read_text())
    assert data["generation"]["libraries_cached"] == 0.0 and data["generation"]["warmup_generations"] == 0
    measured = data["generation"]["phases"]["denoise"]["measured_time_s"]
    assert not old.prediction.bands[DENOISE].contains(measured) and new.prediction.bands[DENOISE].contains(measured)
    assert new.prediction.bands[DENOISE].low == pytest.approx(old.prediction.bands[DENOISE].low)

    def verdicts(plan):
        data["plan"] = json.loads(plan.to_json())
        (workdir / "r.json").write_text(json.dumps(data))
        return load_reports([workdir / "r.json"])[0].bands

    was, now = verdicts(old), verdicts(new)
    for key in (DENOISE, "generation_time_s"):
        assert not was[key].inside and now[key].inside, key
        assert now[key].above > was[key].above and now[key].below == pytest.approx(was[key].below)


# ----------------------------------------------------------------------- cached against the machine's warm share


def test_a_run_counts_as_cached_against_the_machines_warm_share(workdir):
    """On the H100 a warm run had 0.32-0.33 of the libraries' bytes cached (files no generation reads count), a cold
    one 0.0: against the profile's warm share (0.33) a run at 0.32 started cached and is held to the edge without the
    fresh machine's part, one at 0.0 to the edge with it. A profile without the warm share keeps the rule of all the
    bytes: 0.32 is cold there, 0.9 cached."""
    from chunkflow.loading.libraries import were_cached
    from tests.test_startup_bands import cold_encode_plan, encode_inside

    assert were_cached(0.32, 0.33) and not were_cached(0.0, 0.33) and were_cached(None, 0.33) is None
    assert not were_cached(0.32, None) and were_cached(0.9, None)
    def inside(warm: float | None, cached: float | None) -> bool:
        return encode_inside(workdir, cold_encode_plan(warm), cached)

    assert not inside(0.33, 0.32) and inside(0.33, 0.0) and inside(0.33, None)
    assert inside(None, 0.32) and not inside(None, 0.9)


def test_refit_files_a_reports_gaps_cold_against_the_warm_share(tmp_path):
    """`calibrate --from-report`: a report that started at 0.32 of the libraries cached is a warm one's on a
    machine whose warm share is 0.33 (its gaps are `<phase>` samples), a freshly started one's without that share."""
    from chunkflow.commands.calibrate.refit import read_reports, refit
    from test_calibrate import _report
    from test_calibrate_fits import _generation, _with_errors

    data, _ = _report(tmp_path, "none", 1.0)
    g = _generation(0.0, {"encode": 0.0, "decode": 0.0})
    g.update(warmup_generations=1, first_phase_times_s={"encode": 2.5, "decode": 1.2}, libraries_cached=0.32)
    reports = read_reports([_with_errors(data, tmp_path / "r.json", generation=g)])
    hw = get_hardware("h200").model_copy(update={"peak_tflops": 1e-3, "eta_comp": 1e-3})  # as test_calibrate_fits
    keys = set(refit(hw.model_copy(update={"libraries_warm_share": 0.33}), reports)[0].pipeline.startup_s)
    assert {"encode", "decode"} <= keys and not {"cold:encode", "cold:decode"} & keys
    assert {"cold:encode", "cold:decode"} <= set(refit(hw, reports)[0].pipeline.startup_s)


def test_calibrate_records_the_libraries_warm_share_after_its_probes():
    """The start-up probes load the libraries their kernels use: the cached share after them is the profile's warm
    share, said in the log (on this machine torch's libraries are mapped by the test process: some are cached)."""
    from chunkflow.commands.calibrate.startup import calibrated_startup

    said: list[str] = []
    out, _ = calibrated_startup("tiny-wan", 1, "cpu", said.append)
    assert 0 < out["libraries_warm_share"] <= 1 and any("once warm" in s for s in said)
