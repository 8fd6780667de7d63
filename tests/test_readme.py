"""The README's fresh-machine test command is the one CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme
    assert "pytest" in ci and "torch==2.13.0" in ci
