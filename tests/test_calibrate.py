"""Calibration fits on synthetic measurements, the eta curve in the planner, the CPU smoke profile, refits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chunkflow.commands.calibrate.fit import H2DFit, eta_curve, fit_h2d, summary_eta
from chunkflow.commands.calibrate.profile import make_profile
from chunkflow.commands.calibrate.refit import refit
from chunkflow.commands.cli import app
from chunkflow_planner.catalog import get_hardware, get_model, load_profile
from chunkflow_planner.overlap import F_star_hw, T_comp_hw, T_pref, analyse
from chunkflow_planner.workload import make_workload

runner = CliRunner()
MB = 10**6


pytestmark = pytest.mark.usefixtures("workdir")


@pytest.mark.parametrize("t0, gbps", [(2.7e-6, 55.3), (12e-6, 25.0), (0.0, 31.5)])
def test_h2d_fit_recovers_startup_and_bandwidth(t0, gbps):
    sizes = [c * MB for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    noise = [1.0, 1.004, 0.997, 1.002, 0.999, 1.001, 0.998, 1.003, 1.0]  # +-0.4 %
    times = [(t0 + c / (gbps * 1e9)) * n for c, n in zip(sizes, noise)]
    fit = fit_h2d(sizes, times)
    assert fit.bw_Bps / 1e9 == pytest.approx(gbps, rel=0.01)
    assert fit.t0_s == pytest.approx(t0, abs=1e-6)


def test_h2d_fit_rejects_too_few_points():
    with pytest.raises(ValueError):
        fit_h2d([MB], [1e-3])


def test_eta_curve_recovers_known_efficiencies_and_interpolates_in_log_f():
    P = 989e12
    true = {1e11: 0.30, 1e12: 0.45, 1e13: 0.60}
    curve = eta_curve(list(true), [F / (e * P) for F, e in true.items()], P)
    assert [f for f, _ in curve] == sorted(true)
    for (F, e) in curve:
        assert e == pytest.approx(true[F], rel=1e-9)
    assert summary_eta(curve) == pytest.approx(0.45)
    hw = get_hardware("h200").model_copy(update={"eta_comp_curve": curve})
    assert hw.eta_comp_at(10**11.5) == pytest.approx(0.375)  # halfway in log F
    assert hw.eta_comp_at(1e9) == pytest.approx(0.30) and hw.eta_comp_at(1e15) == pytest.approx(0.60)  # clamped


def test_curve_enters_t_comp_and_f_star_by_root_finding():
    P = 989e12
    curve = [(1e11, 0.3), (1e12, 0.45), (1e13, 0.6)]
    hw = get_hardware("h200").model_copy(update={"eta_comp_curve": curve})
    B = 327e6
    fs = F_star_hw(hw, B)
    assert T_comp_hw(fs, hw) == pytest.approx(T_pref(B, hw.h2d_gbps * 1e9, hw.eta_pref), rel=1e-9)
    assert T_comp_hw(1e12, hw) == pytest.approx(1e12 / (0.45 * P))
    # eq. 4 holds with the efficiency at the crossing, which here is above the scalar 0.48: F* moves up
    assert fs == pytest.approx(hw.eta_comp_at(fs) * P * T_pref(B, hw.h2d_gbps * 1e9, hw.eta_pref), rel=1e-9)
    assert hw.eta_comp_at(fs) > 0.48 and fs > F_star_hw(get_hardware("h200"), B)
    spec = get_model("wan2.2")
    a = analyse(spec, make_workload(spec, frames=81), hw)
    assert a.I_star == pytest.approx(a.F_star / a.B_pref, rel=1e-9)


def test_curve_must_increase_in_f():
    with pytest.raises(ValueError):
        get_hardware("h200").model_validate({**get_hardware("h200").model_dump(), "eta_comp_curve": [[2e12, 0.5], [1e12, 0.4]]})


def test_profile_from_synthetic_fit_loads_in_plan(tmp_path):
    from chunkflow.commands.calibrate.profile import write_profile

    hw = make_profile(get_hardware("h200"), name="synthetic", peak_tflops=989, gemm_tflops=797,
                      curve=[(1e12, 0.4), (1e13, 0.55)], h2d=H2DFit(3e-6, 54e9), source="test")
    path = write_profile(hw, tmp_path / "p.yaml")
    assert load_profile(path) == hw
    result = runner.invoke(app, ["plan", "--model", "wan2.2", "--frames", "81", "--hardware", str(path), "--json",
                                 "--cfg-batching", "off"])  # batched CFG would double F_block: the curve's end
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["hardware"]["name"] == "synthetic" and plan["hardware"]["eta_pref"] == 1.0
    assert 0.4 < plan["analysis"]["eta_comp_used"] < 0.55
    assert plan["hardware"]["spec"]["eta_comp_curve"] == [[1e12, 0.4], [1e13, 0.55]]


def test_cpu_smoke_writes_a_profile_that_plan_accepts(tmp_path, monkeypatch):
    # the temporary directory is everyone's: the smoke run times its disk with a file of its own and walks nothing
    # there (a link to / or to itself anywhere under /tmp made that walk cover the file system, or never end)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "root").symlink_to("/")
    (tmp / "self").symlink_to(tmp)
    with open(tmp / "someone-elses.safetensors", "wb") as f:
        f.truncate(2**27)  # larger than the smoke sample: it would be the sample if the folder were walked
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    # torch's compiler keeps its cache in the temporary directory unless told otherwise (this test alone in a process
    # is the first to start it): not chunkflow's file
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    result = runner.invoke(app, ["calibrate", "--cpu-smoke", "--out", "smoke.yaml", "--raw", "raw.json"])
    assert result.exit_code == 0, result.output
    disk = json.loads((tmp_path / "raw.json").read_text())["disk"]
    assert disk["temporary"] and len(disk["files"]) == 1 and "--cpu-smoke" in disk["chosen_by"]
    assert Path(disk["files"][0]).parent == tmp and ".chunkflow-calibrate-" in disk["files"][0]
    assert sorted(p.name for p in tmp.iterdir()) == ["root", "self", "someone-elses.safetensors"]
    hw = load_profile(tmp_path / "smoke.yaml")
    assert hw.eta_comp_curve and len(hw.eta_comp_curve) >= 3 and hw.eta_pref == 1.0
    assert hw.h2d_link_gbps > 0 and hw.dma_startup_us >= 0
    assert len(hw.attn_eta_masked) == len(hw.attn_eta) >= 4  # masked attention measured on the same grid
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert len(raw["h2d"]) >= 3 and len(raw["blocks"]) >= 3
    # the host side: every catalog text-encoder architecture's layer timed (its host dispatch), as the profile
    # table says; the CPU's matmul by shape against its best rate, its memory bandwidth
    host = raw["operators"]["host"]
    archs = {"t5_encoder", "umt5_encoder", "clip_text", "llama", "qwen2_5_vl"}
    assert set(host["text_layer_host_us"]) == set(hw.pipeline.text_layer_host_us) == archs
    assert all(us > 0 for us in hw.pipeline.text_layer_host_us.values()) and hw.pipeline.host_margin == 1.0  # reports refit it
    us = hw.pipeline.text_layer_host_us["umt5_encoder"]
    assert "text-encoder layer host" in result.output and f"umt5_encoder {us:.0f} us" in result.output
    assert hw.pipeline.cpu_mem_gbps > 0
    # the load's process before any kernel (_process_rss) kept beside the probes' figure after theirs, and the
    # libraries' cached share once the probes ran
    assert hw.pipeline.process_start_host_bytes == raw["process_start_rss_bytes"] > 0
    assert 0 < hw.pipeline.libraries_warm_share <= 1
    # eta against the best of the square matmul and the grid: the grid's best is 1 unless the square matmul beat it
    assert len(hw.pipeline.cpu_gemm_eta) == 8 and hw.pipeline.cpu_tflops >= host["cpu_square_tflops"] > 0
    best = max(r[3] for r in hw.pipeline.cpu_gemm_eta)
    assert best == pytest.approx(1.0) or hw.pipeline.cpu_tflops == host["cpu_square_tflops"]
    # whole forwards timed; the model's curve is its one-block curve scaled by them where the scale is a GPU's
    # (the tiny model on the CPU is launch-bound: recorded, not applied)
    fw = raw["forwards"]
    assert len(fw) == 2 and all(r["time_s"] > 0 for r in fw) and fw[0]["scale"] == fw[1]["scale"] > 0
    name, k = fw[0]["model"], fw[0]["scale"]
    assert fw[0]["applied"] == (0.7 <= k <= 1.1)
    for (f, e), (f1, e1) in zip(raw["eta_comp_curves"][name], hw.eta_comp_curves[name]):
        assert f1 == f and e1 == pytest.approx(min(1.0, e * k) if fw[0]["applied"] else e)
    assert not (tmp_path / "config" / "hardware-profile.yaml").exists()  # smoke profiles are not saved by default
    result = runner.invoke(app, ["plan", "--model", "tiny", "--hardware", "smoke.yaml", "--json"])
    assert result.exit_code == 0, result.output
    # --save puts it where `plan` looks by default
    result = runner.invoke(app, ["calibrate", "--cpu-smoke", "--out", "s2.yaml", "--save"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["plan", "--model", "tiny", "--json"])
    assert json.loads(result.stdout)["hardware"]["name"] == "cpu-smoke"


def test_calibrate_without_cuda_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = runner.invoke(app, ["calibrate"])
    assert result.exit_code == 2
    assert "CUDA is not available" in result.output and "Traceback" not in result.output


def _report(tmp_path, mode, measured, **extra):
    """A real tiny run report with its measured step time replaced, made to look measured on a GPU (a refit
    refuses CPU runs)."""
    result = runner.invoke(app, ["plan", "--model", "tiny", "--out", "plan.json"])
    assert result.exit_code == 0, result.output
    out = tmp_path / f"{mode}.json"
    result = runner.invoke(app, ["run", "--plan", "plan.json", "--mode", mode, "--steps", "1", "--report", str(out), *extra])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    data["measured"]["median_step_s"] = measured
    data["gpu"], data["run"]["device"] = "NVIDIA H200", "cuda:0"
    out.write_text(json.dumps(data))
    return data, out


def test_refit_from_report_moves_eta_comp_the_right_way(tmp_path):
    data, path = _report(tmp_path, "none", 1.0)
    pred = data["predicted"]["step_time_s"]
    hw = get_hardware("h200")
    # measured 2x the predicted compute: efficiency halves
    data["measured"]["median_step_s"] = 2 * pred
    path.write_text(json.dumps(data))
    from chunkflow.commands.calibrate.refit import read_reports

    new, notes = refit(hw, read_reports([path]))
    assert new.eta_comp == pytest.approx(hw.eta_comp / 2, rel=1e-6)
    # faster than predicted: efficiency rises; through the CLI
    data["measured"]["median_step_s"] = pred / 1.5
    path.write_text(json.dumps(data))
    result = runner.invoke(app, ["calibrate", "--from-report", str(path), "--profile", "h200", "--out", "refit.yaml", "--no-save"])
    assert result.exit_code == 0, result.output
    assert load_profile(tmp_path / "refit.yaml").eta_comp == pytest.approx(min(1.0, hw.eta_comp * 1.5), rel=1e-6)


def test_refit_block_overhead_from_offload_vs_none(tmp_path):
    from chunkflow.commands.calibrate.refit import read_reports

    hw = get_hardware("h200").model_copy(update={"peak_tflops": 1e-3, "eta_comp": 1e-3})  # tiny block: compute dominates, hidden
    none, p_none = _report(tmp_path, "none", 1.0)
    lw, p_lw = _report(tmp_path, "layerwise", 1.0 + 2 * 2 * 100e-6)  # 2 streamed blocks, 2 forwards: 100 us each
    new, notes = refit(hw, read_reports([p_none, p_lw]))
    assert new.block_overhead_us == pytest.approx(100.0, rel=1e-6)


def test_refit_rejects_non_reports(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"schema_version": 99}))
    result = runner.invoke(app, ["calibrate", "--from-report", "x.json", "--profile", "h200"])
    assert result.exit_code == 2 and "not a run report" in result.output


def test_per_model_curves_apply_to_their_model_only():
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.steptime import step_time

    hw = get_hardware("h200")
    flux, wan = get_model("flux"), get_model("wan2.2")
    slow = hw.model_copy(update={"eta_comp_curves": {flux.name: [(1e9, 0.1), (1e15, 0.1)]}})
    wf, ww = make_workload(flux, batch=2), make_workload(wan, frames=41)
    none = OffloadConfig("none")
    # FLUX computes at eta 0.1 instead of the scalar: its compute time scales by eta_comp / 0.1
    assert step_time(flux, wf, slow, none).compute == pytest.approx(step_time(flux, wf, hw, none).compute * hw.eta_comp / 0.1)
    assert step_time(wan, ww, slow, none).compute == pytest.approx(step_time(wan, ww, hw, none).compute)
    assert analyse(flux, wf, slow).F_star == pytest.approx(analyse(flux, wf, hw).F_star * 0.1 / hw.eta_comp)


def test_refit_scales_the_reported_models_curve(tmp_path):
    from chunkflow.commands.calibrate.refit import read_reports

    data, path = _report(tmp_path, "none", 1.0)
    tiny = get_model("tiny")
    hw = get_hardware("h200").model_copy(update={"eta_comp_curves": {tiny.name: [(1.0, 0.5), (1e15, 0.5)]},
                                                 "eta_comp_curve": [(1.0, 0.4), (1e15, 0.4)]})
    pred = data["predicted"]["step_time_s"]
    data["measured"]["median_step_s"] = 2 * pred  # predicted with h200's scalar eta; refit re-predicts with hw
    path.write_text(json.dumps(data))
    new, _ = refit(hw, read_reports([path]))
    assert new.eta_comp_curves[tiny.name][0][1] < 0.5  # the tiny model's own curve moved down
    assert new.for_model(tiny.name).eta_comp_curve == new.eta_comp_curves[tiny.name]


@pytest.mark.slow
def test_calibrate_under_torchrun_speaks_once(tmp_path, torchrun):
    """Every rank measures; only rank 0 logs, shows progress and writes the profile."""
    out = tmp_path / "p.yaml"
    p = torchrun(2, ["-m", "chunkflow", "calibrate", "--cpu-smoke", "--out", str(out)],
                     CHUNKFLOW_CONFIG_DIR=str(tmp_path / "cfg"))
    assert p.stderr.count("H2D fit") == 1 and p.stderr.count("device cpu; base") == 1
    assert p.stdout.count("Profile written to") == 1 and out.exists()


def test_refit_refuses_reports_that_cannot_describe_a_gpu_and_keeps_the_saved_profile(tmp_path):
    from chunkflow_planner.planner import saved_profile_path

    result = runner.invoke(app, ["calibrate", "--cpu-smoke", "--out", "p.yaml", "--save"])
    assert result.exit_code == 0, result.output
    saved = saved_profile_path().read_text()
    data, path = _report(tmp_path, "none", 1.0)
    data["measured"]["median_step_s"] = 2 * data["predicted"]["step_time_s"]  # a plausible GPU measurement
    path.write_text(json.dumps(data))
    cases = [({"measured.median_step_s": 1e6}, "were these runs"), ({"gpu": "cpu (x86_64)"}, "measured on the CPU"),
             ({"measured.median_step_s": -1.0}, "median_step_s"),
             ({"measured.step_times_s": [float("nan")]}, "step_times_s"), ({"run.offload.mode": "turbo"}, "turbo")]
    for change, message in cases:
        bad = json.loads(json.dumps(data))
        for key, value in change.items():
            *parents, leaf = key.split(".")
            d = bad
            for k in parents:
                d = d[k]
            d[leaf] = value
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        result = runner.invoke(app, ["calibrate", "--from-report", str(tmp_path / "bad.json"), "--save"])
        assert result.exit_code == 2 and message in result.output, (change, result.output)
        assert saved_profile_path().read_text() == saved  # nothing replaced
    # a good refit over the saved profile keeps the previous one and says what changed
    result = runner.invoke(app, ["calibrate", "--from-report", str(path), "--save"])
    assert result.exit_code == 0, result.output
    assert "previous default profile is kept" in result.output and "eta_comp" in result.output
    assert saved_profile_path().with_name("hardware-profile.previous.yaml").read_text() == saved


def test_cpu_smoke_with_model_is_refused():
    result = runner.invoke(app, ["calibrate", "--cpu-smoke", "--model", "flux"])
    assert result.exit_code == 2 and "--cpu-smoke" in result.output


def test_refit_takes_a_quoted_pattern_and_names_the_report_it_refuses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data, path = _report(tmp_path, "none", 1.0)
    data["measured"]["median_step_s"] = data["predicted"]["step_time_s"]
    (tmp_path / "a-report.json").write_text(json.dumps(data))
    (tmp_path / "b-report.json").write_text(json.dumps(data))
    result = runner.invoke(app, ["calibrate", "--from-report", str(tmp_path / "*-report.json"), "--profile", "h200",
                                 "--out", "refit.yaml", "--no-save"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "refit.yaml").exists()
    cpu = dict(data, gpu="cpu")
    cpu["run"] = dict(data["run"], device="cpu")
    (tmp_path / "c-report.json").write_text(json.dumps(cpu))
    result = runner.invoke(app, ["calibrate", "--from-report", str(tmp_path / "*-report.json"), "--profile", "h200",
                                 "--out", "refit2.yaml", "--no-save"])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "c-report.json" in out and "a-report.json" not in out
    assert not (tmp_path / "refit2.yaml").exists()
    result = runner.invoke(app, ["calibrate", "--from-report", str(tmp_path / "none-*.json"), "--profile", "h200"])
    assert result.exit_code == 2 and "matches no file" in result.output


def test_refit_takes_a_pattern_the_shell_expanded(tmp_path, monkeypatch):
    """`--from-report out/*-report.json` unquoted reaches calibrate as one flag and more files: all are refit from,
    exactly as the flag repeated; files without the flag are refused with the command that was meant."""
    monkeypatch.chdir(tmp_path)
    data, _ = _report(tmp_path, "none", 1.0)
    data["measured"]["median_step_s"] = data["predicted"]["step_time_s"]
    (tmp_path / "a-report.json").write_text(json.dumps(data))
    cpu = dict(data, gpu="cpu")
    cpu["run"] = dict(data["run"], device="cpu")
    (tmp_path / "b-report.json").write_text(json.dumps(cpu))
    result = runner.invoke(app, ["calibrate", "--from-report", "a-report.json", "b-report.json", "--profile", "h200",
                                 "--out", "refit.yaml", "--no-save"])
    assert result.exit_code == 2 and "b-report.json" in " ".join(result.output.split())  # the second one was read
    (tmp_path / "b-report.json").write_text(json.dumps(data))
    result = runner.invoke(app, ["calibrate", "--from-report", "a-report.json", "b-report.json", "--profile", "h200",
                                 "--out", "refit.yaml", "--no-save"])
    assert result.exit_code == 0, result.output
    assert "a-report.json, b-report.json" in (tmp_path / "refit.yaml").read_text()
    result = runner.invoke(app, ["calibrate", "--from-report", "a-report.json", "*-report.json", "--profile", "h200",
                                 "--out", "refit.yaml", "--no-save"])  # overlapping: each file refit from once
    assert result.exit_code == 0, result.output
    assert "# refit from a-report.json, b-report.json\n" in (tmp_path / "refit.yaml").read_text()
    result = runner.invoke(app, ["calibrate", "a-report.json", "--out", "x.yaml", "--no-save"])
    assert result.exit_code == 2 and "--from-report" in result.output and not (tmp_path / "x.yaml").exists()


def test_tiled_vae_fit_is_per_decoder_call():
    """Tiled decodes are fitted on their decoder calls (the catalog's tiling counts them): decodes timed at a fixed
    cost per call give back that cost and the constant, and the fit predicts a size it never saw; without a count,
    the fit stays per voxel."""
    from chunkflow.commands.calibrate.ops import fit_vae
    from chunkflow_planner.catalog import VaeDecodeFit, Workload, get_model
    from chunkflow_planner.pipeline import decode_calls

    spec = get_model("wan2.2")
    calls = lambda r: decode_calls(spec, Workload(batch=1, frames=r["frames"], height=r["height"],  # noqa: E731
                                                  width=r["width"], steps=1))
    rows = [dict(batch=1, frames=f, height=h, width=w, peak_bytes=1e9 + 30 * f * h * w)
            for f, h, w in ((21, 480, 832), (21, 704, 1280), (61, 704, 1280))]
    for r in rows:
        r["time_s"] = 0.05 + 0.022 * calls(r)
    fit = fit_vae(rows, False, "test", calls)
    assert fit["time_per_call"] == pytest.approx(0.022) and fit["time_const"] == pytest.approx(0.05, abs=1e-9)
    assert fit["time_per_voxel"] == 0.0
    VaeDecodeFit(**fit)  # a valid catalog fit
    unseen = dict(batch=1, frames=121, height=544, width=960)
    assert fit["time_const"] + fit["time_per_call"] * calls(unseen) == pytest.approx(0.05 + 0.022 * calls(unseen))
    per_voxel = fit_vae(rows, False, "test")
    assert per_voxel["time_per_voxel"] > 0 and "time_per_call" not in per_voxel


def test_whole_forward_points_fit_and_scale_the_curve():
    """A block timed alone can run faster than inside the whole forward (Wan2.2-TI2V-5B on an H200: 5.3%), so
    calibrate times whole forwards where they fit: the middle calibration size and the largest that fits, none when
    the middle one does not; their predicted / measured compute scales the model's curve."""
    from chunkflow.commands.calibrate.fit import forward_scale
    from chunkflow.commands.calibrate.measure import forward_points
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.predict import predict

    spec, hw = get_model("wan2.2"), get_hardware("h200")
    frames = lambda pts: [w.frames for w in pts]  # noqa: E731
    assert frames(forward_points(spec, hw, None)) == [41, 121]
    assert frames(forward_points(spec, hw, 20e9)) == [41, 81]  # 121 frames without offload need more
    assert forward_points(spec, hw, 15e9) == []  # 10 GB of weights and the activations of 41 frames do not fit
    assert all(w.cfg_passes == 1 for w in forward_points(spec, hw, None))
    rows = []
    for w in forward_points(spec, hw, None):
        p = predict(spec, w, hw, OffloadConfig(mode="none"))
        rows.append(dict(frames=w.frames, batch=1, time_s=p.step_time_s - p.compute_s + 1.1 * p.compute_s))
    assert forward_scale(spec, hw, rows) == pytest.approx(1 / 1.1)


def test_a_negative_decode_intercept_gives_way_to_a_line_through_the_origin():
    """Per-call costs that grow a little with the call count fit a line with a negative intercept, which priced small
    decodes at 0 s (and made tiling look free); the fit then goes through the origin."""
    from chunkflow.commands.calibrate.ops import fit_vae

    rows = [dict(batch=1, frames=1, height=1, width=1, peak_bytes=1e9, time_s=t, n=n)
            for n, t in ((90, 1.574), (168, 3.225), (448, 9.027))]  # H200, Wan2.2 VAE: 17.5 -> 20.1 ms a call
    fit = fit_vae(rows, False, "test", lambda r: r["n"])
    assert fit["time_const"] == 0.0
    assert min(r["time_s"] / r["n"] for r in rows) < fit["time_per_call"] < max(r["time_s"] / r["n"] for r in rows)
    # the line is fitted in relative error (robust): no decode off by 10%, where the least-squares line in seconds
    # (what it was before scipy: the largest decode decides it) put the smallest 14% over
    assert all(abs(fit["time_per_call"] * r["n"] / r["time_s"] - 1) < 0.1 for r in rows)
    seconds = sum(r["time_s"] * r["n"] for r in rows) / sum(r["n"] ** 2 for r in rows)
    assert max(abs(seconds * r["n"] / r["time_s"] - 1) for r in rows) > 0.13


# ------------------------------------------------------------------------------------- the disk's sample


def _sampled(folder: Path, want: int = 2**40, entries: int | None = None) -> list[str]:
    """calibrate's disk sample of `folder` (sample_files), in a process of its own: the timeout guards against a
    walk that covers the file system or never ends. `entries`: the walk's bound, lowered."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ("import json, sys\nfrom pathlib import Path\nfrom chunkflow.commands.calibrate import disk\n"
            + (f"disk.MAX_WALK_ENTRIES = {entries}\n" if entries else "")
            + f"print(json.dumps([str(p) for p, _ in disk.sample_files(Path({str(folder)!r}), {want})]))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_the_disk_sample_is_taken_only_from_the_folder_named(tmp_path):
    """`calibrate --weights DIR` samples DIR's own safetensors files: links to directories are not followed (one
    to /, one to DIR itself, one to a folder beside it), a link to a file only where it stays inside DIR, and no
    FIFO, dangling link or loop of links is opened."""
    w, outside = tmp_path / "w", tmp_path / "outside"
    mine = _file(w / "transformer" / "a.safetensors", 2**20)
    _file(w / "text_encoder" / "b.safetensors", 2**19)
    big = _file(outside / "big.safetensors", 2**30)
    (w / "root").symlink_to("/")
    (w / "self").symlink_to(w)
    (w / "transformer" / "up").symlink_to("..")
    (w / "beside").symlink_to(outside)
    (w / "transformer" / "leaves.safetensors").symlink_to(big)
    (w / "transformer" / "same.safetensors").symlink_to("a.safetensors")
    (w / "transformer" / "dangling.safetensors").symlink_to("nowhere")
    (w / "transformer" / "cycle.safetensors").symlink_to("cycle.safetensors")
    os.mkfifo(w / "transformer" / "fifo.safetensors")
    assert _sampled(w) == [str(mine.resolve()), str((w / "text_encoder" / "b.safetensors").resolve())]
    assert _sampled(w, want=1) == [str(mine.resolve())]  # the largest first, until the sample is covered


def test_the_disk_sample_of_a_hub_snapshot_is_its_repos_blobs(tmp_path):
    """A Hub id resolves to a cache snapshot whose files are links to the repo's blobs: those are the sample;
    a snapshot link leaving the repo is not followed. The whole cache samples its blobs once each."""
    repo = tmp_path / "hub" / "models--org--name"
    blob = _file(repo / "blobs" / "0123abcd", 2**20)
    elsewhere = _file(tmp_path / "elsewhere" / "x.safetensors", 2**30)
    snap = repo / "snapshots" / "c0ffee"
    (snap / "transformer").mkdir(parents=True)
    (snap / "transformer" / "diffusion_pytorch_model.safetensors").symlink_to("../../../blobs/0123abcd")
    (snap / "vae").mkdir()
    (snap / "vae" / "diffusion_pytorch_model.safetensors").symlink_to(elsewhere)
    assert _sampled(snap) == [str(blob.resolve())]
    old = repo / "snapshots" / "beef"
    (old / "transformer").mkdir(parents=True)
    (old / "transformer" / "diffusion_pytorch_model.safetensors").symlink_to("../../../blobs/0123abcd")
    assert _sampled(tmp_path / "hub") == [str(blob.resolve())]


def test_the_disk_samples_walk_is_bounded(tmp_path):
    """However large or deep the folder, the walk stops: after MAX_WALK_ENTRIES entries (lowered here) and below
    MAX_WALK_DEPTH levels; what it found by then is the sample."""
    from chunkflow.commands.calibrate.disk import MAX_WALK_DEPTH

    for i in range(40):
        _file(tmp_path / "wide" / f"{i:02d}.safetensors", 2**10 + i)
    found = _sampled(tmp_path / "wide", entries=10)
    assert 0 < len(found) <= 10
    deep = tmp_path / "deep"
    shallow = _file(deep / "a" / "b" / "s.safetensors", 10)
    _file(deep.joinpath(*["d"] * (MAX_WALK_DEPTH + 2), "far.safetensors"), 2**20)
    assert _sampled(deep) == [str(shallow.resolve())]
