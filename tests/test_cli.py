"""The command line's basics: help everywhere (-h and --help), --version, bare `chunkflow`, `python -m chunkflow`."""

import subprocess
import sys

import pytest

from chunkflow_planner import __version__
from chunkflow_planner.plan import PLAN_SCHEMA_VERSION

COMMANDS = ("plan", "run", "bench", "calibrate", "models", "hardware")


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(cli, command, flag):
    result = cli(command, flag)
    assert result.exit_code == 0 and "Usage" in result.output and command in result.output


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(cli, flag):
    result = cli(flag)
    assert result.exit_code == 0 and result.output.strip() == f"chunkflow {__version__} (the chunkflow-dit package)"


def test_bare_chunkflow_prints_help_and_succeeds(cli):
    result = cli()
    assert result.exit_code == 0
    assert all(c in result.output for c in COMMANDS)


def test_unknown_command_is_an_error(cli):
    result = cli("nosuch")
    assert result.exit_code == 2 and "No such command" in result.output


@pytest.mark.slow
def test_python_dash_m_chunkflow(workdir):
    p = subprocess.run([sys.executable, "-m", "chunkflow", "plan", "--model", "tiny", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f'"schema_version": {PLAN_SCHEMA_VERSION}' in p.stdout
    v = subprocess.run([sys.executable, "-m", "chunkflow", "-V"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and __version__ in v.stdout
