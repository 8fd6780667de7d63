"""`chunkflow bench` on the tiny model on the CPU: the sweep's points, CSV, summary and plots, redrawing a run,
SP under torchrun (gloo), and bad input."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from chunkflow.commands.bench import COLUMNS, BenchSpec
from chunkflow.commands.bench.choices import PlannerChoice
from chunkflow.commands.bench.summary import chunk_verdict, error_stats
from chunkflow.commands.cli import app
from chunkflow_planner.offload import OffloadConfig

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.usefixtures("workdir")


def _spec(**kw) -> BenchSpec:
    base = dict(model="tiny-wan", axis="frames", values=[5, 9, 13], chunk_sizes=[16_000, 4_000, 64_000],
                residencies=[0.0, 0.25, 0.5])
    return BenchSpec(**{**base, **kw})


def test_points_measure_each_configuration_once_and_sweeps_at_their_workloads():
    b = _spec()
    pts = b.points()
    cfgs = [c for c, _ in pts]
    assert len(cfgs) == len(set(cfgs))
    assert [c.mode for c in cfgs][:2] == ["none", "layerwise"]  # none first: the bit-identity reference
    by = dict(pts)
    assert by[OffloadConfig("none")] == [5, 9, 13] and by[OffloadConfig("layerwise")] == [5, 9, 13]
    assert by[OffloadConfig("chunkflow", 16_000, 0.0)] == [5, 9, 13]  # scaling config, also in both sweeps
    assert by[OffloadConfig("chunkflow", 4_000, 0.0)] == [9]  # chunk sweep at the middle value
    assert by[OffloadConfig("chunkflow", 16_000, 0.5)] == [5]  # residency sweep at the smallest
    assert b.n_points() == 9 + 2 + 2


def test_points_add_references_at_sweep_workloads_outside_the_scaling_values():
    b = _spec(values=[5], chunk_at=13, residency_at=9)
    by = dict(b.points())
    assert by[OffloadConfig("none")] == [5, 9, 13]
    assert by[OffloadConfig("layerwise")] == [5, 13]
    assert by[OffloadConfig("chunkflow", 16_000, 0.0)] == [5, 9, 13]


def test_error_stats_and_chunk_verdict():
    s = error_stats([0.01, -0.08, 0.03, float("nan"), None])
    assert s.n == 3 and s.median_abs == pytest.approx(0.03) and s.worst == -0.08
    meta = type("M", (), {"spec": _spec()})()
    df = pd.DataFrame(dict(mode=["chunkflow"] * 3 + ["layerwise"], value=[9] * 4, residency=[0.0] * 4,
                           chunk_bytes=[4_000, 16_000, 64_000, None], measured_step_s=[1.00, 1.04, 1.20, 0.9]))
    v = chunk_verdict(df, meta, PlannerChoice(16_000, None, ""))
    assert (v.best_bytes, v.chosen_bytes) == (4_000, 16_000) and v.gap == pytest.approx(0.04) and v.within
    assert not chunk_verdict(df, meta, PlannerChoice(64_000, None, "")).within


def test_bench_writes_csv_summary_and_plots(tmp_path):
    result = runner.invoke(app, ["bench", "--model", "tiny", "--frames", "5,9", "--residency", "0,0.5",
                                 "--chunk-sizes", "4KB,16KB", "--steps", "1", "--out", "b"])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(tmp_path / "b" / "bench.csv")
    assert list(df.columns) == COLUMNS
    # scaling 2 frames x 3 modes, 16KB at the chunk sweep's workload (5), r=0.5 at the smallest (5)
    assert len(df) == 6 + 1 + 1
    assert not df.duplicated(["value", "mode", "chunk_bytes", "residency"]).any()
    assert (df["measured_step_s"] > 0).all() and (df["predicted_step_s"] > 0).all()
    # measured on the CPU against the default (a GPU's) profile: no step-time error is computed, none saved
    assert df["err_step"].isna().all()
    assert df["bit_identical"].all()  # offload changes no bit of the final latents
    assert (df["sp"] == 1).all() and (df["n_collectives"] == 0).all() and (df["collective_s"] == 0).all()
    cf = df[(df["mode"] == "chunkflow") & (df["residency"] == 0.5)]
    assert len(cf) == 1 and (cf["value"] == 5).all() and (cf["achieved_residency"] > 0.3).all()
    none = df[df["mode"] == "none"].set_index("value")
    assert none["compute_s"].to_dict() == pytest.approx(none["measured_step_s"].to_dict())
    meta = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert meta["schema_version"] == 1 and meta["spec"]["chunk_sizes"] == [4000, 16000] and meta["sp"] == 1
    summary = (tmp_path / "b" / "summary.md").read_text()
    assert "## Chunk size" in summary and "## Residency" in summary
    assert "step time: not compared: measured on cpu" in summary and "`h200`" in summary
    for name in ("step_time.png", "memory.png", "breakdown.png", "chunk_size.png", "residency.png", "accuracy.png",
                 "roofline.png"):
        path = tmp_path / "b" / name
        assert path.exists() and path.stat().st_size > 10_000 and path.read_bytes()[:8] == PNG

    # --from-dir redraws from the files alone, to another directory
    again = runner.invoke(app, ["bench", "--from-dir", "b", "--out", "c"])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "c" / "summary.md").read_text() == summary
    assert (tmp_path / "c" / "breakdown.png").read_bytes()[:8] == PNG
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "c" / "bench.csv"), df)

    # an unreadable or foreign bench.json is refused with a message, not a traceback
    good = json.dumps(meta)
    for text, message in (("[1, 2]", "JSON object"), (json.dumps({**meta, "sp": "two"}), "understands")):
        (tmp_path / "b" / "bench.json").write_text(text)
        bad = runner.invoke(app, ["bench", "--from-dir", "b", "--out", "d"])
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output
    meta = json.loads(good)
    meta["schema_version"] = 99
    (tmp_path / "b" / "bench.json").write_text(json.dumps(meta))
    bad = runner.invoke(app, ["bench", "--from-dir", "b", "--out", "d"])
    assert bad.exit_code == 2 and "schema_version 99" in bad.output and "Traceback" not in bad.output


@pytest.mark.slow
def test_bench_under_torchrun_runs_sequence_parallel(tmp_path, torchrun):
    torchrun(2, ["-m", "chunkflow", "bench", "--model", "tiny", "--frames", "5,9", "--chunk-sizes", "4KB,16KB",
                     "--steps", "1", "--hardware", "h200-x2", "--no-plots", "--out", str(tmp_path / "sp")],
                 CHUNKFLOW_CONFIG_DIR=str(tmp_path / "config"))
    df = pd.read_csv(tmp_path / "sp" / "bench.csv")
    assert len(df) == 2 * 3 + 1 and (df["sp"] == 2).all()
    assert (df["n_collectives"] > 0).all() and (df["collective_s"] > 0).all()  # Ulysses all-to-alls were timed
    assert df["bit_identical"].all()  # on both ranks
    assert json.loads((tmp_path / "sp" / "bench.json").read_text())["command"].startswith("torchrun --nproc-per-node 2")
    # the prediction is for SP=2: half the tokens per GPU
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.predict import predict

    w = BenchSpec(model="tiny-wan", axis="frames", values=[9], chunk_sizes=[4000], residencies=[0.0]).workload(
        get_model("tiny"), 9)
    row = df[(df["mode"] == "none") & (df["value"] == 9)].iloc[0]
    assert row["predicted_step_s"] == pytest.approx(predict(get_model("tiny"), w, get_hardware("h200-x2"),
                                                            OffloadConfig("none"), sp=2).step_time_s)


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny"], "exactly one of"),
    ([], "give --model"),
    (["--model", "tiny", "--frames", "6"], "1 mod 4"),
    (["--model", "tiny", "--frames", "5", "--chunk-at", "7"], "1 mod 4"),
    (["--model", "tiny", "--frames", "5", "--modes", "fast"], "unknown mode"),
    (["--model", "tiny", "--frames", "5", "--residency", "2"], "[0, 1]"),
    (["--model", "tiny", "--frames", "5", "--chunk-sizes", "4QB"], "unknown size unit"),
    (["--model", "nosuch", "--frames", "5"], "unknown model"),
    (["--model", "tiny", "--frames", "a,b"], "comma-separated"),
    (["--from-dir", "nowhere"], "not found"),
    (["--model", "tiny", "--frames", "5", "--comm-aware", "maybe"], "on, off or auto"),
])
def test_bench_bad_input(args, message):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_bench_measures_a_baseline_offloader_against_none(cli, workdir):
    """diffusers' group offloading runs last, at every value, measured only (no prediction), bit-identical."""
    result = cli("bench", "--model", "tiny", "--frames", "5,9", "--modes", "none,chunkflow", "--chunk-sizes", "4KB",
                 "--baselines", "diffusers-group", "--steps", "1", "--no-plots", "--out", "b")
    assert result.exit_code == 0, result.output
    df = pd.read_csv(workdir / "b" / "bench.csv")
    assert list(df["mode"]) == ["none", "none", "chunkflow", "chunkflow", "diffusers-group", "diffusers-group"]
    group = df[df["mode"] == "diffusers-group"]
    assert group["bit_identical"].all() and group["predicted_step_s"].isna().all()
    assert (group["measured_step_s"] > 0).all() and (df["host_rss_bytes"] > 0).all()
    summary = (workdir / "b" / "summary.md").read_text()
    assert "| diffusers-group |" in summary
    assert "diffusers-group" in result.output
    bad = cli("bench", "--model", "tiny", "--frames", "5", "--baselines", "accelerate")
    assert bad.exit_code == 2 and "unknown baseline" in bad.output
