"""Bands on a plan's predictions (issue 41): from the profile's fits and the planner's own error, in the plan file
and its tables, and run reports' inside/outside verdicts."""

from __future__ import annotations

import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow_planner.bands import FIRST_AND_WARM, FITS, MODEL_PRIOR, QUANTITY_KINDS, Z, kind_of
from chunkflow_planner.reprice import prediction_values
from chunkflow_planner.catalog import FitQuality, ModelError, Workload, get_hardware, get_model
from chunkflow_planner.plan import load_plan
from chunkflow_planner.planner import ResolvedHardware, make_plan
from chunkflow_planner.policy import Levers

runner = CliRunner()


def _hw(spreads: dict[str, float] | float | None = None, errors: dict[str, tuple[float, float]] | None = None,
        name: str = "h200", **update):
    """The catalog profile `name` with every fit measured at `spreads` (one spread for all, or by fit; None: the
    catalog's own, none measured) and calibrated again without moving (drift 0 over one pair), and the planner's
    errors `errors` (kind -> bias, spread)."""
    hw = get_hardware(name)
    if spreads is not None:
        # the load fit is the load model's own error, not a fit that moves figures: measured only where named
        each = spreads if isinstance(spreads, dict) else {n: spreads for n in FITS if n != "load"}
        update["fits"] = {n: FitQuality(samples=5, spread=s, drift=0.0, drift_pairs=1) for n, s in each.items()}
    if errors is not None:
        update["model_errors"] = {k: ModelError(samples=4, bias=b, spread=s) for k, (b, s) in errors.items()}
    return ResolvedHardware(hw.model_copy(update=update), "test")


def _plan(hw, model="flux", budget=6 * 10**9, **kw):
    w = kw.pop("workload", None) or Workload(batch=1, frames=1, height=1024, width=1024, steps=8)
    if kw.get("pipeline", True):
        kw.setdefault("host_budget", 256 * 10**9)  # not this machine's memory: the same plan anywhere
    plan, _, _ = make_plan(get_model(model), w, hw, budget=budget, **kw)
    return plan


CODEC = Levers(codecs=("exponent-pack",))  # the streamed bytes encoded: the codec's figures price the plan
WAN = Workload(batch=1, frames=81, height=480, width=832, steps=4, cfg_passes=2)
CASES = [  # the plan's kinds: the whole pipeline (streamed, codec), the transformer alone (with and without a host
    # budget), SP over two GPUs, two experts under a host budget that puts one on disk
    dict(),
    dict(pipeline=False, target_step_time=2.0),
    dict(pipeline=False, target_step_time=2.0, host_budget=16 * 10**9, disk=1.5),
    dict(model="wan2.1-14b", workload=WAN, sp=2, budget=16 * 10**9, hw_name="h200-x2"),
    dict(model="wan2.2-a14b", workload=WAN, budget=24 * 10**9, host_budget=48 * 10**9, disk=1.5),
]


@pytest.mark.parametrize("case", CASES, ids=["pipeline", "transformer", "transformer-host", "sp2", "experts-disk"])
def test_priced_again_on_its_own_profile_a_plan_is_its_own_centre(case):
    """With every fit measured at a vanishing spread, each band is the planner's own error alone: so pricing the
    plan again (its placements, chunk and residency held) reproduces every prediction it made."""
    case = dict(case)
    name, disk = case.pop("hw_name", "h200"), case.pop("disk", None)
    extra = {"disk_read_gbps": disk, "page_cache_gbps": 8.0} if disk else {}
    plan = _plan(_hw(1e-12, name=name, **extra), **case)
    bands = plan.prediction.bands
    assert {"step_time_s", "peak_memory_bytes"} <= bands.keys()
    if case.get("pipeline", True):
        assert {"generation_time_s", "host_memory_bytes", "phases.denoise.time_s", "phases.decode.peak_memory_bytes",
                "load.host_peak_bytes"} <= bands.keys()
    if disk and not case.get("pipeline", True):
        assert plan.offload.disk_blocks > 0 and "host_memory_bytes" in bands
    elif disk:
        assert {"load.time_cold_s", "load.time_warm_s"} <= bands.keys()
        assert any(c.placement == "disk" or c.disk_read_bytes for c in plan.pipeline.components)
    if case.get("sp"):
        assert "load.host_peak_per_host_bytes" in bands
    values = prediction_values(plan)
    for key, band in bands.items():
        if band.startup_s is not None:  # a first generation's time: its warm band moved up by its start-up, exactly
            warm = bands[dict(FIRST_AND_WARM)[key]]
            s = values[key] - values[dict(FIRST_AND_WARM)[key]]
            assert band.startup_s == pytest.approx((0.0, s)) and band.low == pytest.approx(warm.low), key
            assert band.high == pytest.approx(warm.high + s), key  # one-sided: the start-up adds above alone
            continue
        # a repricing off by 3e-4 of the plan's value would show: sqrt(m^2 + d^2) - m = 6e-7, 9e-6 of m
        assert band.rel == pytest.approx(MODEL_PRIOR[kind_of(key)], rel=1e-8), key
        assert band.model.startswith("prior") and band.measured and not band.supposed


def test_with_no_fit_spread_a_band_is_the_error_the_run_reports_measured():
    errors = {k: (0.01 * (i + 1), 0.005 * (i + 1)) for i, k in enumerate(QUANTITY_KINDS)}
    plan = _plan(_hw(0.0, errors))
    for key, band in plan.prediction.bands.items():
        bias, spread = errors[kind_of(key)]
        if band.startup_s is not None:  # a first generation's: its warm band's edges plus the start-up, no spread
            assert band.startup_s[0] == 0.0 and band.startup_s[1] > 0 and band.high > band.low
            continue
        assert band.rel == pytest.approx(abs(bias) + Z * spread, rel=1e-9), key
        assert band.model.startswith(f"{kind_of(key)} from run reports") and band.measured
        value = band.low / (1 - band.rel)
        assert band.high == pytest.approx(value * (1 + band.rel)) and band.contains(value)


def test_a_fit_widens_the_bands_of_what_it_prices_and_no_others():
    """FLUX at 6 GB streams most of its weights each step (copy-bound): the H2D fit's spread moves its step time and
    the generation, not its GPU or host memory; the compute fit's moves the step little."""
    quiet = {n: 0.0 for n in FITS}
    errors = {k: (0.0, 0.0) for k in QUANTITY_KINDS}
    narrow = _plan(_hw({**quiet, "h2d": 0.01}, errors)).prediction.bands
    wide = _plan(_hw({**quiet, "h2d": 0.05}, errors)).prediction.bands
    assert wide["step_time_s"].rel > 3 * narrow["step_time_s"].rel > 0
    assert wide["step_time_s"].fits == ["h2d"] and wide["generation_time_s"].rel > narrow["generation_time_s"].rel
    for key in ("peak_memory_bytes", "host_memory_bytes", "phases.denoise.peak_memory_bytes"):
        assert wide[key].rel == 0.0 and key in wide
    compute = _plan(_hw({**quiet, "compute": 0.05}, errors)).prediction.bands
    assert compute["step_time_s"].rel < wide["step_time_s"].rel / 3  # copies bound it, not compute
    assert compute["peak_memory_bytes"].rel == 0.0
    # everything on the GPU (80 GB): the step is compute alone, the copies do not price it
    on_gpu = {n: _plan(_hw({**quiet, n: 0.05}, errors), budget=80 * 10**9).prediction.bands["step_time_s"]
              for n in ("compute", "h2d")}
    assert on_gpu["compute"].rel == pytest.approx(1 / (1 - Z * 0.05) - 1, rel=1e-6)  # time goes as 1 / rate
    assert on_gpu["h2d"].rel == 0.0


def test_a_fit_the_profile_never_measured_counts_at_its_prior_and_the_band_says_so():
    measured = _plan(_hw(0.02)).prediction.bands["step_time_s"]
    catalog = _plan(_hw()).prediction.bands["step_time_s"]
    assert measured.measured and not catalog.measured
    assert catalog.fits and all(f in FITS for f in catalog.fits)


def test_the_plan_file_carries_its_bands_and_reads_back(workdir):
    tmp_path = workdir
    result = runner.invoke(app, ["plan", "--model", "flux", "--height", "1024", "--width", "1024", "--steps", "8",
                                 "--mem-budget", "6GB", "--hardware", "h200", "--out", "p.json"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["schema_version"] == 7  # 7: blocks kept whole; 6: the step cache (issue 54); 5: the stored format; bands in 4
    step = data["prediction"]["bands"]["step_time_s"]
    assert step["low"] < data["prediction"]["step_time_s"] < step["high"] and 0 < step["rel"] < 0.5
    plan = load_plan(tmp_path / "p.json")
    assert plan.prediction.bands["step_time_s"].rel == step["rel"]
    # the tables show them compactly: the chosen step, each phase, the generation, host memory
    out = " ".join(result.output.split())
    pct = f"+-{step['rel'] * 100:.1f}%".replace(".0%", "%") if step["rel"] < 0.095 else f"+-{step['rel'] * 100:.0f}%"
    assert pct in out
    gen = data["prediction"]["bands"]["generation_time_s"]  # a first generation: its start-up only adds
    above, below = gen["rel_high"] * 100, gen["rel_low"] * 100
    assert above > below and gen["startup_s"][0] < gen["startup_s"][1]
    assert re.search(rf"\+{above:.0f}%/-{below:.1f}%|\+{above:.0f}%/-{below:.0f}%", out.replace(".0%", "%"))
    assert "bands (+-)" in out and "chunkflow calibrate --from-report" in out
    # a plan of schema 3 (no bands) still reads, with none
    del data["prediction"]["bands"]
    data["schema_version"] = 3
    (tmp_path / "p3.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "p3.json").prediction.bands == {}


def test_a_profile_that_measured_everything_says_no_prior_stood_in():
    from chunkflow.commands.plan_tables import bands_note

    plan = _plan(_hw(0.01, {k: (0.0, 0.02) for k in QUANTITY_KINDS}))
    note = bands_note(plan)
    assert "prior" not in note and "from run reports for generation_time, host_memory" in note
    assert "prior spreads stood in" in bands_note(_plan(_hw()))
    # a fit calibrate flagged is said, with what to measure again
    wide = _hw(0.01).spec.fits | {"h2d": FitQuality(samples=9, spread=0.2, flagged=True, repeat=FITS["h2d"].repeat)}
    note = bands_note(_plan(ResolvedHardware(_hw(0.01).spec.model_copy(update={"fits": wide}), "test")))
    assert "flagged as too wide to plan with: h2d (+-20% a sample; measure again: the H2D copies" in note


def _gpu_report(tmp_path):
    """A real tiny run report, made to look measured on a GPU (a CPU run of a GPU plan compares no time)."""
    result = runner.invoke(app, ["plan", "--model", "tiny", "--out", "plan.json"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["run", "--plan", "plan.json", "--steps", "1", "--report", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    data["gpu"], data["run"]["device"] = "NVIDIA H200", "cuda:0"
    return data, out


def test_a_run_report_says_whether_each_measurement_fell_inside_its_band(workdir):
    tmp_path = workdir
    from chunkflow.commands.plan_tables import print_run
    from chunkflow.reports import load_reports

    data, path = _gpu_report(tmp_path)
    band = data["plan"]["prediction"]["bands"]["step_time_s"]["rel"]
    data["rel_error"] = {"step_time": band / 2, "peak_memory": -3 * data["plan"]["prediction"]["bands"][
        "peak_memory_bytes"]["rel"]}
    path.write_text(json.dumps(data))
    report = load_reports([path])[0]
    v = report.bands
    assert v["step_time_s"].inside and v["step_time_s"].band == band
    assert not v["peak_memory_bytes"].inside
    written = json.loads(report.model_dump_json())
    assert written["bands"]["peak_memory_bytes"]["inside"] is False  # the verdict is in the report file
    console = Console(record=True, width=200)
    print_run(console, report)
    text = console.export_text()
    assert "Measured against the plan's bands" in text and "1 of 2 measurements inside their bands" in text
    assert "outside: peak memory (allocated)" in text
    # a plan without bands gives no verdict
    del data["plan"]["prediction"]["bands"]
    data["plan"]["schema_version"] = 3
    path.write_text(json.dumps(data))
    assert load_reports([path])[0].bands == {}


def test_a_cpu_run_of_a_gpu_plan_gives_no_time_verdict(workdir):
    tmp_path = workdir
    from chunkflow.reports import load_reports

    result = runner.invoke(app, ["plan", "--model", "tiny", "--out", "plan.json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["run", "--plan", "plan.json", "--steps", "1", "--report", "r.json"])
    assert result.exit_code == 0, result.output
    report = load_reports([tmp_path / "r.json"])[0]
    assert "step_time_s" not in report.bands


def test_a_profile_names_only_fits_and_kinds_the_planner_knows(tmp_path):
    """Every fit bands.py prices is one a profile may record, and a profile recording another (a typo, a newer
    chunkflow's) is refused on reading, naming it, rather than its spread silently ignored."""
    import yaml

    from chunkflow_planner.catalog import FIT_NAMES, CatalogError, load_profile

    assert tuple(FITS) == FIT_NAMES
    data = get_hardware("h200").model_dump(mode="json")
    for field, bad in (("fits", {"h2dd": {"samples": 3, "spread": 0.1}}),
                       ("model_errors", {"step": {"samples": 3, "bias": 0.0, "spread": 0.1}})):
        path = tmp_path / f"{field}.yaml"
        path.write_text(yaml.safe_dump({**data, field: bad}))
        with pytest.raises(CatalogError, match=f"{field}"):
            load_profile(path)


def test_a_band_wider_than_its_prediction_starts_at_zero():
    plan = _plan(_hw(0.0, {k: (2.0, 0.0) for k in QUANTITY_KINDS}))
    band = plan.prediction.bands["step_time_s"]
    assert band.rel == pytest.approx(2.0) and band.low == 0.0 and band.contains(0.0)


def test_figures_the_planner_supposes_count_at_their_priors():
    """Without a measured VAE decode or codec ratio the planner prices the catalog's decode fit and the supposed
    ratio: their bands move them at their priors, and say so (not "measured")."""
    plan = _plan(_hw(), levers=CODEC)
    bands = plan.prediction.bands
    assert plan.offload.codec != "none" and not plan.prediction.codec_ratio_measured
    assert "vae_time" in bands["phases.decode.time_s"].supposed and not bands["phases.decode.time_s"].measured
    assert "codec_ratio" in bands["pinned_host_bytes"].supposed


def test_a_measured_codec_ratio_near_one_still_plans():
    """A ratio of 0.99 moved by its spread would pass 1 (more bytes than raw): it is held at 1, and the plan made."""
    plan = _plan(_hw(codec_ratio=0.99), levers=CODEC)
    assert plan.offload.codec == "exponent-pack" and plan.prediction.codec_ratio == 0.99
    assert "codec_ratio" in plan.prediction.bands["pinned_host_bytes"].supposed
    assert all(b.rel < 1 for b in plan.prediction.bands.values() if b.startup_s is None)


def test_after_a_warm_up_a_run_is_held_to_the_warm_bands(workdir):
    """A generation after --warmup compares times without start-up: they are held to bands without its spread."""
    from chunkflow.reports import load_reports

    plan = _plan(_hw())
    bands = plan.prediction.bands
    for phase in ("encode", "decode"):
        assert bands[f"phases.{phase}.warm_time_s"].rel < bands[f"phases.{phase}.time_s"].rel
        assert "startup" not in bands[f"phases.{phase}.warm_time_s"].fits
    assert bands["generation_warm_time_s"].rel < bands["generation_time_s"].rel
    assert {kind_of(k) for k in ("generation_warm_time_s", "phases.decode.warm_time_s")} == {"generation_time",
                                                                                            "phase_time"}
    data, path = _gpu_report(workdir)
    data["plan"] = json.loads(plan.to_json())
    warm = bands["phases.encode.warm_time_s"].rel
    phase = dict(measured_time_s=1.0, time_error=(warm + bands["phases.encode.time_s"].rel) / 2)
    data["generation"] = dict(prompt="p", seed=0, steps=8, components={}, phases={"encode": phase},
                              generation_time_s=1.0, host_peak_bytes=1, warmup_generations=1)
    path.write_text(json.dumps(data))
    v = load_reports([path])[0].bands["phases.encode.time_s"]
    assert v.band == warm and not v.inside  # inside the first generation's band, outside the warm one's
    data["generation"]["warmup_generations"] = 0
    path.write_text(json.dumps(data))
    v = load_reports([path])[0].bands["phases.encode.time_s"]
    assert v.band == bands["phases.encode.time_s"].rel and v.inside
    # a generation's steps ran inside the whole pipeline: the transformer's step peak is not held to its band, nor
    # refit from, even where an older report kept its error (H200, 2026-12-04: the denoise phase allocated 5.72 GB
    # against the transformer's 2.90 GB step peak, "+97%", with that phase's own peak -1.5% of its prediction)
    from chunkflow.commands.calibrate.refit import report_errors

    data["rel_error"]["peak_memory"] = 0.97
    path.write_text(json.dumps(data))
    rep = load_reports([path])[0]
    assert "peak_memory_bytes" not in rep.bands and "phases.encode.time_s" in rep.bands
    assert "peak_memory" not in report_errors(rep)
    del data["generation"]
    path.write_text(json.dumps(data))
    rep = load_reports([path])[0]
    assert not rep.bands["peak_memory_bytes"].inside and report_errors(rep)["peak_memory"] == [0.97]


def test_a_cpu_plan_bands_its_memory_not_its_nominal_times(workdir):
    """On the CPU a plan's times are nominal figures, not predictions: no band on them, in the file or the tables;
    its memory (host memory there) keeps its bands."""
    result = runner.invoke(app, ["plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--out",
                                 "p.json"])
    assert result.exit_code == 0, result.output
    bands = json.loads((workdir / "p.json").read_text())["prediction"]["bands"]
    assert bands and not [k for k in bands if k.endswith("_s")]
    assert {"peak_memory_bytes", "host_memory_bytes"} <= bands.keys()
    out = " ".join(result.output.split())
    assert re.search(r"[\d.]+ (ms|us|s) \+-", out) is None and re.search(r"(MB|KB) \+-[\d.]+%", out)


def _measured(hw, **fits):
    """`hw` with the named fits measured (spread 2%, calibrated once unless a drift is given)."""
    return hw.model_copy(update={"fits": {n: FitQuality(samples=9, spread=0.02, **kw) for n, kw in fits.items()}})


def test_calibrating_again_measures_how_far_each_fit_moved():
    from chunkflow_planner.bands import drift_between, with_drift

    base = get_hardware("h200")
    pipe = base.pipeline.model_copy(update={"text_layer_host_us": {"umt5_encoder": 1000.0, "t5_encoder": 800.0},
                                            "cpu_tflops": 5.0})
    first = _measured(base.model_copy(update={"pipeline": pipe}), text_host={}, cpu={}, h2d={}, codec_decode={})
    moved_pipe = pipe.model_copy(update={"text_layer_host_us": {"umt5_encoder": 800.0, "t5_encoder": 960.0},
                                         "cpu_tflops": 6.0})
    second = _measured(first.model_copy(update={"pipeline": moved_pipe}), text_host={}, cpu={}, h2d={}, compute={})
    moved = drift_between(first, second)
    # text_host: -20% and +20% (a root mean square, not a mean that cancels); cpu +20%; h2d unmoved; the codec and
    # compute fits were measured by one calibration only: nothing to compare
    assert moved == pytest.approx({"text_host": 0.2, "cpu": 0.2, "h2d": 0.0})
    again = with_drift(first, second)
    assert again.fits["text_host"].drift == pytest.approx(0.2) and again.fits["text_host"].drift_pairs == 1
    assert again.fits["compute"].drift is None and again.fits["compute"].drift_pairs == 0
    # a third calibration pools its change with the pair before (a mean of squares over the pairs)
    third_pipe = moved_pipe.model_copy(update={"cpu_tflops": 6.0 * 1.1})
    third = with_drift(again, _measured(again.model_copy(update={"pipeline": third_pipe}), cpu={}, vae_time={}))
    assert third.fits["cpu"].drift == pytest.approx(((0.2**2 + 0.1**2) / 2) ** 0.5)
    assert third.fits["cpu"].drift_pairs == 2 and third.fits["vae_time"].drift is None


def test_a_once_calibrated_fit_carries_its_drift_prior_and_a_measured_drift_replaces_it():
    from chunkflow_planner.bands import spread_of

    hw = _measured(get_hardware("h200"), text_host={}, cpu={"drift": 0.03, "drift_pairs": 2})
    assert spread_of(hw, "text_host") == (pytest.approx((0.02**2 + FITS["text_host"].drift_prior**2) ** 0.5), True)
    assert spread_of(hw, "cpu") == (pytest.approx((0.02**2 + 0.03**2) ** 0.5), True)
    assert spread_of(hw, "h2d") == (FITS["h2d"].prior, False)  # never measured: its prior, a total
    # FLUX's encode phase dispatches T5's layers from the host: its band narrows once a small drift is measured
    errors = {k: (0.0, 0.0) for k in QUANTITY_KINDS}
    quiet = {n: 0.0 for n in FITS}
    hw = _hw({**quiet, "text_host": 0.02}, errors)
    once = hw.spec.fits | {"text_host": FitQuality(samples=9, spread=0.02)}
    prior = _plan(ResolvedHardware(hw.spec.model_copy(update={"fits": once}), "test")).prediction.bands
    measured = _plan(hw).prediction.bands
    key = "phases.encode.warm_time_s"  # (a first generation's low edge is the one-sided start-up's: none of it)
    assert prior[key].rel > 2 * measured[key].rel > 0 and prior[key].fits[0] == "text_host"


def test_calibrate_saved_over_the_default_records_the_drift_and_a_refit_does_not(workdir, monkeypatch):
    from chunkflow.commands.calibrate.command import _save_profile
    from chunkflow.commands.calibrate.profile import write_profile
    from chunkflow_planner.bands import drift_between
    from chunkflow_planner.catalog import load_profile
    from chunkflow_planner.planner import saved_profile_path

    monkeypatch.setenv("CHUNKFLOW_CONFIG_DIR", str(workdir / "cfg"))
    base = get_hardware("h200")
    first = _measured(base.model_copy(update={"name": "calibrated-nvidia-h200"}), h2d={})
    write_profile(first, saved_profile_path())
    second = _measured(first.model_copy(update={"h2d_link_gbps": first.h2d_link_gbps * 0.9}), h2d={})
    written = _save_profile(second, "p.yaml", "", default=True)
    saved = load_profile(saved_profile_path())
    change = drift_between(first, second)["h2d"]
    assert 0.09 < change < 0.12 and saved.fits["h2d"].drift == pytest.approx(change)
    assert load_profile(workdir / "p.yaml").fits["h2d"].drift == pytest.approx(change) == written.fits["h2d"].drift
    # a refit (calibrate --from-report) measured nothing: the profile it saves keeps the drift it had, no new pair
    refit = saved.model_copy(update={"h2d_link_gbps": saved.h2d_link_gbps * 0.5})
    _save_profile(refit, "q.yaml", "", default=True, measured=False)
    assert load_profile(saved_profile_path()).fits["h2d"].drift_pairs == 1
    # another GPU's default is not this machine's past: nothing compared
    other = _measured(base.model_copy(update={"name": "calibrated-nvidia-h100", "h2d_link_gbps": 20.0}), h2d={})
    assert _save_profile(other, "r.yaml", "", default=True).fits["h2d"].drift is None


def test_a_fit_refit_from_run_reports_adds_no_drift_to_its_spread():
    """block_overhead and startup are recorded from run reports, each a run of its own: their spread is already
    between runs, so no drift is added to it; a calibrate fit gets its drift prior until measured."""
    from chunkflow_planner.bands import spread_of

    hw = _measured(get_hardware("h200"), block_overhead={}, startup={}, compute={})
    assert spread_of(hw, "block_overhead") == (pytest.approx(0.02), True)
    assert spread_of(hw, "startup") == (pytest.approx(0.02), True)
    assert spread_of(hw, "compute")[0] > 0.02
