"""Run a test file's `_worker` on N gloo processes under torchrun (used by the SP tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_torchrun(nproc: int, args: list[str], timeout: int = 300, **env_extra: str) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc ARGS` on the CPU (gloo), with src/ on the path; asserts success."""
    pytest.importorskip("diffusers")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not found next to the Python interpreter")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                       os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **env_extra)
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


def run_workers(test_file: str, nproc: int, out: Path, timeout: int = 300) -> dict:
    """`torchrun --nproc-per-node nproc test_file out` on the CPU; returns the JSON rank 0 wrote to `out`."""
    run_torchrun(nproc, [test_file, str(out)], timeout)
    return json.loads(out.read_text())


def padded_inputs(spec, seed: int = 3) -> dict:
    """fp32 CPU inputs for a tiny spec; HunyuanVideo's last 5 text tokens padded, so its mask crosses the shards."""
    import torch
    from test_models import _workload

    from chunkflow.models.inputs import make_inputs

    kw = make_inputs(spec, _workload(spec), torch.float32, "cpu", seed=seed)
    if "encoder_attention_mask" in kw:
        kw["encoder_attention_mask"][:, -5:] = 0
    return kw


def single_and_sp(spec, kw: dict, world: int):
    """(single-process output, Ulysses SP output) of one fp32 build of `spec` (seed 1), no offload."""
    import torch

    from chunkflow.models.build import build_transformer
    from chunkflow.parallel import enable_sequence_parallel

    m, h = build_transformer(spec, dtype=torch.float32, device="cpu", mode="none", seed=1)
    with torch.no_grad():
        ref = m(**kw)[0]
    enable_sequence_parallel(m, spec, world)
    with torch.no_grad():
        sp = m(**kw)[0]
    h.remove()
    return ref, sp
