"""The planner's memory tiers (issue 36): every component on the GPU, in pinned host memory or on disk, chosen by
cost; the host margin; --disk-gbps; and the planner's bytes against the runtime's layout of the catalog models."""

from __future__ import annotations

import json

import pytest

from chunkflow_planner.catalog import HardwareSpec, get_hardware, get_model, load_models
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.planner import ResolvedHardware, make_plan
from chunkflow_planner.policy import Infeasible
from chunkflow_planner.workload import make_workload

GB = 10**9


def _h200(disk_gbps: float | None = 1.5) -> ResolvedHardware:
    return ResolvedHardware(get_hardware("h200").model_copy(update={"disk_read_gbps": disk_gbps}), "test")


def _wan5b(steps: int, disk_gbps: float | None = 1.5, gpu: float = 12, host: float = 20, **kw):
    """Issue 36's case: Wan2.2-TI2V-5B, 704x1280 x81, one H200 at --mem-budget 12GB --host-mem-budget 20GB."""
    spec = get_model("wan2.2")
    w = make_workload(spec, frames=81, height=704, width=1280, steps=steps)
    return make_plan(spec, w, _h200(disk_gbps), budget=int(gpu * GB), host_budget=int(host * GB), **kw)[0]


def _placed(plan) -> dict[str, str]:
    return {c.name: c.placement for c in plan.pipeline.components}


@pytest.mark.parametrize("steps", [2, 50])
def test_the_text_encoder_goes_to_disk_before_the_transformer_blocks(steps):
    """Read once a generation before read every step: the 11.4 GB text encoder on disk and the transformer's blocks
    in pinned RAM, not 18 of 30 blocks read from disk each forward (issue 36)."""
    plan = _wan5b(steps)
    assert _placed(plan) == {"text_encoder": "disk", "transformer": "stream", "vae": "gpu"}
    assert plan.offload.disk_blocks == 0 and plan.offload.mode == "chunkflow"
    te = next(c for c in plan.pipeline.components if c.name == "text_encoder")
    spec = get_model("wan2.2")
    # every layer read at each of its two forwards (prompt, negative prompt), the rest once
    assert te.bytes < te.disk_read_bytes < 2 * te.bytes
    assert plan.prediction.disk_read_bytes_per_generation == te.disk_read_bytes
    assert plan.prediction.host_memory["text_encoder"] < 0.1 * te.bytes  # its ring only
    assert plan.prediction.host_memory["transformer"] >= spec.nbytes  # the whole transformer in RAM
    assert plan.prediction.phases.encode.parts_s["text_encoder from disk"] > 0
    if steps == 50:  # reading the encoder once costs seconds; reading blocks every step costs minutes
        assert plan.prediction.generation_time_s < 120
        assert "text encoder disk" in plan.reason


def test_the_disk_is_left_alone_where_ram_holds_everything():
    plan = _wan5b(50, host=64)
    assert "disk" not in _placed(plan).values() and plan.offload.disk_blocks == 0
    assert plan.prediction.disk_read_bytes_per_generation == 0


def test_each_component_on_disk_is_priced_at_the_disk_rate_and_holds_no_host_copy():
    """The runtime contract: a text encoder on disk holds a ring of two layers, the VAE nothing (read whole at the
    decode at the disk's rate), a transformer its pinned heads and ring (its non-block tensors read at its turn)."""
    from chunkflow_planner.pipeline import Placements, estimate
    from chunkflow_planner.policy import Problem

    spec, hw = get_model("wan2.2"), _h200().spec
    w = make_workload(spec, frames=81, height=704, width=1280, steps=2)
    problem = Problem(spec, w, hw)
    point = problem.evaluate(OffloadConfig("chunkflow", "16MB", 0.0, disk_blocks=spec.n_blocks))
    host = estimate(spec, w, hw, Placements(("stream",), "stream", "phase", True),
                    problem.evaluate(OffloadConfig("chunkflow", "16MB", 0.0)))
    disk = estimate(spec, w, hw, Placements(("disk",), "disk", "disk", True), point)
    te, vae = spec.pipeline.text_encoders[0], spec.pipeline.vae
    assert disk.host_bytes["text_encoder"] == 2 * te.layer_params * te.dtype_bytes
    assert disk.host_bytes["vae"] == 0 and host.host_bytes["vae"] == vae.nbytes
    assert disk.host_bytes["transformer"] == point.memory.pinned_host < 0.1 * spec.nbytes
    assert disk.phases["decode"].detail["from disk"] == pytest.approx(vae.nbytes / (1.5 * GB))
    assert disk.phases["decode"].time_s - host.phases["decode"].time_s == pytest.approx(
        vae.nbytes / (1.5 * GB) - vae.nbytes / (hw.h2d_gbps * GB))
    unpark = point.memory.non_block_weights / (1.5 * GB) + point.memory.resident_block_weights / (hw.h2d_gbps * GB)
    assert disk.phases["denoise"].detail["unpark"] == pytest.approx(unpark)
    forwards = w.steps * w.cfg_passes
    assert disk.disk_bytes["transformer"] == pytest.approx(
        point.memory.disk_read * (forwards + 2 / spec.n_blocks) + point.memory.non_block_weights)
    assert disk.disk_bytes["vae"] == vae.nbytes and disk.host_memory < 0.3 * host.host_memory


def test_spare_gpu_memory_buys_a_resident_text_encoder_and_an_untiled_decode():
    spec = get_model("wan2.2")
    w = make_workload(spec, frames=41, height=480, width=832, steps=8)
    times = []
    for gpu in (8, 20, 40):
        plan = make_plan(spec, w, _h200(), budget=gpu * GB, host_budget=64 * GB)[0]
        times.append(plan.prediction.generation_time_s)
        if gpu == 8:
            assert plan.pipeline.vae_tiling and _placed(plan)["text_encoder"] != "gpu"
        if gpu == 40:
            assert not plan.pipeline.vae_tiling and _placed(plan)["text_encoder"] == "gpu"
    assert times[0] > times[1] > times[2]  # each budget spends what it has where it saves time


def test_a_transformer_only_plan_keeps_the_fewest_blocks_on_disk_in_its_host_budget():
    from chunkflow_planner.memory import host_need
    from chunkflow_planner.policy import Levers, Problem

    spec = get_model("wan2.1-14b")
    w = make_workload(spec, frames=81, height=720, width=1280, steps=4)

    def plan(host_gb, rate=1.5, **kw):
        return make_plan(spec, w, _h200(rate), budget=24 * GB, host_budget=int(host_gb * GB), pipeline=False, **kw)

    p, decision, _ = plan(16)
    k = p.offload.disk_blocks
    assert p.pipeline is None and 0 < k < spec.n_blocks
    usable = 16 * GB / (1 + p.host_memory_margin)
    assert p.prediction.host_memory_bytes <= usable and p.host_memory_budget_bytes == 16 * GB
    problem = Problem(spec, w, _h200().spec, levers=Levers.of(w.cfg_passes))
    fewer = problem.evaluate(decision.chosen.cfg.with_overrides(disk_blocks=k - 1))
    assert host_need(fewer.memory, problem.hw) > usable  # one block fewer would not fit
    assert p.prediction.disk_read_bytes_per_step > 0 and "on disk" in p.reason
    assert plan(64)[0].offload.disk_blocks == 0  # room in RAM: no disk
    with pytest.raises(Infeasible, match=r"--disk-gbps.*calibrate --weights"):
        plan(16, rate=None)  # no disk rate: it says how to give one
    with pytest.raises(Infeasible, match="host memory is the binding constraint"):
        plan(0.5)  # not even every block on disk fits


def test_the_host_margin_is_kept_and_recorded():
    host = 12.2  # GB: the margin (0.3-0.6 GB) is worth a disk block or two (0.33 GB a tail) here
    plan = _wan5b(2, host=host)
    margin = get_hardware("h200").host_mem_margin
    assert margin > 0 and plan.host_memory_margin == margin and plan.host_memory_budget_bytes == int(host * GB)
    assert plan.prediction.host_memory_bytes <= host * GB / (1 + margin)
    exact = _wan5b(2, host=host, host_mem_margin=0.0)
    assert exact.host_memory_margin == 0.0
    # the margin costs disk blocks (a tail is 0.33 GB): without it the plan fills the budget to the byte
    assert host * GB / (1 + margin) < exact.prediction.host_memory_bytes <= host * GB
    assert plan.offload.disk_blocks - int(host * GB * margin / (1 + margin) / 0.33e9) - 1 <= exact.offload.disk_blocks \
        < plan.offload.disk_blocks


def test_disk_gbps_plans_the_disk_before_anything_is_calibrated(cli, workdir):
    args = ("plan", "--model", "wan2.2", "--frames", "81", "--height", "704", "--width", "1280", "--steps", "2",
            "--mem-budget", "12GB", "--host-mem-budget", "20GB", "--hardware", "h200")
    unknown = cli(*args)
    assert unknown.exit_code == 2
    said = " ".join(unknown.output.split())
    assert "host memory is the binding constraint" in said
    # what the disk tier would do at a supposed rate, and how to give the real one
    assert "With the disk tier it would fit" in said and "text_encoder on disk" in said
    assert "--disk-gbps" in said and "calibrate --weights DIR" in said
    result = cli(*args, "--disk-gbps", "1.5", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["hardware"]["spec"]["disk_read_gbps"] == 1.5 and "disk_read_gbps=1.5" in plan["hardware"]["source"]
    te = next(c for c in plan["pipeline"]["components"] if c["name"] == "text_encoder")
    assert te["placement"] == "disk" and te["disk_read_bytes"] > 0
    assert plan["prediction"]["disk_read_bytes_per_generation"] == te["disk_read_bytes"]
    assert plan["host_memory_margin"] > 0
    table = cli(*args, "--disk-gbps", "1.5")
    assert table.exit_code == 0 and "disk reads" in table.output and "on disk" in table.output
    bad = cli(*args, "--disk-gbps", "0")
    assert bad.exit_code == 2 and "--disk-gbps" in bad.output


def test_latency_names_the_disk_rate_that_would_meet_the_target():
    fast = _wan5b(50)
    with pytest.raises(Infeasible, match=r"a disk of ([0-9.]+) GB/s would meet the target") as exc:
        _wan5b(50, target_time=fast.prediction.generation_time_s * 0.95)
    import re
    rate = float(re.search(r"a disk of ([0-9.]+) GB/s", str(exc.value)).group(1))
    assert rate > 1.5
    faster = _wan5b(50, disk_gbps=rate * 1.01, target_time=fast.prediction.generation_time_s * 0.95)
    assert faster.prediction.generation_time_s <= fast.prediction.generation_time_s * 0.95


# ------------------------------------------------------------------------------------- the runtime's layout


@pytest.mark.parametrize("name", [n for n, s in load_models().items() if s.d >= 1024])
def test_the_planners_bytes_are_the_runtime_layouts(name):
    """Per block, the planner's bytes (the disk tier's tails, the host store with and without fp8 storage) equal the
    runtime's layout of the catalog model built on the meta device (no weights). The full-size models only: the
    layout starts every tensor on a 256-byte boundary, which the real widths fill exactly and the toy models' (d 32,
    256) do not."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from chunkflow.models.build import transformer_module
    from chunkflow.runtime.casting import Fp8Storage
    from chunkflow.runtime.layout import block_layouts
    from chunkflow.runtime.resolve import resolve_blocks
    from chunkflow.runtime.tiers.host import HostTier
    from chunkflow_planner.memory import block_volumes, cast_volumes, estimate_memory, stored_volumes
    from chunkflow_planner.offload import disk_block_indices

    spec = load_models()[name]
    m = transformer_module(spec, torch.bfloat16)
    blocks = resolve_blocks(m, [getattr(m, g.diffusers_list) for g in spec.blocks])
    k = spec.n_blocks * 3 // 5
    cfg = OffloadConfig("chunkflow", "16MB", 0.25, disk_blocks=k)
    host = HostTier()
    lay = block_layouts(m, blocks, cfg.chunk_bytes, cfg.residency, None, lambda b: host)
    assert [b.nbytes for b in lay] == block_volumes(spec)
    tails = sum(lay[l].nbytes - lay[l].resident_bytes for l in disk_block_indices(len(lay), k))
    w = spec.default_workload
    assert estimate_memory(spec, w, cfg).disk_read == tails
    whole = OffloadConfig("chunkflow", "16MB", 0.25, whole_blocks=(0, 2))  # the blocks a first-block cache runs
    lay_w = block_layouts(m, blocks, whole.chunk_bytes, whole.residency, None, lambda b: host,
                          whole=frozenset(whole.whole_blocks))
    assert [b.resident_bytes for b in lay_w][:3] == [lay_w[0].nbytes, lay[1].resident_bytes, lay_w[2].nbytes]
    assert estimate_memory(spec, w, whole).resident_block_weights == sum(b.resident_bytes for b in lay_w)
    assert not lay_w[0].is_streamed and lay_w[1].is_streamed
    fp8 = OffloadConfig("chunkflow", "16MB", 0.0, weight_dtype="fp8_e4m3")
    cast = Fp8Storage(torch.float8_e4m3fn, on_copy=False).plan(m, blocks)
    lay8 = block_layouts(m, blocks, fp8.chunk_bytes, fp8.residency, cast, lambda b: host)
    assert [b.nbytes for b in lay8] == stored_volumes(spec, fp8)
    assert [b.cast_extent for b in lay8] == cast_volumes(spec)


# ------------------------------------------------------------------------------------------- old files


def test_old_profiles_and_plans_still_load(tmp_path):
    from chunkflow_planner.catalog import load_profile
    from chunkflow_planner.plan import load_plan

    # a profile written before the disk rate was the core's: flat in the file, as before
    hw = get_hardware("h200").model_dump()
    hw.pop("host_mem_margin")
    hw["disk_read_gbps"] = 1.7
    path = tmp_path / "old.yaml"
    import yaml

    path.write_text(yaml.safe_dump(hw))
    old = load_profile(path)
    assert old.disk_read_gbps == 1.7 and old.host_mem_margin == get_hardware("h200").host_mem_margin
    # a mapping built in code with the rate under `pipeline`, as PipelineProfile held it
    nested = {**get_hardware("h200").model_dump(), "pipeline": {"disk_read_gbps": 2.5}}
    nested.pop("disk_read_gbps")
    assert HardwareSpec.model_validate(nested).disk_read_gbps == 2.5
    # a plan written before: no disk placement, no disk reads, no host margin
    plan = json.loads(_wan5b(2).to_json())
    plan.pop("host_memory_margin")
    plan["prediction"].pop("disk_read_bytes_per_generation")
    for c in plan["pipeline"]["components"]:
        c.pop("disk_read_bytes")
        c["placement"] = "phase" if c["placement"] == "disk" else c["placement"]
    plan["hardware"]["spec"].pop("host_mem_margin")
    loaded = load_plan(plan)
    assert loaded.host_memory_margin is None and loaded.prediction.disk_read_bytes_per_generation == 0
    assert all(c.disk_read_bytes == 0 for c in loaded.pipeline.components)
