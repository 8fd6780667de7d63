"""scripts/diffusers_load.py, the GPU evidence's bit-for-bit reference (issues 54 and the ones before): given a plan,
diffusers generates the plan's own workload, so the latents it compares are those `chunkflow run --plan` made. It once
took the shape from the model's defaults with the plan given (Wan2.2's 121 frames where the plan said 81), so on the
H100 the check compared latents of different shapes and said "not identical" with no difference to show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import one_thread, save_catalog_pipeline

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]


def test_a_plans_shape_not_the_models_default_is_what_diffusers_generates_and_compares(cli, workdir):
    from chunkflow_planner.catalog import get_model

    default = get_model("tiny").default_workload
    frames, height = default.frames + 4, default.height + 16  # not the model's defaults
    folder = save_catalog_pipeline("tiny", workdir / "tiny")
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--frames", frames, "--height", height,
                 "--steps", 3, "--out", "plan.json")
    assert result.exit_code == 0, result.output
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", folder, "--prompt", "a red fox in the snow",
                     "--seed", 0, "--cache", "first-block:0.3", "--latents", "ours.safetensors")
    assert result.exit_code == 0, result.output
    script = [sys.executable, str(ROOT / "scripts" / "diffusers_load.py"), "plan.json", str(folder),
              "--prompt", "a red fox in the snow", "--seed", "0", "--device", "cpu", "--cache", "first-block:0.3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(script + ["--latents", "ours.safetensors", "--out", "d.json"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads((workdir / "d.json").read_text())
    assert got["latents_identical"] is True and got["latents_max_abs_diff"] == 0.0
    # the flags still replace the plan's: other frames give other latents, and the check says so
    done = subprocess.run(script + ["--frames", str(default.frames), "--latents", "ours.safetensors", "--out", "e.json"],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    other = json.loads((workdir / "e.json").read_text())
    assert other["latents_identical"] is False and other["latents_max_abs_diff"] is None  # shapes differ
