"""The whole pipeline planned under Ulysses SP (issue 40, the planner's half): every rank runs every phase on its
own GPU, and host memory is counted per host, M_host = M_shared + n M_rank (pipeline/hostshare.py), with what the
host's ranks share (the streamed host-tier tails, the parked components) once unless --no-share-host."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow_planner.catalog import get_hardware, get_model
from chunkflow_planner.memory import block_volumes
from chunkflow_planner.offload import disk_block_indices, resident_bytes
from chunkflow_planner.plan import load_plan
from chunkflow_planner.planner import ResolvedHardware, make_plan
from chunkflow_planner.policy import Infeasible, Problem
from chunkflow_planner.units import format_bytes
from chunkflow_planner.workload import make_workload

GB = 10**9
runner = CliRunner()
pytestmark = pytest.mark.usefixtures("workdir")  # no saved profile

ISSUE = ["--model", "wan2.1-14b", "--frames", "81", "--height", "480", "--width", "832", "--sp", "2",
         "--hardware", "h200-x2", "--mem-budget", "16GB"]


def _hw(name: str = "h200-x2", **update) -> ResolvedHardware:
    return ResolvedHardware(get_hardware(name).model_copy(update=update), "test", this_machine=False, named=name)


def _wan():
    spec = get_model("wan2.1-14b")
    return spec, make_workload(spec, frames=81, height=480, width=832)


def _plan(sp: int = 2, share_host: bool = True, host_budget: int | None = None, hw: ResolvedHardware | None = None,
          **kw):
    spec, w = _wan()
    plan, decision, _ = make_plan(spec, w, hw or _hw(), sp=sp, budget=16 * GB, host_budget=host_budget,
                                  share_host=share_host, **kw)
    return plan, decision


def _tails(spec, offload) -> int:
    """The host tier's streamed tails, from the model's block volumes and the plan's offload setting (raw bf16)."""
    assert offload.weight_dtype == "bf16" and offload.codec == "none"
    V = block_volumes(spec)
    disk = set(disk_block_indices(len(V), offload.disk_blocks))
    C = offload.chunk_bytes
    R = [V_l if offload.mode == "none" else 0 if C is None else resident_bytes(V_l, C, offload.residency) for V_l in V]
    return int(sum(v - r for l, (v, r) in enumerate(zip(V, R)) if l not in disk))


def _shareable(plan, spec) -> int:
    """What the host's ranks share, from independent quantities: the transformer's streamed tails and every
    component placed `phase` whole (a streamed text encoder's layers)."""
    out = 0
    for c in plan.pipeline.components:
        if c.placement == "phase":
            out += c.bytes
        elif c.kind == "transformer" and c.placement == "stream":
            out += _tails(spec, plan.offload)
        elif c.kind == "text_encoder" and c.placement == "stream":
            te = next(t for t in spec.pipeline.text_encoders if t.component == c.name)
            out += te.layer_params * te.dtype_bytes * te.shape()["layers"]
    return out


@pytest.fixture(scope="module")
def shared_plan():
    return _plan()


@pytest.fixture(scope="module")
def private_plan():
    return _plan(share_host=False)


def test_sp2_plans_the_whole_pipeline_with_the_sp_step(shared_plan):
    plan, _ = shared_plan
    spec, w = _wan()
    assert plan.parallel.sp_degree == 2 and plan.pipeline is not None
    kinds = {c.kind for c in plan.pipeline.components}
    assert kinds == {"text_encoder", "transformer", "vae"}
    pp = plan.prediction
    assert pp.phases is not None and pp.host_memory_bytes is not None and pp.load is not None
    # the denoise phase is the transformer's SP=2 step, the one the sp paths predict (half the tokens a rank)
    two = Problem(spec, w, get_hardware("h200-x2"), 2).evaluate(plan.offload)
    one = Problem(spec, w, get_hardware("h200-x2"), 1).evaluate(plan.offload)
    assert pp.step_time_s == pytest.approx(two.step_time, rel=1e-9)
    assert pp.phases.denoise.parts_s["steps"] == pytest.approx(w.steps * two.step_time, rel=1e-9)
    assert two.step_time < 0.6 * one.step_time
    # each GPU holds its budget in every phase
    for ph in ("encode", "denoise", "decode"):
        assert getattr(pp.phases, ph).peak_memory_bytes <= plan.memory_budget_bytes


def test_host_memory_per_host_is_shared_once_plus_each_rank(shared_plan):
    plan, _ = shared_plan
    spec, _ = _wan()
    pp = plan.prediction
    assert pp.host_memory_shared_bytes == pytest.approx(_shareable(plan, spec), abs=4)
    assert _tails(spec, plan.offload) > 25 * GB  # Wan2.1-14B streams about 28 GB of its 28.6 GB
    assert pp.host_memory_bytes == pp.host_memory_shared_bytes + 2 * pp.host_memory_per_rank_bytes
    # one rank's holders (the process, the parked text encoder, the transformer's store, ...) less what is shared
    assert pp.host_memory_per_rank_bytes == pytest.approx(sum(pp.host_memory.values()) - pp.host_memory_shared_bytes,
                                                          abs=len(pp.host_memory))
    assert plan.offload.share_host is True


def test_no_share_host_grows_by_the_shared_bytes(shared_plan, private_plan):
    (on, _), (off, _) = shared_plan, private_plan
    assert off.offload.share_host is False
    assert [c.placement for c in off.pipeline.components] == [c.placement for c in on.pipeline.components]
    a, b = on.prediction, off.prediction
    assert b.host_memory_shared_bytes == 0
    assert b.host_memory_bytes == 2 * b.host_memory_per_rank_bytes
    assert b.host_memory_bytes - a.host_memory_bytes == a.host_memory_shared_bytes
    assert a.host_memory_shared_bytes > 0.8 * a.host_memory_bytes  # the parked encoder and the transformer's tails


def test_load_reads_the_shared_bytes_once(shared_plan, private_plan):
    """Every component's parameters are read (nothing on disk): rank 0 reads all, the other only its own part."""
    spec, _ = _wan()
    total = sum(spec.component_bytes().values())
    (on, _), (off, _) = shared_plan, private_plan
    s = on.prediction.host_memory_shared_bytes
    assert on.prediction.load.read_bytes == pytest.approx(2 * total - s, abs=8)
    assert off.prediction.load.read_bytes == pytest.approx(2 * total, abs=8)
    ld = on.prediction.load
    assert ld.host_peak_per_host_bytes == pytest.approx(s + 2 * (ld.host_peak_bytes - s), abs=8)


def test_a_host_budget_between_the_two_fits_shared_only(shared_plan, private_plan):
    on, off = shared_plan[0].prediction.host_memory_bytes, private_plan[0].prediction.host_memory_bytes
    budget = (on + off) // 2
    plan, _ = _plan(host_budget=budget, host_mem_margin=0.0)
    assert plan.prediction.host_memory_bytes == on <= budget
    assert [c.placement for c in plan.pipeline.components] == \
           [c.placement for c in shared_plan[0].pipeline.components]
    # without sharing, and no disk rate to spill to: host memory binds, and the words name the shared copy
    assert get_hardware("h200-x2").disk_read_gbps is None
    with pytest.raises(Infeasible) as exc:
        _plan(share_host=False, host_budget=budget, host_mem_margin=0.0)
    assert exc.value.facts.binding == "host memory"
    said = " ".join(str(exc.value).split())
    assert "per host" in said and "leave out --no-share-host" in said
    # with a disk rate, the private copies are placed differently: part of the pipeline goes to disk
    placed, _ = _plan(share_host=False, host_budget=budget, host_mem_margin=0.0, hw=_hw(disk_read_gbps=3.0))
    assert placed.prediction.host_memory_bytes <= budget
    assert placed.prediction.disk_read_bytes_per_generation > 0


def test_sharing_fits_64gb_where_private_copies_do_not():
    """The issue's case: a 64 GB host, SP=2, Wan2.1-14B (28 GB of streamed weights a copy)."""
    plan, _ = _plan(host_budget=64 * GB)
    assert plan.prediction.host_memory_bytes * (1 + plan.host_memory_margin) <= 64 * GB
    with pytest.raises(Infeasible):
        _plan(share_host=False, host_budget=64 * GB)


@pytest.mark.parametrize("model, hw, budget, host, disk", [
    ("wan2.1-14b", "h200", 16, 64, None),
    ("a14b", "rtx-4090", 24, 32, 1.5),
    ("wan2.2", "h200", 12, 20, 1.5),
])
def test_sp1_plans_do_not_change_with_sharing(model, hw, budget, host, disk):
    """One rank holds every byte once: the plan is the same with or without sharing (but the flag), and its host
    memory is one process's, as before SP was planned."""
    spec = get_model(model)
    w = make_workload(spec, frames=81) if model != "wan2.1-14b" else _wan()[1]
    hardware = _hw(hw, **({"disk_read_gbps": disk} if disk else {}))
    plans = [make_plan(spec, w, hardware, budget=budget * GB, host_budget=host * GB, share_host=s)[0]
             for s in (True, False)]
    a, b = (json.loads(p.to_json()) for p in plans)
    assert a["offload"].pop("share_host") is True and b["offload"].pop("share_host") is False
    assert a == b
    pp = plans[0].prediction
    assert pp.host_memory_shared_bytes is None and pp.host_memory_per_rank_bytes is None
    assert pp.load.host_peak_per_host_bytes is None
    assert pp.host_memory_bytes == pytest.approx(sum(pp.host_memory.values()), abs=len(pp.host_memory))


def test_an_sp_plan_file_reads_back_and_jobs_price_it_per_host(shared_plan, tmp_path):
    from chunkflow_planner.pipeline.jobs import placement_estimate

    plan, _ = shared_plan
    plan.write(tmp_path / "plan.json")
    back = load_plan(tmp_path / "plan.json")
    assert back.prediction.host_memory_shared_bytes == plan.prediction.host_memory_shared_bytes
    spec, w = _wan()
    e = placement_estimate(back, spec, get_hardware("h200-x2"), w)
    assert e.ranks == 2 and e.host_memory == plan.prediction.host_memory_bytes


# ---------------------------------------------------------------------------------------------------------- CLI


def _said(result) -> str:
    return " ".join(result.output.split())


def test_cli_prints_the_host_split_line():
    plan = json.loads(runner.invoke(app, ["plan", *ISSUE, "--json"]).stdout)
    pp = plan["prediction"]
    result = runner.invoke(app, ["plan", *ISSUE])
    assert result.exit_code == 0, result.output
    line = (f"host memory {format_bytes(pp['host_memory_bytes'])} per host: "
            f"{format_bytes(pp['host_memory_shared_bytes'])} shared once + 2 x "
            f"{format_bytes(pp['host_memory_per_rank_bytes'])} per rank")
    assert line in _said(result)
    assert "Components (the whole pipeline)" in result.output
    assert "plan the transformer alone" not in _said(result)


def test_cli_no_share_host():
    result = runner.invoke(app, ["plan", *ISSUE, "--no-share-host", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    pp = plan["prediction"]
    assert plan["offload"]["share_host"] is False and pp["host_memory_shared_bytes"] == 0
    said = _said(runner.invoke(app, ["plan", *ISSUE, "--no-share-host"]))
    assert (f"host memory {format_bytes(pp['host_memory_bytes'])} per host: 2 x "
            f"{format_bytes(pp['host_memory_per_rank_bytes'])} per rank") in said
    assert "shared once" not in said
    refused = runner.invoke(app, ["plan", *ISSUE, "--no-share-host", "--host-mem-budget", "64GB"])
    assert refused.exit_code == 2 and "leave out --no-share-host" in _said(refused)
    helped = _said(runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200"}))
    assert "--no-share-host" in helped and "shared by the host's ranks" in helped


def test_with_the_codec_the_encoded_tails_are_what_the_ranks_share():
    """FLUX at 1024x1024 under SP=2 with the codec on: local rank 0 encodes the host tier's tails once
    (runtime/codecs/layer.py over the shared tier), so the shared bytes hold them encoded, at the codec's ratio of the
    raw tails, beside the parked components whole."""
    from chunkflow_planner.codec import codec_ratio

    spec = get_model("flux")
    plans = {}
    for codec in ("off", "on"):
        r = runner.invoke(app, ["plan", "--model", "flux", "--height", "1024", "--width", "1024", "--steps", "8",
                                "--sp", "2", "--hardware", "h200-x2", "--mem-budget", "6GB", "--codec", codec,
                                "--out", f"flux-{codec}.json"])
        assert r.exit_code == 0, r.output
        plans[codec] = load_plan(f"flux-{codec}.json")
    on, off = plans["on"], plans["off"]
    assert on.offload.codec != "none" and off.offload.codec == "none" and on.offload.disk_blocks == 0
    rho = codec_ratio(get_hardware("h200-x2"))[0]
    raw_cfg = on.offload.model_copy(update={"codec": "none"})
    raw = _tails(spec, raw_cfg)
    others = _shareable(on.model_copy(update={"offload": raw_cfg}), spec) - raw  # the text encoder, parked parts
    assert on.prediction.host_memory_shared_bytes == pytest.approx(others + rho * raw, rel=1e-6)
    assert off.prediction.host_memory_shared_bytes == _shareable(off, spec)
