"""What a newcomer reads in their first hour, checked against what is true: the README's main job on the CPU (its
console, its report, the clip it writes), a plan for the CPU, `chunkflow models` against the plans, a plan for
another machine's hardware. Each test reads the text a user reads."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _main_job() -> list[list[str]]:
    line = next(x for x in README.splitlines() if "chunkflow plan --model demo" in x and "&&" in x)
    return [shlex.split(part.strip())[1:] for part in line.split("&&") if "bin/chunkflow " in part]


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The README's main job run once as written (plan, then run): (plan output, run output, run stderr, folder)."""
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app

    folder = tmp_path_factory.mktemp("main-job")
    mp = pytest.MonkeyPatch()
    mp.setenv("CHUNKFLOW_CONFIG_DIR", str(folder / "config"))
    mp.setenv("COLUMNS", "200")  # a wide terminal: table titles and headers whole
    mp.chdir(folder)
    try:
        results = [CliRunner().invoke(app, step) for step in _main_job()]
    finally:
        mp.undo()
    for r in results:
        assert r.exit_code == 0, r.output
    return _flat(results[0].output), _flat(results[1].stdout), results[1].stderr, folder


def test_the_main_jobs_clip_is_what_the_readme_and_the_console_say(main_job):
    """The clip written is a flat grey square, as the README and the run's note say (not noise)."""
    import imageio.v3 as iio

    _, out, _, folder = main_job
    px = iio.imread(folder / "fox.mp4")
    lo, hi = np.percentile(px, [1, 99])
    assert hi - lo <= 8 and 110 <= px.mean() <= 145, (lo, hi, px.mean())
    m = re.search(r"the output is a flat grey clip \(pixels (\d+)-(\d+) of 255, as decoded; the .mp4's compression "
                  r"moves some by a few levels\)", out)
    # the note reads the frames as decoded; the mp4's lossy encoding moves a flat frame by a level either way
    assert m and int(m.group(1)) - 1 <= px.mean() <= int(m.group(2)) + 1, out
    said = _flat(README[README.index("## Fresh machine"):README.index("## Will it fit")])
    assert "flat grey" in said and "noise" not in said


def test_random_weights_that_give_noise_are_called_noise(cli, workdir):
    """The note describes the pixels written, whatever they are: the tiny FLUX pipeline's random weights give a
    spread of values, and the note says noise with their range."""
    import imageio.v3 as iio

    assert cli("plan", "--model", "tiny-image", "--hardware", "cpu", "--out", "p.json").exit_code == 0
    r = cli("run", "--plan", "p.json", "--prompt", "a fox", "--out", "fox.png")
    assert r.exit_code == 0, r.output
    px = iio.imread(workdir / "fox.png")
    lo, hi = np.percentile(px, [1, 99])
    m = re.search(r"the output is noise \(pixels (\d+)-(\d+) of 255\)", _flat(r.stdout))
    assert m and hi - lo > 8 and (int(m.group(1)), int(m.group(2))) == (int(lo), int(hi)), _flat(r.stdout)


def test_a_cpu_run_compares_no_time_and_says_what_it_compares(main_job):
    """The CPU plan's times are nominal: the report holds no time error anywhere, and the note says, whole, that
    host memory is compared."""
    _, out, _, folder = main_job
    report = json.loads((folder / "run-report.json").read_text())
    assert report["rel_error"]["step_time"] is None
    g = report["generation"]
    assert all(ph["time_error"] is None and ph["predicted_time_s"] is None for ph in g["phases"].values())
    assert g["generation_time_error"] is None and g["load"]["time_error"] is None
    assert g["host_memory_error"] is not None  # host memory is compared
    assert ("the plan's times are nominal figures or a GPU's, so they are not compared here; host memory is compared "
            "(on the CPU the device's memory is host memory).") in out


def test_a_cpu_plan_speaks_of_the_device_and_pins_nothing(main_job):
    """A plan for the CPU never says GPU or pinned, says its times are nominal, and says why its chunk exceeds the
    budget (a chunk never crosses a block)."""
    plan_out, _, _, folder = main_job
    assert "GPU" not in plan_out and "pinned" not in plan_out.lower(), plan_out
    assert "its times are nominal figures, not predictions" in plan_out
    assert "host store" in plan_out and "peak device memory" in plan_out
    plan = json.loads((folder / "plan.json").read_text())
    block = plan["analysis"]["prefetch_bytes_per_block"]
    assert plan["offload"]["chunk_bytes"] > plan["memory_budget_bytes"] > block
    assert re.search(r"chunk 16\.00 MB \(capped at the block: each block's 2\.11 MB streamed is one chunk\)",
                     plan_out), plan_out


def test_a_target_missed_reads_apart_from_the_time_that_missed_it(main_job):
    """"meets no step target T: the fastest takes S": T and S, different numbers, are printed differently."""
    plan_out = main_job[0]
    m = re.search(r"meets the step target ([\d.]+ \w+) .*? the fastest that fits takes ([\d.]+ \w+) a step", plan_out)
    assert m and m.group(1) != m.group(2), plan_out
    m = re.search(r"target ([\d.]+ \w+) per step, ([\d.]+ \w+)(?: \+-[\d.]+%)? predicted", plan_out)  # its band
    assert m and m.group(1) != m.group(2), plan_out


def test_every_phase_bar_ends_full(main_job):
    """The progress bars the run leaves on the terminal: each phase's bar is complete, with a count of what it
    counted (bytes, steps) or `done`; none stays at 0/N."""
    bars = {line.split()[0]: line for line in main_job[2].splitlines() if line.split()}
    assert {"load", "encode", "denoise", "decode"} <= set(bars), main_job[2]
    assert "done" in bars["encode"] and "done" in bars["decode"] and "2/2" in bars["denoise"]
    assert not re.search(r"\b0/\d", main_job[2]), main_job[2]


@pytest.mark.slow
def test_a_load_from_a_folder_says_its_start_up_and_its_read_rate_apart(cli, workdir, tmp_path):
    """A load from a small folder: the start-up (imports, modules) is said apart from the reads, and the rate is
    written in a unit that shows it (never 0.00 GB/s)."""
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny", tmp_path / "tiny")
    assert cli("plan", "--model", "tiny", "--hardware", "cpu", "--out", "p.json").exit_code == 0
    r = cli("run", "--plan", "p.json", "--weights", folder, "--prompt", "a fox")
    assert r.exit_code == 0, r.output
    out = _flat(r.stdout)
    m = re.search(r"load: ([\d.]+ \w+) \(([\d.]+ \w+) of start-up: imports, tokenizers, the modules built, the folder "
                  r"checked\); ([\d.]+ \w+) read in ([\d.]+ \w+) at ([\d.]+) (KB|MB|GB)/s", out)
    assert m, out
    assert float(m.group(5)) > 0 and "0.00 GB/s" not in out
    load = json.loads((workdir / "run-report.json").read_text())["generation"]["load"]
    assert 0 < load["startup_s"] < load["measured_time_s"] and load["read_seconds"] > 0
    assert load["pin_seconds"] == load["pin_wait_seconds"] == 0.0  # timed, and nothing page-locked on the CPU
    assert "time not predicted" not in out  # a CPU plan's load time is nominal: nothing to calibrate for it


def _models_table(cli) -> dict[str, tuple[str, str]]:
    """name -> (transformer, pipeline) as `chunkflow models` prints them."""
    r = cli("models")
    assert r.exit_code == 0, r.output
    rows = {}
    for line in r.output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5 and cells[0] and cells[2]:  # a model's first line: its name (its aliases below it)
            rows[cells[0]] = (cells[2], cells[3])
    return rows


@pytest.mark.parametrize("model", ["wan2.2-a14b", "wan2.2", "flux", "qwen-image", "tiny"])
def test_chunkflow_models_prints_the_bytes_the_planner_loads(cli, workdir, model):
    """The pipeline's weights `chunkflow models` prints are the components a plan counts (both of Wan2.2-A14B's
    experts: its 69 GB, not one expert's 40.5 GB)."""
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.units import format_bytes

    r = cli("plan", "--model", model, "--host-mem-budget", "1TB", "--hardware", "h200", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    comps = plan["pipeline"]["components"]
    name = get_model(model).name
    transformer, pipeline = _models_table(cli)[name]
    assert pipeline == format_bytes(sum(c["bytes"] for c in comps))
    experts = [c for c in comps if c["kind"] == "transformer"]
    assert transformer == (f"{len(experts)} x " if len(experts) > 1 else "") + format_bytes(experts[0]["bytes"])


def test_a_plan_for_another_machine_does_not_take_this_ones_ram(cli, workdir):
    """--hardware naming another machine: no host budget is checked (this machine's RAM says nothing of it), the
    memory needed is printed with how to check one; the same plan without --hardware, or for the CPU, uses this
    machine's memory; --host-mem-budget still binds."""
    from chunkflow_planner.pipeline.hostinfo import default_host_budget

    args = ["plan", "--model", "wan2.2", "--frames", "41", "--height", "480", "--width", "832", "--mem-budget", "8GB"]
    r = cli(*args, "--hardware", "h200", "--out", "other.json")
    assert r.exit_code == 0, r.output
    plan = json.loads((workdir / "other.json").read_text())
    assert plan["host_memory_budget_bytes"] is None and plan["prediction"]["host_memory_bytes"] > 20e9
    assert "no host budget checked: --hardware h200 names another machine" in _flat(r.output)
    assert "give --host-mem-budget to plan inside one" in _flat(r.output)
    mine = cli(*args, "--out", "mine.json")
    assert mine.exit_code in (0, 2)
    if mine.exit_code == 0:
        assert json.loads((workdir / "mine.json").read_text())["host_memory_budget_bytes"] == default_host_budget()[0]
    else:
        assert "host memory is the binding constraint" in _flat(mine.output)
    small = cli(*args, "--hardware", "h200", "--host-mem-budget", "4GB")
    assert small.exit_code == 2 and "host memory is the binding constraint" in _flat(small.output)
    cpu = cli("plan", "--model", "demo", "--hardware", "cpu", "--out", "cpu.json")
    assert cpu.exit_code == 0
    assert json.loads((workdir / "cpu.json").read_text())["host_memory_budget_bytes"] == default_host_budget()[0]


def test_a_synthetic_cpu_run_of_a_cpu_plan_compares_no_time(cli, workdir, monkeypatch):
    """`chunkflow run --plan` without a prompt (the transformer's steps) on a CPU plan: no time error in the report,
    no GPU in the table, the host store measured against the plan's, and a note saying the times are nominal."""
    monkeypatch.setenv("COLUMNS", "200")
    assert cli("plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--out", "p.json").exit_code == 0
    r = cli("run", "--plan", "p.json", "--report", "r.json")
    assert r.exit_code == 0, r.output
    out = _flat(r.stdout)
    report = json.loads((workdir / "r.json").read_text())
    assert report["rel_error"]["step_time"] is None
    assert "GPU" not in out and "pinned" not in out
    assert re.search(r"host store \(not page-locked\) │ [\d.]+ MB │ [\d.]+ MB", out), out
    assert "its times are nominal figures, not predictions, so they are not compared" in out


def test_a_bench_on_the_cpu_profile_compares_no_time(cli, workdir, monkeypatch):
    """`chunkflow bench --hardware cpu` printed +72650% errors against the CPU profile's nominal times: no error is
    computed or shown, and the summary says why."""
    monkeypatch.setenv("COLUMNS", "200")
    r = cli("bench", "--model", "tiny", "--frames", "5", "--hardware", "cpu", "--out", "b", "--no-plots")
    assert r.exit_code == 0, r.output
    assert "%" not in r.stdout.split("measured vs predicted")[-1], r.stdout
    import pandas as pd

    assert pd.read_csv(workdir / "b" / "bench.csv")["err_step"].isna().all()
    assert "the profile `cpu`'s times are nominal figures" in (workdir / "b" / "summary.md").read_text()
