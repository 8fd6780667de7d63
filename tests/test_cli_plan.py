"""`chunkflow plan`, `models`, `hardware` through the real CLI (typer's runner and a subprocess)."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from chunkflow.commands.cli import app

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("workdir")  # no saved profile


def plan_json(*args: str) -> dict:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    "args, axis, expected",
    [
        (["--model", "wan2.2", "--frames", "81", "--prefetch-bytes", "520MB"], "frames", 119.2),
        (["--model", "flux", "--batch", "4", "--prefetch-bytes", "465MB"], "batch", 11.5),
        (["--model", "hunyuan", "--frames", "33", "--height", "720", "--width", "1280", "--prefetch-bytes", "675MB",
          "--text-len", "161"], "frames", 34.5),
    ],
)
def test_paper_appendix_c_through_the_cli(args, axis, expected):
    plan = plan_json(*args, "--hardware", "h100-pcie-x2-paper", "--sp", "2", "--cfg-batching", "off")
    crit = plan["analysis"]["critical"]
    assert crit["axis"] == axis
    assert crit["value"] == pytest.approx(expected, rel=0.01)
    assert plan["hardware"]["h2d_gbps"] == pytest.approx(31.5)


def test_plan_as_written_in_the_issue(tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--model", "wan2.2", "--frames", "81", "--mem-budget", "24GB", "--out", str(out),
                                 "--host-mem-budget", "128GB"])
    assert result.exit_code == 0, result.output
    assert "Overlap analysis" in result.output and "why:" in result.output
    # the answer (the plan, why, the generation's phases, host memory) before how it was reached (issue 53)
    text = result.output
    assert text.index("plan:") < text.index("why:") < text.index("host memory:") < text.index("Overlap analysis")
    assert "default:h200" in result.output  # says which hardware it assumed
    plan = json.loads(out.read_text())
    for key in ("schema_version",):
        assert key in plan
    assert plan["model"]["name"] == "Wan2.2-TI2V-5B"
    assert set(plan["workload"]) >= {"batch", "frames", "height", "width", "tokens", "steps"}
    assert plan["workload"]["tokens"] == 220 * (81 + 3)
    assert plan["parallel"]["sp_degree"] == 1
    assert set(plan["hardware"]) >= {"name", "peak_tflops", "h2d_gbps", "eta_comp", "eta_pref"}
    assert set(plan["analysis"]) >= {"block_flops_per_gpu", "prefetch_bytes_per_block", "f_star", "regime"}
    assert plan["analysis"]["regime"] in ("hidden", "exposed")
    assert plan["analysis"]["critical"]["axis"] == "frames"
    assert set(plan["offload"]) >= {"mode", "chunk_bytes", "residency"}
    assert set(plan["prediction"]) >= {"step_time_s", "peak_memory_bytes"}
    for mode in ("none", "layerwise"):
        assert set(plan["prediction"]["baselines"][mode]) >= {"step_time_s", "peak_memory_bytes"}
    # the whole pipeline, phase by phase, inside both budgets
    phases = plan["prediction"]["phases"]
    assert set(phases) == {"encode", "denoise", "decode"}
    assert all(p["peak_memory_bytes"] <= 24e9 for p in phases.values())
    assert plan["prediction"]["generation_time_s"] == pytest.approx(sum(p["time_s"] for p in phases.values()))
    assert plan["prediction"]["host_memory_bytes"] <= 128e9 == plan["host_memory_budget_bytes"]
    kinds = [c["kind"] for c in plan["pipeline"]["components"]]
    assert kinds == ["text_encoder", "transformer", "vae"]


def test_transformer_only_keeps_the_papers_rule():
    plan = plan_json("--model", "wan2.2", "--frames", "81", "--mem-budget", "24GB", "--transformer-only")
    assert plan["pipeline"] is None and plan["prediction"]["phases"] is None
    assert plan["offload"]["mode"] == "none"  # a 10 GB model fits in 24 GB: offload would only cost time


def test_small_budget_chooses_chunkflow_and_what_if_overrides_apply():
    plan = plan_json("--model", "wan2.2", "--frames", "41", "--mem-budget", "6GB", "--hardware", "rtx-4090",
                     "--transformer-only")
    assert plan["offload"]["mode"] == "chunkflow"
    assert plan["prediction"]["peak_memory_bytes"] < 6e9
    slow_link = plan_json("--model", "wan2.2", "--frames", "41", "--mem-budget", "6GB", "--hardware", "rtx-4090",
                          "--h2d-gbps", "2", "--max-slowdown", "5", "--transformer-only")
    assert slow_link["hardware"]["h2d_gbps"] == pytest.approx(2.0)
    assert slow_link["analysis"]["f_star"] > plan["analysis"]["f_star"]
    assert "overrides" in slow_link["hardware"]["source"]


def test_target_step_time_flag():
    plan = plan_json("--model", "wan2.2", "--frames", "41", "--mem-budget", "6GB", "--target-step-time", "30s",
                     "--transformer-only")
    assert plan["target_step_time_s"] == pytest.approx(30.0)


def test_saved_profile_is_the_default(tmp_path, monkeypatch):
    from chunkflow_planner.catalog import get_hardware

    config = tmp_path / "cfg"
    config.mkdir()
    profile = get_hardware("h200").model_copy(update={"name": "my-h200", "eta_comp": 0.5})
    import yaml

    (config / "hardware-profile.yaml").write_text(yaml.safe_dump(profile.model_dump()))
    monkeypatch.setenv("CHUNKFLOW_CONFIG_DIR", str(config))
    plan = plan_json("--model", "wan2.2", "--frames", "41")
    assert plan["hardware"]["name"] == "my-h200" and plan["hardware"]["eta_comp"] == 0.5
    assert "saved by chunkflow calibrate" in plan["hardware"]["source"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "wan22"], "Did you mean"),
        (["--model", "wan2.2", "--frames", "80"], "77 or 81"),
        (["--model", "wan2.2", "--mem-budget", "0GB"], "positive"),
        (["--model", "wan2.2", "--mem-budget", "-3GB"], "cannot read size"),
        (["--model", "wan2.2", "--mem-budget", "24XB"], "unknown size unit"),
        (["--model", "wan2.2", "--prefetch-bytes", "0B"], "positive"),
        (["--model", "wan2.2", "--prefetch-bytes", "0"], "no unit"),
        (["--model", "wan2.2", "--mem-budget", "1GB"], "memory is the binding constraint"),
        (["--model", "wan2.2", "--sp", "5"], "--sp must be one of"),
        (["--model", "wan2.2", "--hardware", "h900"], "unknown hardware"),
        (["--model", "wan2.2", "--max-slowdown", "0.5"], ">= 1.0"),
        (["--model", "flux", "--frames", "5"], "image model"),
        (["--model", "wan2.2", "--steps", "0"], "at least 1"),
        (["--model", "flux", "--h2d-gbps", "1e-300"], "--h2d-gbps must be between"),
        (["--model", "tiny", "--eta-pref", "1e-300"], "--eta-pref must be between"),
        (["--model", "tiny", "--peak-tflops", "1e7"], "--peak-tflops must be between"),
    ],
)
def test_bad_input_is_one_clear_error(args, message):
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_malformed_profile_file(tmp_path):
    bad = tmp_path / "profile.yaml"
    bad.write_text("name: x\npeak_tflops: 100\n")
    result = runner.invoke(app, ["plan", "--model", "wan2.2", "--hardware", str(bad)])
    assert result.exit_code == 2
    assert "malformed" in result.output and "h2d_link_gbps" in result.output
    assert "Traceback" not in result.output


def test_models_and_hardware_list_the_catalogs():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and "Wan2.2-TI2V-5B" in result.output and "tiny-wan" in result.output
    result = runner.invoke(app, ["hardware"])
    assert result.exit_code == 0 and "h100-pcie-x2-paper" in result.output and "rtx-4090" in result.output


@pytest.mark.slow
def test_plan_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from chunkflow.commands.cli import app\n"
        "r = CliRunner().invoke(app, ['plan', '--model', 'wan2.2', '--frames', '81', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_tie_with_layerwise_says_what_chunkflow_buys(cli):
    """Where layerwise streaming is predicted as fast and as small as the chosen chunkflow plan (the copies hidden),
    the plan says so and where chunkflow differs; where chunkflow keeps part of each block resident (below the
    critical frames) and layerwise is slower, no such note."""
    from chunkflow_planner.plan import load_plan

    tie = cli("plan", "--model", "wan2.2", "--frames", "121", "--height", "704", "--width", "1280", "--mem-budget",
              "24GB", "--host-mem-budget", "64GB", "--hardware", "h200", "--out", "tie.json")
    assert tie.exit_code == 0, tie.output
    plan = load_plan("tie.json")
    lw = plan.prediction.baselines.layerwise
    assert plan.offload.mode == "chunkflow" and abs(plan.prediction.step_time_s / lw.step_time_s - 1) < 0.005
    text = " ".join(tie.output.split())
    assert "layerwise streaming ties with chunkflow here" in text and "critical frames" in text
    small = cli("plan", "--model", "wan2.2", "--frames", "9", "--height", "480", "--width", "832", "--mem-budget",
                "24GB", "--host-mem-budget", "64GB", "--hardware", "h200", "--out", "small.json")
    assert small.exit_code == 0, small.output
    plan = load_plan("small.json")
    assert plan.prediction.step_time_s < 0.99 * plan.prediction.baselines.layerwise.step_time_s
    assert "ties with chunkflow" not in " ".join(small.output.split())


def test_short_of_host_memory_on_the_cpu_does_not_offer_more_gpu_memory(cli):
    """On the CPU the device's memory is host memory: an infeasible plan there asks for more RAM, not a larger
    --mem-budget (which would need the same RAM); on a GPU it offers both."""
    cpu = cli("plan", "--model", "flux", "--hardware", "cpu", "--host-mem-budget", "20GB")
    text = " ".join(cpu.output.split())
    assert cpu.exit_code == 2 and "host memory is the binding constraint" in text
    assert "device's memory is host memory" in text and "raise --mem-budget" not in text
    gpu = cli("plan", "--model", "flux", "--hardware", "rtx-4090", "--host-mem-budget", "20GB")
    text = " ".join(gpu.output.split())
    assert gpu.exit_code == 2 and "raise --mem-budget so more stays on the GPU" in text
