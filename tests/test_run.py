"""`chunkflow run` on the tiny model, end to end on the CPU, its report, and bad input."""

import json
import math
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow.reports import RUN_REPORT_SCHEMA_VERSION, RunReport
from chunkflow_planner.offload import OffloadConfig

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("tiny_plan")


def _ok(*args):
    result = runner.invoke(app, ["run", "--plan", "plan.json", *args])
    assert result.exit_code == 0, result.output
    return result


def test_run_tiny_end_to_end_writes_a_valid_report(tmp_path):
    result = _ok()
    assert "Measured vs predicted" in result.output
    rep = RunReport.model_validate_json((tmp_path / "run-report.json").read_text())
    assert rep.schema_version == RUN_REPORT_SCHEMA_VERSION
    assert rep.plan.model.name == "tiny-wan" and rep.run.offload.mode == rep.plan.offload.mode == "none"
    assert rep.run.steps == min(5, rep.plan.workload.steps) and len(rep.measured.step_times_s) == rep.run.steps
    for x in rep.measured.step_times_s + [rep.measured.median_step_s, rep.predicted.step_time_s]:
        assert math.isfinite(x) and x > 0
    # measured on the CPU against the plan's GPU profile: the step time is not compared, and nothing is saved for it
    assert rep.plan.hardware.name != "cpu" and rep.rel_error.step_time is None
    assert rep.rel_error.peak_memory is None and rep.measured.peak_allocated_bytes is None  # CPU: not measured
    assert rep.predicted.peak_memory_bytes > 0 and rep.torch and rep.diffusers and rep.date and rep.command


def test_run_chunkflow_with_residency_reports_achieved_residency(tmp_path):
    _ok("--mode", "chunkflow", "--chunk-size", "4KB", "--residency", "0.5", "--steps", "2", "--report", "r.json")
    rep = RunReport.model_validate_json((tmp_path / "r.json").read_text())
    assert rep.run.offload == OffloadConfig("chunkflow", 4000, 0.5)
    assert 0.3 < rep.measured.achieved_residency < 0.7
    assert rep.stats["mode"] == "chunkflow" and rep.stats["n_streamed_blocks"] == 2
    assert rep.stats["forwards"] >= 3  # 1 warm-up + 2 timed steps, one forward each
    assert rep.predicted.pinned_host_bytes > 0
    _ok("--mode", "layerwise", "--steps", "1", "--report", "l.json")
    assert json.loads((tmp_path / "l.json").read_text())["run"]["offload"]["mode"] == "layerwise"


@pytest.mark.slow
def test_run_as_a_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "chunkflow", "run", "--plan", "plan.json", "--steps", "1"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run-report.json").exists()


def _bad(args, message):
    result = runner.invoke(app, ["run", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be between 1"),
    (["--mode", "turbo"], "unknown mode"),
    (["--mode", "chunkflow", "--chunk-size", "4XB"], "unknown size unit"),
    (["--mode", "chunkflow", "--chunk-size", "lots"], "cannot read size"),
    (["--mode", "chunkflow", "--residency", "1.5"], "must be in [0, 1]"),
    (["--mode", "chunkflow", "--residency", "-0.1"], "must be in [0, 1]"),
    (["--profile", "nosuch.yaml", "--steps", "1"], "does not exist"),
    (["--device", "tpu"], "is not a torch device"),
])
def test_bad_options(args, message):
    _bad(["--plan", "plan.json", *args], message)


def test_bad_plans(tmp_path):
    plan = json.loads((tmp_path / "plan.json").read_text())
    (tmp_path / "v9.json").write_text(json.dumps(dict(plan, schema_version=9)))
    _bad(["--plan", "v9.json"], "schema_version 9")
    plan["model"]["name"] = "Imaginary-9B"
    (tmp_path / "unknown.json").write_text(json.dumps(plan))
    _bad(["--plan", "unknown.json", "--steps", "1"], "not in the catalog")
    _bad(["--plan", "missing.json"], "does not exist")


def test_profile_with_missing_fields(tmp_path):
    (tmp_path / "bad.yaml").write_text("schema_version: 1\nname: half\npeak_tflops: 100\n")
    _bad(["--plan", "plan.json", "--profile", "bad.yaml", "--steps", "1"], "malformed")


def test_weights_dir_missing_and_misshapen_tensors(tmp_path):
    import torch
    from safetensors.torch import save_file

    from chunkflow.models.build import construct_meta
    from chunkflow_planner.catalog import get_model

    spec = get_model("tiny")
    d = tmp_path / "w"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"_class_name": spec.diffusers.cls, **spec.diffusers.config}))
    module = construct_meta(spec)
    tensors = {n: torch.zeros(p.shape) for n, p in module.named_parameters()}
    name = next(iter(tensors))
    save_file({k: v for k, v in tensors.items() if k != name}, str(d / "model.safetensors"))
    _bad(["--plan", "plan.json", "--weights", str(d), "--steps", "1"], "lacks tensor")
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(d / "model.safetensors"))
    _bad(["--plan", "plan.json", "--weights", str(d), "--steps", "1"], "has shape")
    _bad(["--plan", "plan.json", "--weights", str(tmp_path / "nowhere"), "--steps", "1"], "not a directory")


@pytest.mark.slow
def test_run_under_torchrun_with_sequence_parallelism(tmp_path, cli, torchrun):
    """`torchrun -m chunkflow run` on two gloo ranks: the SP plan's degree is used and rank 0 reports."""
    result = cli("plan", "--model", "tiny", "--sp", "2", "--hardware", "h200-x2", "--out", tmp_path / "plan.json")
    assert result.exit_code == 0, result.output
    torchrun(2, ["-m", "chunkflow", "run", "--plan", str(tmp_path / "plan.json"), "--device", "cpu", "--mode",
                 "chunkflow", "--chunk-size", "4KB", "--steps", "1", "--report", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["run"]["sp_degree"] == 2 and report["run"]["offload"]["mode"] == "chunkflow"
    assert report["plan"]["parallel"]["sp_degree"] == 2


def test_variant_needs_weights(tmp_path):
    _bad(["--plan", "plan.json", "--variant", "fp16"], "--weights DIR")
