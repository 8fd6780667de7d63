"""Shared fixtures: a private config directory and working directory per test, the CLI, a tiny plan, and the
torchrun launcher for the multi-process tests. Tests marked `slow` start subprocesses or torchrun jobs:
`pytest -m "not slow"` skips them while iterating; the README's test command runs everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory and chunkflow config directory (no saved profile)."""
    monkeypatch.setenv("CHUNKFLOW_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def cli(workdir):
    """cli(*args) -> click Result of `chunkflow *args`, run in `workdir`."""
    from chunkflow.commands.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def tiny_plan(cli, workdir) -> Path:
    """plan.json for the tiny catalog model (default budget: mode none)."""
    result = cli("plan", "--model", "tiny", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json"


def run_torchrun(nproc: int, args: list[str], timeout: int = 300, **env_extra: str) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc ARGS` on the CPU (gloo), with src/ on the path and Python's
    fault handler on in the ranks; asserts success."""
    pytest.importorskip("diffusers")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not found next to the Python interpreter")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1", **env_extra)
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    # a rank killed by a signal (an abort in C++) dumps every thread's Python stack (PYTHONFAULTHANDLER) before
    # torchrun's own traceback: the tail keeps room for both
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-16000:]
    return p


@pytest.fixture(scope="session")
def torchrun():
    """torchrun(nproc, args, timeout=300, **env) -> CompletedProcess; see run_torchrun."""
    return run_torchrun


@pytest.fixture(scope="session")
def workers():
    """workers(test_file, nproc, out, timeout=300) -> the JSON rank 0 of `torchrun test_file out` wrote to `out`."""

    def run(test_file: str, nproc: int, out: Path, timeout: int = 300) -> dict:
        run_torchrun(nproc, [test_file, str(out)], timeout)
        return json.loads(out.read_text())

    return run
