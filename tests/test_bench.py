"""`chunkflow bench` on the tiny model on the CPU: CSV and plots, and bad input."""

import pandas as pd
import pytest
from typer.testing import CliRunner

from chunkflow.bench import COLUMNS
from chunkflow.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKFLOW_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)


def test_bench_writes_csv_and_plots(tmp_path):
    result = runner.invoke(app, ["bench", "--model", "tiny", "--frames", "5,9", "--residency", "0,0.5",
                                 "--chunk-sizes", "4KB", "--steps", "1", "--out", "b"])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(tmp_path / "b" / "bench.csv")
    assert list(df.columns) == COLUMNS
    assert len(df) == 2 * (1 + 1 + 2)  # frames x (none, layerwise, chunkflow at two residencies)
    assert set(df["mode"]) == {"none", "layerwise", "chunkflow"}
    assert (df["measured_step_s"] > 0).all() and (df["predicted_step_s"] > 0).all()
    assert df["err_step"].tolist() == pytest.approx(
        ((df["measured_step_s"] - df["predicted_step_s"]) / df["predicted_step_s"]).tolist())
    cf = df[(df["mode"] == "chunkflow") & (df["residency"] == 0.5)]
    assert (cf["achieved_residency"] > 0.3).all()
    for name in ("step_time.png", "memory.png", "residency.png", "roofline.png"):
        path = tmp_path / "b" / name
        assert path.exists() and path.stat().st_size > 10_000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny"], "exactly one of"),
    (["--model", "tiny", "--frames", "6"], "1 mod 4"),
    (["--model", "tiny", "--frames", "5", "--modes", "fast"], "unknown mode"),
    (["--model", "tiny", "--frames", "5", "--residency", "2"], "[0, 1]"),
    (["--model", "tiny", "--frames", "5", "--chunk-sizes", "4QB"], "unknown size unit"),
    (["--model", "nosuch", "--frames", "5"], "unknown model"),
    (["--model", "tiny", "--frames", "a,b"], "comma-separated"),
])
def test_bench_bad_input(args, message):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
