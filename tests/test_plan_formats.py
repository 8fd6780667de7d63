"""Stored formats priced before the download (issue 52): bytes per block against a hand count of the real diffusers
block, plans from a GGUF file's and an fp8-scaled safetensors file's headers, the critical point moving with the
bytes, `plan --format` through the CLI, and old plan files still read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow_planner.catalog import ModelSpec, Workload, get_model
from chunkflow_planner.formats import FORMATS, with_format
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.overlap import analyse
from chunkflow_planner.plan import PLAN_SCHEMA_VERSION, load_plan
from chunkflow_planner.planner import make_plan, resolve_hardware
from chunkflow_planner.steptime import step_time

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("workdir")  # no saved profile
ROOT = Path(__file__).resolve().parents[1]

# the files' conventions, written out here apart from formats.py: (weights a quant block, its bytes, bytes of an
# element of a tensor kept as it is); a GGUF weight whose rows do not split into blocks is F16
LAYOUT = {"q8_0": (32, 34, 4), "q6_k": (256, 210, 4), "q5_k": (256, 176, 4), "q4_k": (256, 144, 4),
          "q4_0": (32, 18, 4), "fp8-scaled": (1, 1, 2)}


def _meta_block(spec: ModelSpec, group):
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, spec.diffusers.cls).from_config(dict(spec.diffusers.config))
    return model, getattr(model, group.diffusers_list)[group.first]


def _hand_count(spec: ModelSpec, group, fmt: str) -> int:
    """One block's bytes in `fmt`, counted from the real block's parameters: 2-D weights quantized (or F16 where
    their rows do not split), one fp32 scale each for fp8-scaled; the rest at the kept bytes, float32 for what the
    class keeps in float32."""
    model, block = _meta_block(spec, group)
    per_block, block_bytes, kept = LAYOUT[fmt]
    keep32 = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    total = 0
    for name, p in block.named_parameters():
        if p.ndim == 2:
            rows_split = p.shape[1] % per_block == 0
            if fmt == "fp8-scaled":
                total += p.numel() + 4
            else:
                total += p.numel() // per_block * block_bytes if rows_split else 2 * p.numel()
        else:
            fp32 = any(k in name.split(".") for k in keep32)
            total += p.numel() * (4 if fp32 else kept)
    return total


@pytest.mark.parametrize("model", ["tiny-flux", "demo-wan", "tiny-wan"])
@pytest.mark.parametrize("fmt", list(LAYOUT))
def test_block_bytes_per_format_equal_a_hand_count_of_the_real_block(model, fmt):
    spec = get_model(model)
    stored = with_format(spec, fmt)
    assert stored.stored.format == fmt and stored.weight_format == fmt
    for group, sgroup in zip(spec.blocks, stored.blocks):
        assert stored.block_bytes(sgroup) == _hand_count(spec, group, fmt), (model, fmt, group.arch)
    assert with_format(spec, "bf16") is spec


def test_bits_per_weight_are_the_block_layouts():
    assert {n: f.bits_per_weight for n, f in FORMATS.items()} == {
        "bf16": 16, "q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5, "q4_k": 4.5, "q4_0": 4.5, "fp8-scaled": 8}


def test_a_catalog_model_shrinks_as_the_issue_says():
    """Wan2.2-A14B's blocks: Q8_0 about 0.53 of bf16's bytes, Q4_K about 0.28 (Q4_K_M files ~0.3: they mix Q6_K)."""
    spec = get_model("wan2.2-a14b")
    ratio = {f: with_format(spec, f).block_bytes_total / spec.block_bytes_total for f in LAYOUT}
    assert ratio["q8_0"] == pytest.approx(8.5 / 16, rel=0.002)
    assert ratio["q4_k"] == pytest.approx(4.5 / 16, rel=0.002)
    assert ratio["fp8-scaled"] == pytest.approx(0.5, rel=0.002)


# ---- from a file's header


def _flux_256():
    """A tiny FLUX whose block weights split into K-quant blocks (d 256, f 1024), its module and its spec."""
    from diffusers import FluxTransformer2DModel

    base = get_model("tiny-flux")
    config = {**base.diffusers.config, "attention_head_dim": 128, "num_attention_heads": 2}
    torch.manual_seed(0)
    module = FluxTransformer2DModel(**config)
    spec = base.model_copy(update={"d": 256, "f": 1024, "diffusers": base.diffusers.model_copy(
        update={"config": config}), "total_params": sum(p.numel() for p in module.parameters())})
    return module, ModelSpec.model_validate(spec.model_dump())


def _plan(spec: ModelSpec, cfg_mode: str = "chunkflow"):
    w = Workload(batch=1, frames=1, height=64, width=64, steps=2)
    return make_plan(spec, w, resolve_hardware("h200"), budget=10**10, pipeline=False)[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_plan_from_a_gguf_header_has_the_estimates_bytes(tmp_path, qtype):
    from gguf_files import Q, write_gguf

    from chunkflow_planner.gguf_header import read_header
    from chunkflow_planner.stored_file import from_file

    module, spec = _flux_256()
    path = write_gguf(tmp_path / "flux.gguf", module.state_dict(), getattr(Q, qtype))
    header = read_header(path)
    from_header, estimate = from_file(spec, path), with_format(spec, qtype.lower())
    assert from_header.stored.format == qtype.lower()
    assert from_header.stored.nbytes == header.tensor_bytes and from_header.stored.file_bytes == header.file_size
    for g, f, e in zip(spec.blocks, from_header.blocks, estimate.blocks):
        exact = sum(t.nbytes for t in header.tensors if t.name.startswith(g.diffusers_list + f".{g.first}."))
        assert f.stored.nbytes == exact == e.stored.nbytes  # the header's bytes, block by block, = the estimate
        assert f.stored.decoded == e.stored.decoded and f.stored.dequant_peak_bytes == e.stored.dequant_peak_bytes
    a, b = _plan(from_header), _plan(estimate)
    assert a.model.block_bytes_total == b.model.block_bytes_total == estimate.block_bytes_total
    assert a.format.h2d_bytes_per_step == b.format.h2d_bytes_per_step
    assert a.format.name == qtype.lower() and "header of" in a.format.source
    assert load_plan(json.loads(a.to_json())).format.name == qtype.lower()  # read back: its model travels with it


def test_a_plan_from_an_fp8_scaled_safetensors_file(tmp_path):
    """Comfy's layout: the blocks' 2-D weights float8_e4m3fn with a float32 scale_weight each, the rest bf16."""
    from safetensors.torch import save_file

    from chunkflow_planner.stored_file import from_file

    module, spec = _flux_256()
    tensors = {}
    for name, p in module.state_dict().items():
        if p.ndim == 2 and "blocks." in name:
            scale = p.abs().max().float() / 448
            tensors[name] = (p / scale).to(torch.float8_e4m3fn)
            tensors[name[: -len(".weight")] + ".scale_weight"] = scale.reshape(())
        else:
            tensors[name] = p.to(torch.bfloat16)
    tensors = {"model.diffusion_model." + k: v for k, v in tensors.items()}  # as Comfy's checkpoints name them
    tensors["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "flux_fp8_scaled.safetensors")
    stored = from_file(spec, tmp_path / "flux_fp8_scaled.safetensors")
    estimate = with_format(spec, "fp8-scaled")
    assert stored.stored.format == "fp8-scaled"
    assert [g.stored for g in stored.blocks] == [g.stored for g in estimate.blocks]
    assert stored.stored.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_file_of_another_model_or_type_is_one_line(tmp_path):
    from gguf_files import Q, write_gguf

    from chunkflow_planner.formats import FormatError
    from chunkflow_planner.stored_file import from_file

    module, spec = _flux_256()
    path = write_gguf(tmp_path / "flux.gguf", module.state_dict(), Q.Q5_1)
    with pytest.raises(FormatError, match=r"Q5_1 .*does not run") as exc:
        from_file(spec, path)
    assert "\n" not in str(exc.value)
    other = write_gguf(tmp_path / "other.gguf", module.state_dict(), Q.Q8_0)
    with pytest.raises(FormatError, match="another model's"):
        from_file(get_model("tiny-flux"), other)


# ---- the critical point moves with the bytes


def test_fewer_bytes_move_the_critical_point_and_speed_a_link_bound_step():
    spec, hw = get_model("wan2.1-14b"), resolve_hardware("h200").spec
    q4 = with_format(spec, "q4_k")
    small = Workload(batch=1, frames=1, height=480, width=832, steps=1)
    cfg = OffloadConfig("layerwise")
    a_bf16, a_q4 = analyse(spec, small, hw, cfg=cfg), analyse(q4, small, hw, cfg=cfg)
    ratio = q4.block_bytes_total / spec.block_bytes_total
    assert a_q4.B_pref == pytest.approx(ratio * a_bf16.B_pref)
    assert a_q4.F_star < a_bf16.F_star and a_bf16.regime == "exposed"
    assert a_q4.critical.value is None or a_q4.critical.value < a_bf16.critical.value
    t_bf16, t_q4 = step_time(spec, small, hw, cfg).total, step_time(q4, small, hw, cfg).total
    assert t_q4 < t_bf16  # link-bound: 0.28 of the bytes on the link outweigh the decode
    big = Workload(batch=1, frames=81, height=720, width=1280, steps=1)
    none = OffloadConfig("none")  # all on the GPU: the decode is the whole difference
    decode = sum(len(g.stored.decoded) and g.stored.decoded["q4_k"] * g.count for g in q4.blocks) / (
        0.025 * hw.hbm_gbps * 1e9)  # formats.SUPPOSED_DECODE_SHARE["q4_k"], supposed (no calibration)
    extra = step_time(q4, big, hw, none).total - step_time(spec, big, hw, none).total
    assert extra == pytest.approx(big.cfg_passes * decode, rel=1e-9)


def test_the_plan_records_format_and_bytes_a_step_against_bf16():
    spec = get_model("wan2.1-14b")
    w = Workload(batch=1, frames=1, height=480, width=832, steps=4)
    plan = make_plan(with_format(spec, "q8_0"), w, resolve_hardware("h200"), budget=8 * 10**9, pipeline=False,
                     max_slowdown=3)[0]
    f = plan.format
    assert plan.schema_version == PLAN_SCHEMA_VERSION == 7 and f.name == "q8_0" and not f.decode_measured
    assert plan.offload.mode != "none" and f.h2d_bytes_per_step > 0
    assert f.h2d_bytes_per_step / f.h2d_bytes_per_step_bf16 == pytest.approx(f.block_bytes_ratio, rel=0.02)
    assert f.stored_bytes < f.bf16_bytes and plan.model.spec is not None and plan.model.spec.stored is not None
    measured = resolve_hardware("h200").spec.model_copy(update={"format_decode_gbps": {"q8_0": 500.0}})
    from chunkflow_planner.planner import ResolvedHardware

    again = make_plan(with_format(spec, "q8_0"), w, ResolvedHardware(measured, "test"), budget=8 * 10**9,
                      pipeline=False, max_slowdown=3)[0]
    assert again.format.decode_measured and again.format.decode_gbps == {"q8_0": 500.0}


# ---- the CLI


def _plan_cli(*args: str):
    return runner.invoke(app, ["plan", "--hardware", "h200", *args])


def test_one_row_a_format_through_the_cli(tmp_path):
    args = ["--model", "wan2.2-a14b", "--mem-budget", "16GB", "--host-mem-budget", "128GB"]
    result = _plan_cli(*args, "--format", "q8_0,q4_k,fp8-scaled,bf16")
    assert result.exit_code == 0, result.output
    rows = {cells[0]: cells for cells in map(str.split, result.stdout.splitlines())
            if len(cells) >= 9 and cells[0] in LAYOUT | {"bf16": 0} and cells[1].replace(".", "").isdigit()}
    assert list(rows) == ["q8_0", "q4_k", "fp8-scaled", "bf16"]
    assert [rows[f][2] for f in rows] == ["yes", "yes", "yes", "no"]  # bf16 does not fit 16 GB here
    assert "bf16 does not fit (GPU)" in result.stdout
    disk = {f: float(rows[f][5]) for f in rows}
    assert disk["q4_k"] < disk["fp8-scaled"] < disk["q8_0"] < disk["bf16"]
    docs = json.loads(_plan_cli(*args, "--format", "q8_0,bf16", "--json").stdout)
    assert docs["q8_0"]["format"]["name"] == "q8_0" and "infeasible" in docs["bf16"]
    out = tmp_path / "plan-{format}.json"
    written = _plan_cli(*args, "--format", "q4_k,q8_0", "--out", str(out))
    assert written.exit_code == 0, written.output
    for f in ("q4_k", "q8_0"):
        assert load_plan(tmp_path / f"plan-{f}.json").format.name == f


@pytest.mark.parametrize("args, message", [
    (["--format", "q3_k"], "--format 'q3_k' is a GGUF type chunkflow does not run; give one or more of bf16, q8_0"),
    (["--format", "int4"], "--format 'int4' is not a format chunkflow knows"),
    (["--format", "q8_0,q4_k", "--out", "plan.json"], "put {format} in it"),
    (["--format", "q4_k", "--weight-dtype", "fp8_e4m3"], "a stored format streams its own bytes"),
    (["--format", "q4_k", "--codec", "on"], "a q4_k file streams its stored bytes"),
])
def test_bad_format_flags_are_one_line(args, message):
    result = _plan_cli("--model", "flux", *args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert message in text
    assert len([l for l in result.output.splitlines() if l.strip()]) <= 3  # one message (the terminal wraps it)


def test_plan_help_documents_format():
    result = runner.invoke(app, ["plan", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    assert "--format" in text and "q8_0, q6_k, q5_k, q4_k, q4_0" in text and "{format}" in text


def test_a_single_format_plans_it_fully_and_says_so(tmp_path):
    result = _plan_cli("--model", "flux", "--format", "q4_k", "--out", str(tmp_path / "p.json"))
    assert result.exit_code == 0, result.output
    assert "format: q4_k (estimated before the download" in " ".join(result.stdout.split())
    assert load_plan(tmp_path / "p.json").format.name == "q4_k"


# ---- old plans


def test_old_plan_files_still_read(tmp_path):
    old = ROOT / "docs/data/h200-bands/run-3/gen-480-plan.json"
    plan = load_plan(old)
    assert json.loads(old.read_text())["schema_version"] == 4 and plan.format is None
    new = _plan(get_model("tiny-flux"))
    data = json.loads(new.to_json())
    data.pop("format")
    data["workload"].pop("cache")
    data["prediction"].pop("cache")
    data["offload"].pop("whole_blocks")
    for version in (1, 2, 3, 4, 5, 6):
        path = tmp_path / f"v{version}.json"
        path.write_text(json.dumps({**data, "schema_version": version}))
        assert load_plan(path).format is None and load_plan(path).offload.whole_blocks == ()
    path.write_text(json.dumps({**data, "schema_version": 8}))
    from chunkflow_planner.plan import PlanError

    with pytest.raises(PlanError, match="schema_version 8"):
        load_plan(path)
    assert math.isfinite(plan.prediction.step_time_s)


# ---- calibrate


def test_calibrate_measures_each_formats_decode_on_the_cpu_and_the_planner_reads_it():
    """diffusers' own dequantization (and w.to(bf16) * scale for fp8-scaled), timed on this device; the profile
    takes the rates and a plan prices with them, marked measured."""
    from chunkflow.commands.calibrate.formats import measure_formats

    seen: list[str] = []
    extra, raw = measure_formats(torch.device("cpu"), seen.append)
    rates = extra["format_decode_gbps"]
    assert set(rates) == set(LAYOUT) and all(r > 0 for r in rates.values()), seen
    assert all(raw[f]["nbytes"] == 256 * 4096 * 2 for f in rates)
    hw = resolve_hardware("h200").spec.model_copy(update=extra)
    from chunkflow_planner.formats import decode_gbps

    assert all(decode_gbps(f, hw) == (rates[f], True) for f in rates)
