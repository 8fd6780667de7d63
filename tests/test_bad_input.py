"""Hostile input, generated: flags, plan files, profiles and run reports thrown at the CLI, and settings and plans
at the API. The outcome is always exit 0 or 2 (the package's own error in the API), never a traceback or an
internal error, and no output file is left half-written: after exit 2 an output that did not exist does not exist.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkflow_planner.errors import ChunkflowError

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

NUMBERS = st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e999", "1e-300", "0.5", "1", "2", "81", "1e12", "x",
                           "", "1.05", "12GB", "-3GB", "1e999GB", "16MB", "0B", "0.1B", "5 MiB", "1.2s", "0ms",
                           "nanGB", "infs", "٣", "1_000"])
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                        st.sampled_from([0.0, -1.0, 1.5, 1e308, float("nan"), float("inf")]), st.text(max_size=6),
                        st.just([]), st.just({}))


def _ok_or_clear(result, out=None, existed=False) -> None:
    """Exit 0 or 2 with a one-line error; after exit 2 a new output file was not written."""
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    if out is not None and result.exit_code == 2 and not existed:
        assert not out.exists(), result.output


def _paths(obj, prefix=()):
    """Every path to a value in a JSON object."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw, base: dict) -> dict:
    """`base` with one to three values replaced by arbitrary JSON values or removed."""
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(obj))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return obj


@pytest.fixture(scope="module")
def tiny_plan_json(tmp_path_factory) -> dict:
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    plan["offload"] = {"mode": "chunkflow", "chunk_bytes": 4000, "residency": 0.3, "comm_aware": True}  # streams
    return plan


PLAN_FLAGS = ["--frames", "--batch", "--height", "--width", "--steps", "--sp", "--mem-budget", "--max-slowdown",
              "--target-step-time", "--peak-tflops", "--h2d-gbps", "--eta-comp", "--eta-pref", "--prefetch-bytes",
              "--text-len", "--hardware", "--model", "--weight-dtype", "--cfg-batching"]


@SETTINGS
@given(flags=st.lists(st.tuples(st.sampled_from(PLAN_FLAGS), NUMBERS), min_size=1, max_size=3),
       model=st.sampled_from(["tiny", "wan2.2", "flux"]), out=st.sampled_from(["p.json", "missing/p.json", "."]))
def test_plan_flags(cli, workdir, flags, model, out):
    args = ["plan", "--model", model, "--out", out]
    for flag, value in flags:
        args += [flag, value]
    target = workdir / out
    existed = target.exists()
    result = cli(*args)
    _ok_or_clear(result, target if not target.is_dir() else None, existed)
    if result.exit_code == 0:
        plan = json.loads(target.read_text())  # whole and valid
        assert all(math.isfinite(plan["prediction"][k]) for k in ("step_time_s", "peak_memory_bytes"))
        target.unlink()


@SETTINGS
@given(data=st.data())
def test_plan_files_at_run(cli, workdir, tiny_plan_json, data):
    plan = data.draw(mutated(tiny_plan_json))
    (workdir / "p.json").write_text(json.dumps(plan))
    report = workdir / "r.json"
    result = cli("run", "--plan", "p.json", "--steps", "1", "--warmup", "0", "--device", "cpu", "--report", report)
    _ok_or_clear(result, report)
    if result.exit_code == 0:
        json.loads(report.read_text())
        report.unlink()


@SETTINGS
@given(data=st.data())
def test_hardware_profiles(cli, workdir, data):
    import yaml

    from chunkflow_planner.catalog import get_hardware

    base = json.loads(get_hardware("h200").model_dump_json())
    profile = data.draw(mutated(base))
    (workdir / "hw.yaml").write_text(yaml.safe_dump(profile))
    _ok_or_clear(cli("plan", "--model", "tiny", "--hardware", "hw.yaml", "--json"))


@pytest.fixture(scope="module")
def tiny_report_json(tmp_path_factory, tiny_plan_json) -> dict:
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app

    d = tmp_path_factory.mktemp("report")
    (d / "plan.json").write_text(json.dumps(tiny_plan_json))
    result = CliRunner().invoke(app, ["run", "--plan", str(d / "plan.json"), "--steps", "1", "--device", "cpu",
                                      "--report", str(d / "r.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((d / "r.json").read_text())
    data["gpu"], data["run"]["device"] = "NVIDIA H200", "cuda:0"  # as if measured on a GPU (a refit needs that)
    return data


@SETTINGS
@given(data=st.data())
def test_run_reports_at_refit(cli, workdir, tiny_report_json, data):
    report = data.draw(mutated(tiny_report_json))
    (workdir / "r.json").write_text(json.dumps(report))
    out = workdir / "refit.yaml"
    result = cli("calibrate", "--from-report", "r.json", "--profile", "h200", "--out", out, "--no-save")
    _ok_or_clear(result, out)
    out.unlink(missing_ok=True)


SETTINGS_API = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from(["16MB", "4KB", "x", "", "0.5", "chunkflow", "layerwise", "none", "cpu", "cuda",
                                    "meta", "1e999GB"]), st.just([]), st.just({}))


@SETTINGS_API
@given(mode=VALUES, chunk_size=VALUES, residency=VALUES, comm_aware=VALUES, device=VALUES, plan=VALUES)
def test_offload_keywords_raise_the_packages_error_and_leave_the_module_as_it_was(mode, chunk_size, residency,
                                                                               comm_aware, device, plan):
    import torch

    import chunkflow
    from tiny import wan

    m, blocks, kw = wan()
    before = {n: (p.device, p.dtype, p.detach().clone()) for n, p in m.state_dict().items()}
    try:
        h = chunkflow.offload(m, mode=mode, chunk_size=chunk_size, residency=residency, comm_aware=comm_aware,
                              device=device, plan=plan)
    except ChunkflowError:
        after = m.state_dict()
        assert list(after) == list(before)
        assert all(after[n].device == d and after[n].dtype == t and torch.equal(after[n], v)
                   for n, (d, t, v) in before.items())
        assert type(m).__name__ == "WanTransformer3DModel" and "_chunkflow_handle" not in m.__dict__
        return
    h.remove()


@SETTINGS_API
@given(data=st.data())
def test_plans_given_to_the_api(tiny_plan_json, data):
    import chunkflow
    from chunkflow_planner.catalog import get_model
    import torch
    from diffusers import WanTransformer3DModel

    plan = data.draw(mutated(tiny_plan_json))
    torch.manual_seed(0)
    m = WanTransformer3DModel(**get_model("tiny-wan").diffusers.config)
    try:
        h = chunkflow.offload(m, plan=plan, device="cpu")
    except ChunkflowError:
        assert "_chunkflow_handle" not in m.__dict__
        return
    h.remove()


def test_files_written_atomically_get_ordinary_permissions(tmp_path):
    import os
    import stat

    from chunkflow_planner.files import write_atomic

    umask = os.umask(0o022)
    try:
        p = write_atomic(tmp_path / "plan.json", "{}")
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
        os.chmod(p, 0o600)
        write_atomic(p, "{}")  # an existing file keeps its permissions
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    finally:
        os.umask(umask)
