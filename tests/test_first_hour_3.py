"""Issue 53, a newcomer's first hour (round three): what `run` says from its first second, the words that
contradicted each other, and the third-party notices dropped (only those). Each test reads what a user reads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The README's main job, plan then run, as a user's process: (run's stdout, its stderr, folder)."""
    folder = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CHUNKFLOW_CONFIG_DIR": str(folder / "config"),
           "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "chunkflow"]
    plan = subprocess.run(cmd + ["plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--out",
                                 "plan.json"], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    stdout, err, code = _on_a_terminal(cmd + ["run", "--plan", "plan.json", "--prompt", "a red fox in the snow",
                                               "--out", "fox.mp4"], folder, env)
    assert code == 0, err
    return stdout, err, folder


def _on_a_terminal(cmd: list[str], cwd: Path, env: dict) -> tuple[str, str, int]:
    """`cmd` run with its stderr on a pseudo-terminal, as a user sees it: (stdout, stderr, exit code)."""
    import pty
    import threading

    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=slave, text=True, timeout=600)
    os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    import re

    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))  # the bars' redraws
    return proc.stdout, err.replace("\r\n", "\n").replace("\r", "\n"), proc.returncode


@pytest.mark.slow
def test_run_says_it_loads_torch_first_and_counts_the_imports_in_its_start_up(demo_run):
    """The first line `run` prints is the imports it is waiting for; the start-up it reports holds them, and the
    report keeps their seconds."""
    out, err, folder = demo_run
    assert err.splitlines()[0] == "loading torch and diffusers ...", err[:500]
    report = json.loads((folder / "run-report.json").read_text())["generation"]["load"]
    assert report["imports_s"] > 0
    said = _flat(out)
    total = report["imports_s"] + report["startup_s"]
    assert f"start-up: " in said and "importing torch and diffusers" in said, said
    from chunkflow_planner.units import format_seconds

    assert f"start-up: {format_seconds(total)} ({format_seconds(report['imports_s'])} importing" in said


@pytest.mark.slow
def test_a_cpu_run_names_the_cpu_where_each_part_runs(demo_run):
    """On the CPU no component is said to be on a GPU (the plan's `gpu` placement is the device: the CPU)."""
    _, err, _ = demo_run
    lines = [ln.strip() for ln in err.splitlines() if ln.strip().startswith(("transformer:", "text_encoder:", "vae:"))]
    assert lines and not any("gpu" in ln for ln in lines), lines
    assert "vae: on the device, the CPU (tiled decode)" in lines, lines


@pytest.mark.slow
def test_the_demo_note_says_its_pixels_are_the_frames_before_the_encoding(demo_run):
    out, _, _ = demo_run
    assert "as decoded; the .mp4's compression moves some by a few levels" in _flat(out)


def test_chunkflow_models_at_80_columns_shows_every_name_whole(cli, monkeypatch):
    """Every name --model takes (the name, `qwen-image`, every alias) is printed whole at 80 columns."""
    from chunkflow_planner.catalog import get_model, load_models

    monkeypatch.setenv("COLUMNS", "80")
    r = cli("models")
    assert r.exit_code == 0, r.output
    cells = {c.strip() for line in r.output.splitlines() for c in line.split("│")[1:2]}
    assert max(len(line) for line in r.output.splitlines()) <= 80
    for spec in load_models().values():
        for name in [spec.name, *spec.aliases]:
            assert name in cells, name
            assert get_model(name) is spec
    assert "qwen-image" in cells and get_model("qwen-image").name == "Qwen-Image"


def test_a_residency_is_written_to_three_digits():
    from chunkflow_planner.offload import OffloadConfig

    label = OffloadConfig("chunkflow", 16 * 2**20, 1 / 3).label
    assert "r=0.333 " in label + " " and "0.333333" not in label


def test_a_tokenizer_folder_is_not_called_tokenizer_tokenizer(tmp_path):
    """A damaged tokenizer/ folder is named once in the error."""
    from chunkflow.models.folder_parts import load_tokenizer
    from chunkflow_planner.checkpoint import CheckpointError
    from transformers import T5TokenizerFast

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{ not json")
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tmp_path, "tokenizer", T5TokenizerFast)
    assert "tokenizer tokenizer" not in str(info.value) and "tokenizer" in str(info.value)


def test_known_harmless_notices_are_dropped_and_other_warnings_kept(caplog):
    """diffusers' float32 notice naming no module and transformers' torchvision fallback are dropped, whole; the
    same float32 notice naming a module, and any other warning, reaches the user."""
    from chunkflow.notices import quiet_known_notices

    quiet_known_notices()
    quiet_known_notices()  # once is enough: no second filter
    d = logging.getLogger("diffusers.models.modeling_utils")
    t = logging.getLogger("transformers.utils.import_utils")
    assert [type(f).__name__ for f in d.filters].count("_DropKnown") == 1
    tail = ("Casting directly with `to()` can lead to inconsistent results; set `torch_dtype` in `from_pretrained()` "
            "instead to keep these modules in float32.")
    with caplog.at_level(logging.WARNING):
        d.warning(f"There are modules in WanTransformer3DModel that should be kept in float32: []. {tail}")
        t.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` "
                  "for backward compatibility. Install torchvision to use the default backend, or import "
                  "`CLIPImageProcessorPil` directly to silence this warning.")
        d.warning(f"There are modules in WanTransformer3DModel that should be kept in float32: ['norm']. {tail}")
        d.warning("something else diffusers says")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "['norm']" in said[0] and said[1] == "something else diffusers says", said


def test_the_float32_notice_of_a_real_cast_is_dropped(caplog):
    """The notice as diffusers raises it (a model with no float32 modules cast with `.to(dtype)`) is dropped."""
    import torch
    from diffusers import WanTransformer3DModel

    from chunkflow.notices import quiet_known_notices

    quiet_known_notices()
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1)
    m._keep_in_fp32_modules = []
    with caplog.at_level(logging.WARNING):
        m.to(torch.bfloat16)
    assert not [r for r in caplog.records if "kept in float32" in r.getMessage()]


@pytest.mark.slow
def test_an_infeasible_plan_of_a_folder_names_its_workload_and_one_that_fits(cli, workdir):
    """Issue 53 item 1: `plan --weights DIR` over its budget says the workload it assumed (the folder's pipeline
    defaults: LTX-Video's 161 frames at 704x512, 50 steps) and a smaller one that fits, as flags; planned with those
    flags it fits."""
    import re

    from test_run_any import _ltx

    _ltx(workdir / "ltx")
    budgets = ["--hardware", "cpu", "--mem-budget", "200MB", "--host-mem-budget", "8GB"]
    r = cli("plan", "--weights", "ltx", *budgets)
    assert r.exit_code == 2
    said = _flat(r.output)
    assert said.startswith("infeasible:") and "(planned for 161 frames at 704x512, 50 steps;" in said, said
    m = re.search(r"fits these budgets: (--frames \d+ --height \d+ --width \d+)\)", said)
    assert m, said
    r = cli("plan", "--weights", "ltx", *budgets, *m.group(1).split())
    assert r.exit_code == 0, r.output
