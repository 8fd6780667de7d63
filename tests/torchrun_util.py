"""Run a test file's `_worker` on N gloo processes under torchrun (used by the SP tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_workers(test_file: str, nproc: int, out: Path, timeout: int = 300) -> dict:
    """`torchrun --nproc-per-node nproc test_file out` on the CPU; returns the JSON rank 0 wrote to `out`."""
    pytest.importorskip("diffusers")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not found next to the Python interpreter")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), test_file, str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text())
