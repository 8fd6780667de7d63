"""calibrate's fits on scipy (issue 41): robust fits a stray sample does not move, each fit's quality in the profile
(FitQuality), the planner's errors from run reports (ModelError), the planner's own root finder against scipy's, and
a plan that never imports scipy."""

import json
import math
import random
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from chunkflow.commands.calibrate.fit import fit_h2d, fit_quality, spread_beyond_fit
from chunkflow.commands.calibrate.robust import about_median
from chunkflow.commands.cli import app
from chunkflow_planner import bands
from chunkflow_planner.catalog import get_hardware, load_profile

runner = CliRunner()
MB = 10**6
SIZES = [c * MB for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)]

pytestmark = pytest.mark.usefixtures("workdir")


def old_fit_h2d(sizes, times):
    """The fit calibrate used before scipy, kept in fit.py as the robust fit's start: least squares in relative error
    (the 2x2 normal equations), t0 < 0 refit as pure bandwidth."""
    from chunkflow.commands.calibrate.fit import _h2d_least_squares

    t0, a = _h2d_least_squares(sizes, times)
    return t0, 1.0 / a


def _copies(t0, bw, outliers, seed=0, repeats=3):
    """Per-copy times of every size `repeats` times, with 0.3% multiplicative noise, the samples at `outliers`
    3x slower."""
    rng = random.Random(seed)
    sizes = SIZES * repeats
    times = [(t0 + c / bw) * (1 + rng.gauss(0, 0.003)) for c in sizes]
    for i in outliers:
        times[i] *= 3
    return sizes, times


@pytest.mark.parametrize("outliers", [(0,), (0, 9), (0, 8)])  # a 1 MB copy, two of them, a 1 MB and a 256 MB one
def test_h2d_fit_is_not_moved_by_a_stray_slow_copy(outliers):
    t0, bw = 2.8e-6, 55e9
    sizes, times = _copies(t0, bw, outliers)
    fit = fit_h2d(sizes, times)
    assert fit.bw_Bps == pytest.approx(bw, rel=0.01)
    assert fit.t0_s == pytest.approx(t0, rel=0.15)
    old_t0, old_bw = old_fit_h2d(sizes, times)
    assert abs(old_t0 / t0 - 1) > 0.15  # the fit it replaced: one slow small copy moved t0 past the band above
    # every sample's measured / fitted - 1, in order: the slow copies ~+200%, the rest within the noise
    assert len(fit.residuals) == len(sizes)
    for i, r in enumerate(fit.residuals):
        assert (r == pytest.approx(2.0, abs=0.1)) if i in outliers else abs(r) < 0.02
    q = fit_quality("h2d", fit.residuals, "test")
    assert q.samples == len(sizes) and not q.flagged and q.spread < 0.01


def test_h2d_fit_without_outliers_matches_the_old_fit():
    sizes, times = _copies(2.8e-6, 55e9, ())
    fit, (t0, bw) = fit_h2d(sizes, times), old_fit_h2d(sizes, times)
    assert fit.bw_Bps == pytest.approx(bw, rel=2e-3) and fit.t0_s == pytest.approx(t0, rel=0.05)
    with pytest.raises(ValueError):
        fit_h2d([MB, MB], [1e-4, 1.1e-4])  # one size: no line


@pytest.mark.parametrize("case", ["equal", "falling"])
def test_h2d_copies_without_a_size_effect_get_the_pure_bandwidth(case):
    """Copies that take as long at every size (or less for larger ones) have no bandwidth to fit: the bounded solver
    leaves a slope near 0 (a bandwidth past any link), so the fit is the closed form's pure bandwidth, t0 = 0."""
    from chunkflow.commands.calibrate.fit import _pure_bandwidth
    from chunkflow_planner.catalog import H2D_GBPS_RANGE

    times = [1e-4] * len(SIZES) if case == "equal" else [1e-4 * (1.5 - i / len(SIZES)) for i in range(len(SIZES))]
    fit = fit_h2d(SIZES, times)
    assert fit.t0_s == 0 and fit.fitted == 1
    assert fit.bw_Bps == pytest.approx(1 / _pure_bandwidth(SIZES, times), rel=1e-12)
    assert H2D_GBPS_RANGE[0] <= fit.bw_Bps / 1e9 <= H2D_GBPS_RANGE[1]
    assert len(fit.residuals) == len(SIZES)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_h2d_fit_refuses_a_copy_that_was_not_timed(bad):
    from chunkflow.commands.calibrate.host import CalibrationError

    sizes, times = _copies(2.8e-6, 55e9, ())
    times[4] = bad
    with pytest.raises(CalibrationError, match="H2D copy 4 .* not finite"):
        fit_h2d(sizes, times)
    with pytest.raises(CalibrationError, match="not finite"):
        fit_h2d([bad] + sizes[1:], _copies(2.8e-6, 55e9, ())[1])


def test_vae_fit_is_not_moved_by_a_stray_slow_decode():
    """Decodes of known constants (20 ms + 5 ns/voxel; 2 GB + 12 B/px + 40 B/voxel) with noise and one decode 3x
    slower: the robust fit gives the constants back, where least squares in seconds (what the fit was before
    scipy) moves the constant time; each decode's residual kept, the slow one's ~+200%."""
    from chunkflow.commands.calibrate.ops import fit_vae, vae_residuals

    rng = random.Random(3)
    rows = []
    for f in (5, 13, 21, 41, 61):
        for h, w in ((256, 448), (480, 832)):
            vox, px = f * h * w, h * w
            rows.append(dict(batch=1, frames=f, height=h, width=w,
                             time_s=(0.02 + 5e-9 * vox) * (1 + rng.gauss(0, 0.003)),
                             peak_bytes=(2e9 + 12 * px + 40 * vox) * (1 + rng.gauss(0, 0.002))))
    rows[0]["time_s"] *= 3
    fit = fit_vae(rows, True, "test")
    assert fit["time_const"] == pytest.approx(0.02, rel=0.05)
    assert fit["time_per_voxel"] == pytest.approx(5e-9, rel=0.01)
    assert fit["mem_const"] == pytest.approx(2e9, rel=0.01) and fit["mem_per_voxel"] == pytest.approx(40, rel=0.02)
    import numpy as np

    A = np.array([[1.0, r["frames"] * r["height"] * r["width"]] for r in rows])
    t0_seconds, rate_seconds = np.linalg.lstsq(A, np.array([r["time_s"] for r in rows]), rcond=None)[0]
    assert abs(t0_seconds / 0.02 - 1) > 0.3 and abs(rate_seconds / 5e-9 - 1) > 0.05  # the old least squares
    time, mem = vae_residuals(rows, fit)
    assert len(time) == len(mem) == len(rows)
    assert time[0] == pytest.approx(2.0, abs=0.1) and max(abs(r) for r in time[1:]) < 0.02
    assert max(abs(r) for r in mem) < 0.02


def test_a_vae_fit_through_every_decode_gives_no_residuals():
    """As many decodes as coefficients: the fit passes through each, which says nothing of its spread; memory
    measured as 0 (the CPU) neither."""
    from chunkflow.commands.calibrate.ops import fit_vae, vae_residuals

    rows = [dict(batch=1, frames=1, height=s, width=s, time_s=0.01 + 1e-9 * s * s, peak_bytes=1e9 + 10 * s * s)
            for s in (512, 1024)]
    assert vae_residuals(rows, fit_vae(rows, False, "test")) == ([], [])
    rows.append(dict(batch=1, frames=1, height=768, width=768, time_s=0.011, peak_bytes=0))
    time, mem = vae_residuals(rows, fit_vae(rows, False, "test"))
    assert len(time) == 3 and mem == []


def test_mem_ops_scale_recovers_a_known_scale_past_a_stray_block():
    from chunkflow.commands.calibrate.ops import fit_mem_ops_scale
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.ops import block_ops, split

    hw = get_hardware("h200")
    spec = get_model("wan2.2")
    unit = hw.model_copy(update={"mem_ops_scale": 1.0})
    rows = []
    for S in (2000, 8000, 16000, 32000, 64000):
        a = b = 0.0
        for g in spec.blocks:
            x, y = split(block_ops(spec, g, 1, S, spec.text_len), unit)
            a, b = a + x, b + y
        rows.append(dict(model="wan2.2", tokens=S, batch=1, time_s=a + 1.7 * b))
    rows[-1]["time_s"] *= 2  # the largest block timed slow once: least squares in seconds would follow it
    assert fit_mem_ops_scale(rows, hw) == pytest.approx(1.7, rel=0.02)


def test_fit_quality_flags_a_wide_fit_with_what_to_repeat():
    rng = random.Random(1)
    wide = [rng.gauss(0, 0.2) for _ in range(40)]
    q = fit_quality("h2d", wide, "test")
    assert q.spread == pytest.approx(bands.spread(wide)) and q.spread > bands.FLAG_SPREAD
    assert q.flagged and q.repeat == bands.FITS["h2d"].repeat and q.samples == 40
    narrow = fit_quality("compute", [rng.gauss(0, 0.01) for _ in range(40)], "test")
    assert not narrow.flagged and narrow.repeat == ""
    assert fit_quality("cpu", [0.1], "test") is None  # one sample: no spread (the prior stands)
    many = [rng.gauss(0, 0.05) for _ in range(1000)]
    q = fit_quality("cpu", many, "test")
    assert q.samples == 1000 and len(q.residuals) == bands.MAX_RESIDUALS
    assert min(q.residuals) == pytest.approx(min(many), abs=1e-6) and max(q.residuals) == pytest.approx(max(many), abs=1e-6)
    assert bands.spread(q.residuals) == pytest.approx(q.spread, rel=0.05) and q.spread == pytest.approx(bands.spread(many))


def test_a_spread_counts_the_parameters_fitted_to_its_residuals():
    """Normal noise of a known sigma (3%) in groups of 3 repeats about their median: each median is one of its
    repeats (its residual 0) and pulls the others in, so the spread of every residual comes out at half sigma or
    less; counting a median fitted per group, about sigma. The same through 4-point fits of 3 coefficients (a VAE's
    decodes), pooled; and with no more residuals than parameters, no record."""
    import numpy as np

    rng = random.Random(5)
    sigma, groups = 0.03, 400
    res = [r for _ in range(groups) for r in about_median([1 + rng.gauss(0, sigma) for _ in range(3)])]
    assert fit_quality("compute", res, "test").spread < 0.6 * sigma
    q = fit_quality("compute", res, "test", fitted=groups)
    assert q.spread == pytest.approx(sigma, rel=0.2) and q.samples == 3 * groups
    x = np.array([1.0, 2.0, 3.0, 4.0])
    res = []
    for _ in range(300):
        y = (1 + x + 0.1 * x**2) * (1 + np.array([rng.gauss(0, sigma) for _ in x]))
        res += list(y / np.polyval(np.polyfit(x, y, 2, w=1 / y), x) - 1)
    assert fit_quality("vae_time", res, "test").spread < 0.6 * sigma
    assert fit_quality("vae_time", res, "test", fitted=3 * 300).spread == pytest.approx(sigma, rel=0.2)
    assert fit_quality("cpu", [0.01, -0.02, 0.0], "test", fitted=3) is None
    assert fit_quality("cpu", [0.01, -0.02, 0.0], "test", fitted=2).spread == pytest.approx(1.4826 * 0.02)
    assert spread_beyond_fit(res) == pytest.approx(bands.spread(res))  # nothing fitted: the plain spread


def test_the_compute_record_holds_each_whole_forwards_misfit():
    """Whole forwards 0% and 10% slower in compute than the curve says: the curve is scaled by their geometric mean,
    which leaves one short and one over; each one's misfit (measured / predicted with the scaled curve - 1) joins
    the `compute` record, whose repeats about their medians alone (0.1% jitter) said nothing of it. A scale outside
    FORWARD_SCALE_RANGE is not applied, and the misfit is against the curve as measured."""
    from chunkflow.commands.calibrate.fit import scale_to_forwards
    from chunkflow.commands.calibrate.measure import fit_records, forward_points
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.predict import predict

    spec, none = get_model("wan2.2"), OffloadConfig(mode="none")
    hw = get_hardware("h200").model_copy(update={"eta_comp_curves": {spec.name: [(1e12, 0.4), (1e15, 0.6)]}})
    points = forward_points(spec, hw, None)
    assert len(points) == 2

    def rows(slower):
        out = []
        for w, k in zip(points, slower):
            p = predict(spec, w, hw, none)
            t = p.step_time_s + (k - 1) * p.compute_s
            out.append(dict(model=spec.name, frames=w.frames, batch=w.batch, time_s=t,
                            samples_s=[t * 0.999, t, t * 1.001]))
        return out

    curve, fw = scale_to_forwards(spec, hw, rows([1.0, 1.1]))
    assert curve is not None and all(r["applied"] for r in fw) and fw[0]["scale"] == pytest.approx(1.1**-0.5)
    scaled = hw.model_copy(update={"eta_comp_curves": {spec.name: curve}})
    for w, r in zip(points, fw):
        assert r["misfit"] == pytest.approx(r["time_s"] / predict(spec, w, scaled, none).step_time_s - 1)
    assert fw[0]["misfit"] < -0.02 and fw[1]["misfit"] > 0.02
    far_curve, far = scale_to_forwards(spec, hw, rows([2.0, 2.0]))
    assert far_curve is None and not any(r["applied"] for r in far)
    assert far[0]["misfit"] == pytest.approx(far[0]["time_s"] / predict(spec, points[0], hw, none).step_time_s - 1)
    assert far[0]["misfit"] > 0.5

    blocks = [dict(samples_s=[0.999, 1.0, 1.001]) for _ in range(10)]
    h2d = fit_h2d(*_copies(2.8e-6, 55e9, ()))

    def record(forwards):
        return fit_records(h2d, blocks, forwards, {}, {}, None, None, None, "test", "today")["compute"]

    jitter, q = record([]), record(fw)
    assert jitter.spread < 0.002 and jitter.samples == 30
    assert q.samples == 30 + 6 + 2 and {round(r["misfit"], 6) for r in fw} <= set(q.residuals)
    timing = record([{k: v for k, v in r.items() if k != "misfit"} for r in fw])  # the forwards' repeats alone
    assert q.spread == pytest.approx(math.hypot(timing.spread, math.hypot(*(r["misfit"] for r in fw))))
    assert q.spread > 0.03 and "2 whole forward(s) against the curve" in q.source


def test_cpu_smoke_profile_records_its_fits(tmp_path):
    result = runner.invoke(app, ["calibrate", "--cpu-smoke", "--out", "smoke.yaml", "--no-save", "--raw", "raw.json"])
    assert result.exit_code == 0, result.output
    hw = load_profile(tmp_path / "smoke.yaml")
    assert {"h2d", "compute", "vae_time", "cpu", "text_host", "page_cache", "host_fault"} <= set(hw.fits)
    assert set(hw.fits) <= set(bands.FITS)
    # no GPU: no memory measured (a VAE's peak is 0), no page-locking, no codec decode, no collectives
    assert not {"vae_memory", "pin", "codec_decode", "collectives"} & set(hw.fits)
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert hw.fits["h2d"].samples == sum(len(r["samples_s"]) for r in raw["h2d"]) >= 2 * len(raw["h2d"])
    assert hw.fits["compute"].samples == sum(len(r["samples_s"]) for r in raw["blocks"] + raw["forwards"]) + sum(
        r["misfit"] is not None for r in raw["forwards"])  # each whole forward's misfit against the curve
    assert raw["forwards"] and all("misfit" in r for r in raw["forwards"])
    h2d_fitted = 2 if raw["h2d_fit"]["t0_us"] > 0 else 1
    assert hw.fits["h2d"].spread == pytest.approx(min(10.0, spread_beyond_fit(hw.fits["h2d"].residuals, h2d_fitted)),
                                                  rel=1e-3, abs=1e-5)
    for name, q in hw.fits.items():
        assert q.samples >= 2 and len(q.residuals) == min(q.samples, bands.MAX_RESIDUALS), name
        # the parameters fitted leave the smallest residuals out (spread_beyond_fit): never below the plain spread
        assert q.spread >= min(10.0, bands.spread(q.residuals)) - 1e-5, name
        assert q.flagged == (q.spread > bands.FLAG_SPREAD) and (q.repeat == bands.FITS[name].repeat) == q.flagged
    out = " ".join(result.output.split())
    assert "Fits" in out and all(name in out for name in hw.fits)
    for name, q in hw.fits.items():  # each flagged fit says what to measure again (the CPU is noisy: not a failure)
        assert (f"fit {name}: +-{q.spread * 100:.1f}% is too wide to plan with" in out) == q.flagged


# ---------------------------------------------------------------------------------- the planner's errors


def _reports(tmp_path):
    from test_calibrate import _report

    return _report(tmp_path, "none", 1.0), _report(tmp_path, "layerwise", 1.0)


def _with_errors(data, path, step=None, peak=None, generation=None):
    """The report with its measured step at (1 + step) x its prediction and the errors it states."""
    if step is not None:
        data["measured"]["median_step_s"] = (1 + step) * data["predicted"]["step_time_s"]
    data["rel_error"] = dict(step_time=step, peak_memory=peak)
    data["generation"] = generation
    path.write_text(json.dumps(data))
    return path


def _generation(time_err, phase_errs, host_err=None, load=None):
    phases = {name: dict(measured_time_s=1.0, time_error=e, memory_error=0.02) for name, e in phase_errs.items()}
    return dict(prompt="a cat", seed=0, steps=1, components={}, phases=phases, generation_time_s=3.0,
                generation_time_error=time_err, host_peak_bytes=10**9, host_memory_error=host_err, load=load)


def test_model_errors_from_reports_with_known_errors(tmp_path):
    """The errors the reports state, by kind: bias their median, spread 1.4826 x their MAD about it; a kind seen once
    keeps the prior's scatter about its bias."""
    from chunkflow.commands.calibrate.refit import model_errors, read_reports

    (none, p_none), (lw, p_lw) = _reports(tmp_path)
    p3 = tmp_path / "third.json"
    load = dict(weights="random", measured_time_s=2.0, host_peak_bytes=10**9, time_error=0.3, host_error=-0.04)
    _with_errors(none, p_none, step=0.10, peak=0.05, generation=_generation(0.08, {"encode": 0.2, "decode": -0.1}))
    _with_errors(lw, p_lw, step=0.20, generation=_generation(0.12, {"denoise": 0.0}, host_err=0.06, load=load))
    _with_errors(json.loads(p_lw.read_text()), p3, step=0.40)
    e = model_errors(read_reports([p_none, p_lw, p3]))
    assert set(e) == set(bands.QUANTITY_KINDS)
    assert e["step_time"].samples == 3 and e["step_time"].bias == pytest.approx(0.20)
    assert e["step_time"].spread == pytest.approx(1.4826 * 0.10)
    assert e["generation_time"].bias == pytest.approx(0.10) and e["generation_time"].spread == pytest.approx(1.4826 * 0.02)
    assert e["phase_time"].samples == 3 and e["phase_time"].bias == pytest.approx(0.0)
    assert e["phase_time"].spread == pytest.approx(1.4826 * 0.1)
    # peak memory: every phase's (0.02 each), not the steps' 0.05 of a generation's report (its steps' allocation
    # held the whole pipeline's tensors, not what the transformer's step peak predicts)
    assert e["peak_memory"].samples == 3 and e["peak_memory"].bias == pytest.approx(0.02)
    assert e["host_memory"].samples == 2 and e["host_memory"].bias == pytest.approx(0.01)
    assert e["load_time"].samples == 1 and e["load_time"].bias == pytest.approx(0.3)
    assert e["load_time"].spread == pytest.approx(bands.MODEL_PRIOR["load_time"] / bands.Z)


def test_refit_records_model_errors_against_the_refit_profile_where_it_re_predicts(tmp_path):
    """A `none` run 2x slower than planned: the refit halves eta_comp, and on the refit profile the run is predicted
    right (its step error 0), where the plan as made was 100% short; refitting another profile than the one the plan
    was priced on (the re-prediction would not be the plan's), the report's own error stands."""
    from chunkflow.commands.calibrate.refit import read_reports, refit
    from chunkflow_planner.catalog import HardwareSpec

    (none, p_none), _ = _reports(tmp_path)
    _with_errors(none, p_none, step=1.0)
    reps = read_reports([p_none])
    planned = HardwareSpec(**reps[0].plan.hardware.spec)
    new, notes = refit(planned, reps)
    assert new.eta_comp == pytest.approx(planned.eta_comp / 2, rel=1e-6)
    assert new.model_errors["step_time"].bias == pytest.approx(0.0, abs=1e-6)
    assert new.model_errors["step_time"].samples == 1 and any("planner's errors" in n for n in notes)
    other = planned.model_copy(update={"peak_tflops": planned.peak_tflops * 1.5, "name": "other"})
    new, _ = refit(other, reps)
    assert new.model_errors["step_time"].bias == pytest.approx(1.0)
    # through the CLI: the profile written keeps them, and says so
    result = runner.invoke(app, ["calibrate", "--from-report", str(p_none), "--out", "refit.yaml", "--no-save"])
    assert result.exit_code == 0, result.output
    saved = load_profile(tmp_path / "refit.yaml")
    assert saved.model_errors["step_time"].bias == pytest.approx(0.0, abs=1e-6)
    assert "The planner's errors" in " ".join(result.output.split())


def test_errors_from_one_report_spread_at_least_the_prior(tmp_path):
    """One report's phases scatter among themselves, not from run to run: from fewer than 2 reports a kind's spread
    is at least its prior scatter (MODEL_PRIOR / Z), a wider one kept; each record keeps its errors and reports."""
    from chunkflow.commands.calibrate.refit import model_errors, read_reports
    from test_calibrate import _report

    data, path = _report(tmp_path, "none", 1.0)
    _with_errors(data, path, step=0.1, generation=_generation(0.05, {"encode": 0.011, "denoise": 0.012, "decode": 0.01}))
    e = model_errors(read_reports([path]))["phase_time"]
    assert (e.samples, e.reports, e.errors) == (3, 1, [0.011, 0.012, 0.01]) and e.bias == pytest.approx(0.011)
    assert e.spread == pytest.approx(bands.MODEL_PRIOR["phase_time"] / bands.Z)  # measured: 1.4826 x 0.001
    _with_errors(data, path, step=0.1, generation=_generation(0.05, {"encode": 0.4, "denoise": 0.0, "decode": -0.4}))
    assert model_errors(read_reports([path]))["phase_time"].spread == pytest.approx(1.4826 * 0.4)


def test_refits_in_a_row_accumulate_the_planners_errors(tmp_path):
    """A second refit adds its reports' errors to those the profile kept: bias and spread over all of them, the
    reports summed (so the one-report floor no longer applies); a record written without its errors (before they
    were kept) is replaced, and still reads."""
    from chunkflow.commands.calibrate.refit import read_reports, refit
    from chunkflow_planner.catalog import HardwareSpec
    from test_calibrate import _report

    data, path = _report(tmp_path, "none", 1.0)
    planned = HardwareSpec(**read_reports([path])[0].plan.hardware.spec)
    _with_errors(data, path, step=0.1, generation=_generation(0.05, {"encode": 0.1, "decode": 0.3}))
    first, _ = refit(planned, read_reports([path]))
    assert first.model_errors["phase_time"].reports == 1
    _with_errors(data, path, step=0.1, generation=_generation(0.05, {"encode": 0.2, "decode": 0.6}))
    second, notes = refit(first, read_reports([path]))
    e = second.model_errors["phase_time"]
    assert e.errors == [0.1, 0.3, 0.2, 0.6] and (e.samples, e.reports) == (4, 2)
    assert e.bias == pytest.approx(0.25) and e.spread == pytest.approx(1.4826 * 0.1)
    assert "2 of them kept from an earlier refit" in e.source
    assert second.model_errors["generation_time"].errors == [0.05, 0.05]
    assert HardwareSpec(**second.model_dump()) == second  # the profile written reads back
    old = HardwareSpec(**{**planned.model_dump(), "model_errors": {"phase_time": dict(samples=5, bias=0.5, spread=0.1)}})
    assert old.model_errors["phase_time"].errors == [] and old.model_errors["phase_time"].reports == 1
    replaced = refit(old, read_reports([path]))[0].model_errors["phase_time"]
    assert replaced.errors == [0.2, 0.6] and replaced.reports == 1 and replaced.bias == pytest.approx(0.4)


def test_refit_records_the_quality_of_block_overhead_and_startup(tmp_path):
    """Three hidden-regime offload runs 90, 100 and 120 us a block over their `none` run: block_overhead_us 100 and
    its record, each gap / 100 - 1 with the one value fitted; startup_s from two reports run with --warmup, each
    phase's gap about its median (two values fitted). One sample of each gives no record: the prior stays."""
    from chunkflow.commands.calibrate.fit import spread_beyond_fit
    from chunkflow.commands.calibrate.refit import read_reports, refit
    from test_calibrate import _report

    hw = get_hardware("h200").model_copy(update={"peak_tflops": 1e-3, "eta_comp": 1e-3})  # hidden, as test_calibrate
    _, p_none = _report(tmp_path, "none", 1.0)
    lw, p_lw = _report(tmp_path, "layerwise", 1.0)
    paths = []
    for us in (90, 100, 120):  # 2 streamed blocks, 2 forwards a step
        lw["measured"]["median_step_s"] = 1.0 + 2 * 2 * us * 1e-6
        paths.append(tmp_path / f"lw{us}.json")
        paths[-1].write_text(json.dumps(lw))
    new, _ = refit(hw, read_reports([p_none, *paths]))
    assert new.block_overhead_us == pytest.approx(100.0, rel=1e-6)
    q = new.fits["block_overhead"]
    assert q.samples == 3 and q.residuals == pytest.approx([-0.1, 0.0, 0.2], abs=1e-6)
    assert q.spread == pytest.approx(spread_beyond_fit([-0.1, 0.0, 0.2], 1)) and "3 hidden-regime" in q.source
    assert "block_overhead" not in refit(hw, read_reports([p_none, paths[0]]))[0].fits  # one gap

    data, path = _report(tmp_path, "none", 1.0)
    gens = []
    for i, (enc, dec) in enumerate(((0.5, 0.2), (0.7, 0.4))):
        g = _generation(0.0, {"encode": 0.0, "decode": 0.0})
        g.update(warmup_generations=1, first_phase_times_s={"encode": 1.0 + enc, "decode": 1.0 + dec})
        gens.append(_with_errors(data, tmp_path / f"warm{i}.json", generation=g))
    new, _ = refit(hw, read_reports(gens))
    assert new.pipeline.startup_s["encode"] == pytest.approx(0.6) and new.pipeline.startup_s["decode"] == pytest.approx(0.3)
    q = new.fits["startup"]
    expected = [-1 / 6, -1 / 3, 1 / 6, 1 / 3]
    assert q.samples == 4 and sorted(q.residuals) == pytest.approx(sorted(expected), abs=1e-6)
    assert q.spread == pytest.approx(spread_beyond_fit(expected, 2)) and q.spread == pytest.approx(1.4826 / 3)
    assert "startup" not in refit(hw, read_reports(gens[:1]))[0].fits  # one report: as many gaps as values
    # a process that started with its libraries out of the page cache: a freshly started machine's samples
    g = _generation(0.0, {"encode": 0.0, "decode": 0.0})
    g.update(warmup_generations=1, first_phase_times_s={"encode": 2.5, "decode": 1.2}, libraries_cached=0.1)
    cold, _ = refit(hw, read_reports([*gens, _with_errors(data, tmp_path / "cold.json", generation=g)]))
    assert cold.pipeline.startup_s["cold:encode"] == pytest.approx(1.5) and cold.pipeline.startup_s["cold:decode"] \
        == pytest.approx(0.2)
    assert cold.pipeline.startup_s["encode"] == pytest.approx(0.6) and cold.fits["startup"].samples == 4


# ---------------------------------------------------------------------------------- the planner's Brent


def _f_star_problem(curve, B):
    """T_comp(F) - T_pref in log F on a profile with an eta_comp(F) curve: what F_star_hw finds the root of."""
    from chunkflow_planner.overlap import T_comp_hw, T_pref

    hw = get_hardware("h200").model_copy(update={"eta_comp_curve": curve})
    tp = T_pref(B, hw.h2d_gbps * 1e9, hw.eta_pref)
    return hw, (lambda logF: T_comp_hw(math.exp(logF), hw) - tp), math.log(1.0), math.log(1e30)


@pytest.mark.parametrize("case", ["cubic", "tiny root", "steep", "flat then steep", "kinked", "F_star", "F_star flat"])
def test_the_planners_brent_agrees_with_scipys_brentq(case):
    from scipy.optimize import brentq

    from chunkflow_planner.overlap import F_star_hw, brent

    f, lo, hi = {
        "cubic": (lambda x: x**3 - 2, 0.0, 2.0),
        "tiny root": (lambda x: x - 1e-9, 0.0, 1e6),
        "steep": (lambda x: math.exp(50 * x) - 1e10, -1.0, 1.0),
        "flat then steep": (lambda x: x**9 - 0.5, 0.0, 1.0),
        "kinked": (lambda x: abs(x - 0.3) ** 0.5 * (1 if x > 0.3 else -1) + 0.1, 0.0, 1.0),
        "F_star": None, "F_star flat": None,
    }.get(case) or (None, None, None)
    if f is None:
        curve = [(1e11, 0.3), (1e12, 0.45), (1e13, 0.6)] if case == "F_star" else [(1e9, 0.05), (1e15, 0.06)]
        hw, f, lo, hi = _f_star_problem(curve, 327e6)
        assert math.log(F_star_hw(hw, 327e6)) == pytest.approx(brentq(f, lo, hi, xtol=1e-14, rtol=1e-14), rel=1e-10)
    ours = brent(f, lo, hi, xtol=1e-14, rtol=1e-14)
    theirs = brentq(f, lo, hi, xtol=1e-14, rtol=1e-14)
    assert ours == pytest.approx(theirs, rel=1e-10, abs=1e-13)
    assert abs(f(ours)) <= abs(f(theirs)) * 10 + 1e-12 * max(abs(f(lo)), abs(f(hi)))


# ---------------------------------------------------------------------------------- the planner without scipy


@pytest.mark.slow
def test_plan_imports_no_scipy_in_importtime():
    """`python -X importtime` lists every module a command imports: `chunkflow plan` lists no scipy (nor torch);
    calibrate's fit module, imported the same way, does not either until a fit runs (scipy is imported inside)."""
    import os
    from pathlib import Path

    import chunkflow

    src = str(Path(chunkflow.__file__).parents[1])  # the subprocess imports the chunkflow this test does
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))

    def imported(code):
        out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                             check=True, env=env)
        return [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]

    plan = imported("from chunkflow.commands.cli import app; from typer.testing import CliRunner; "
                    "r = CliRunner().invoke(app, ['plan', '--model', 'flux', '--mem-budget', '24GB', "
                    "'--host-mem-budget', '64GB', '--json']); assert r.exit_code == 0, r.output")
    assert any(m.startswith("chunkflow_planner.planner") for m in plan)  # the listing is there
    assert not [m for m in plan if m.split(".")[0] in ("scipy", "torch")]
    fit = imported("import chunkflow.commands.calibrate.fit")
    assert "chunkflow.commands.calibrate.fit" in fit and not [m for m in fit if m.split(".")[0] == "scipy"]
    fitted = imported("from chunkflow.commands.calibrate.fit import fit_h2d; fit_h2d([1e6, 2e6, 4e6], [1e-4, 2e-4, 4e-4])")
    assert any(m.split(".")[0] == "scipy" for m in fitted)  # the check can see scipy when it is imported


def test_refit_refines_the_startup_calibrate_measured_over_cold_processes(tmp_path):
    """A profile whose start-up calibrate measured in cold processes (decode 0.2 and 0.4 s) refit from two reports
    run with --warmup (decode gaps 0.3 and 0.5 s): every sample kept, the figure their mean 0.35 s, the `startup`
    fit every sample's spread about its key's mean; a key the reports do not measure keeps its samples."""
    from chunkflow.commands.calibrate.refit import read_reports, refit
    from chunkflow.commands.calibrate.startup import startup_record
    from test_calibrate import _report

    means, samples, q = startup_record({}, {"decode": [0.2, 0.4], "denoise": [1.0, 1.0]}, "cold processes")
    hw = get_hardware("h200").model_copy(update={"peak_tflops": 1e-3, "eta_comp": 1e-3})
    hw = hw.model_copy(update={"pipeline": hw.pipeline.model_copy(update={"startup_s": means,
                                                                          "startup_samples_s": samples}),
                               "fits": {**hw.fits, "startup": q}})
    data, _ = _report(tmp_path, "none", 1.0)
    gens = []
    for i, dec in enumerate((0.3, 0.5)):
        g = _generation(0.0, {"decode": 0.0})
        g.update(warmup_generations=1, first_phase_times_s={"decode": 1.0 + dec})
        gens.append(_with_errors(data, tmp_path / f"warm{i}.json", generation=g))
    new, notes = refit(hw, read_reports(gens))
    assert new.pipeline.startup_samples_s["decode"] == pytest.approx([0.2, 0.4, 0.3, 0.5])
    assert new.pipeline.startup_s["decode"] == pytest.approx(0.35) and new.pipeline.startup_s["denoise"] == 1.0
    assert new.pipeline.startup_samples_s["denoise"] == [1.0, 1.0]
    expected = sorted([0.0, 0.0, *(x / 0.35 - 1 for x in (0.2, 0.4, 0.3, 0.5))])  # denoise's samples stay in it
    assert sorted(new.fits["startup"].residuals) == pytest.approx(expected, abs=1e-6)
    assert "4 sample(s)" in " ".join(notes) and "earlier samples" in new.fits["startup"].source
