"""The README's fresh-machine commands: the test command is the one CI runs, and the main job runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme
    assert "pytest" in ci and "torch==2.13.0" in ci


def test_the_readme_main_job_runs(cli, workdir):
    """The README's first command on a fresh machine, after its install: plan the tiny pipeline under the small
    budget it gives (offload visibly engaged), then generate from the prompt; both exit 0 and write what they say."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "chunkflow plan --model tiny" in x and "&&" in x)
    steps = [shlex.split(part.strip()) for part in line.split("&&") if "bin/chunkflow " in part]
    assert [s[1] for s in steps] == ["plan", "run"]
    for step in steps:
        result = cli(*step[1:])
        assert result.exit_code == 0, result.output
    plan = __import__("json").loads((workdir / "plan.json").read_text())
    assert plan["offload"]["mode"] != "none" or any(c["placement"] != "gpu" for c in plan["pipeline"]["components"])
    out = next(s[s.index("--out") + 1] for s in steps if s[1] == "run")
    assert (workdir / out).stat().st_size > 0 and (workdir / "run-report.json").exists()
