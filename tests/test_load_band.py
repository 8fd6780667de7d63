"""The load's band from the load path measured by `calibrate --weights` (issue 55): a profile with a `load` fit gets
a load band centred on its bias, as wide as its spread and drift, without the prior or the path's fits moved again."""

from __future__ import annotations

import math

import pytest

from chunkflow_planner.bands import FITS, LOAD_DRIFT, LOAD_PATH_FITS, MODEL_PRIOR, Z, with_drift
from chunkflow_planner.catalog import FitQuality, HardwareSpec, ModelError, Workload, get_hardware, get_model
from chunkflow_planner.planner import ResolvedHardware, make_plan

KEYS = ("load.time_cold_s", "load.time_warm_s")


def _hw(load: FitQuality | None = None, errors: dict[str, ModelError] | None = None) -> HardwareSpec:
    """The h200 with a disk, every fit measured exactly (no drift) but the load path's own at 5%, and `load`."""
    fits = {n: FitQuality(samples=5, spread=0.05 if n in LOAD_PATH_FITS else 1e-12, drift=0.0, drift_pairs=1)
            for n in FITS if n != "load"}
    if load is not None:
        fits["load"] = load
    return get_hardware("h200").model_copy(update=dict(
        disk_read_gbps=1.5, page_cache_gbps=8.0, pin_gbps=6.0, host_fault_gbps=4.0, fits=fits,
        model_errors=errors or {}))


def _bands(hw: HardwareSpec) -> dict:
    w = Workload(batch=1, frames=1, height=1024, width=1024, steps=8)
    plan, _, _ = make_plan(get_model("flux"), w, ResolvedHardware(hw, "test"), budget=6 * 10**9,
                           host_budget=256 * 10**9)
    return plan.prediction.bands


def test_a_measured_load_fit_narrows_the_load_band_to_what_it_measured():
    before = _bands(_hw())
    load = FitQuality(samples=6, spread=0.03, bias=0.12, residuals=[0.10, 0.12, 0.15, 0.11, 0.12, 0.14],
                      source="test")
    after = _bands(_hw(load))
    half = Z * math.hypot(0.03, LOAD_DRIFT)  # its spread with the drift prior of a once-measured fit
    for key in KEYS:
        assert before[key].rel > MODEL_PRIOR["load_time"]  # the prior, widened by the path's fits
        band = after[key]
        assert band.fits[0] == "load" and band.measured and "load path measured" in band.model
        assert band.rel_high == pytest.approx(half + 0.12, rel=1e-4)  # nothing else moves it (others exact)
        assert band.rel_low == pytest.approx(half - 0.12, rel=1e-4)
        assert band.rel_low + band.rel_high < 0.7 * 2 * before[key].rel  # narrower: its width, not its high edge (the
        # bias moves that up as far as the prior's)
        assert band.holds(0.065) and band.holds(0.26)
        assert not band.holds(-0.1)  # centred on the bias: a load that fast is outside


def test_run_reports_of_the_load_stand_before_the_calibrated_path():
    load = FitQuality(samples=3, spread=0.01, bias=0.2, source="test")
    band = _bands(_hw(load, {"load_time": ModelError(samples=4, bias=0.05, spread=0.02)}))["load.time_cold_s"]
    assert band.rel_low is None and "run reports" in band.model
    assert band.rel >= 0.05 + Z * 0.02


def test_the_load_fit_drifts_by_its_ratio_and_reads_from_version_6_profiles():
    one, two = _hw(FitQuality(samples=3, spread=0.02, bias=0.10)), _hw(FitQuality(samples=3, spread=0.02, bias=0.21))
    assert with_drift(one, two).fits["load"].drift == pytest.approx(1.21 / 1.10 - 1)
    data = two.model_dump(mode="json")
    again = HardwareSpec.model_validate(data)
    assert again.fits["load"].bias == 0.21
    del data["fits"]["load"]
    old = HardwareSpec.model_validate({**data, "schema_version": 6})  # written before the bias and the load fit
    assert old.fits["pin"].bias == 0.0 and "load" not in old.fits


def test_calibrate_weights_times_the_load_path_and_records_its_fit(tmp_path):
    """A smoke run of `calibrate --weights` on a tiny saved folder: its load path timed and the `load` fit recorded
    (the numbers of a 0.2 MB sample mean nothing; that they are there, and from that folder, is what is checked)."""
    import json

    from typer.testing import CliRunner

    from chunkflow.commands.cli import app
    from chunkflow_planner.catalog import load_profile
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny", tmp_path / "tiny")
    out, raw = tmp_path / "p.yaml", tmp_path / "raw.json"
    result = CliRunner().invoke(app, ["calibrate", "--cpu-smoke", "--no-save", "--weights", str(folder), "--out",
                                      str(out), "--raw", str(raw), "--startup-processes", "0"])
    assert result.exit_code == 0, result.output
    path = json.loads(raw.read_text())["disk"]["load_path"]
    assert path["rows"] and all(p.startswith(str(folder)) for p in path["files"])
    q = load_profile(out).fits["load"]
    assert q.samples == len(path["rows"]) and q.source.endswith("against the load model")
    errors = [r["seconds"] / r["predicted_s"] - 1 for r in path["rows"]]
    assert q.residuals == pytest.approx(errors, abs=1e-6) and q.bias == pytest.approx(sorted(errors)[1], abs=1e-6)
