"""Decode ahead priced (issue 52): a stored format's streamed blocks decoded on the copy stream after their copies
(offload decode "ahead") against each layer dequantizing in its forward ("forward", the default): the step-time
model moves each streamed block's decode from its own forward to the copy path and to the previous block's window,
the memory model trades the dequantized layer for two decode buffers, and `run --decode` overrides a plan's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow_planner.catalog import Workload, get_model
from chunkflow_planner.formats import block_decode_s, with_format
from chunkflow_planner.memory import estimate_memory
from chunkflow_planner.offload import OffloadConfig, OffloadConfigError
from chunkflow_planner.planner import make_plan, resolve_hardware
from chunkflow_planner.steptime import step_time

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("workdir")  # no saved profile
FLUX_1024 = Workload(batch=1, frames=1, height=1024, width=1024, steps=1)


def _flux(fmt: str = "q8_0"):
    return with_format(get_model("flux"), fmt), resolve_hardware("h200").spec


def _decode_total(spec, hw) -> float:
    """Seconds a forward of every block spends decoding, at the supposed rates (no calibration here)."""
    return sum(block_decode_s(g.stored, hw) * g.count for g in spec.blocks)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "fp8-scaled"])
def test_decoding_ahead_moves_each_streamed_blocks_decode_out_of_its_forward(fmt):
    spec, hw = _flux(fmt)
    forward = step_time(spec, FLUX_1024, hw, OffloadConfig("chunkflow", "16MB", 0.0))
    ahead = step_time(spec, FLUX_1024, hw, OffloadConfig("chunkflow", "16MB", 0.0, decode="ahead"))
    passes = FLUX_1024.cfg_passes
    assert _decode_total(spec, hw) > 0
    # every block streams: each block's decode is on the compute path once either way (its own forward, or the
    # window it runs in ahead), so the compute path is the same ...
    assert ahead.compute == pytest.approx(forward.compute, rel=1e-9)
    # ... and ahead it is also on the copy path, after the copies: a step can only wait longer for its weights
    assert ahead.total >= forward.total - 1e-12
    assert ahead.prefetch_stall >= forward.prefetch_stall
    assert forward.total > 0 and passes >= 1


def test_blocks_that_do_not_stream_decode_in_their_forward_either_way():
    spec, hw = _flux()
    for mode in (OffloadConfig("none"), OffloadConfig("chunkflow", "16MB", 1.0)):
        ahead = step_time(spec, FLUX_1024, hw, mode.with_overrides(decode="ahead"))
        assert ahead.total == pytest.approx(step_time(spec, FLUX_1024, hw, mode).total, rel=1e-12)


def test_decode_ahead_memory_is_two_buffers_of_the_largest_streamed_blocks_decoded_weights():
    spec, hw = _flux()
    largest = max(sum(g.stored.decoded.values()) for g in spec.blocks)
    biggest_layer = max(g.stored.dequant_peak_bytes for g in spec.blocks)
    fwd = estimate_memory(spec, FLUX_1024, OffloadConfig("chunkflow", "16MB", 0.0), hw=hw)
    ahead = estimate_memory(spec, FLUX_1024, OffloadConfig("chunkflow", "16MB", 0.0, decode="ahead"), hw=hw)
    assert (fwd.dequant, fwd.decode_buffers) == (biggest_layer, 0.0)
    assert (ahead.dequant, ahead.decode_buffers) == (0.0, 2.0 * largest)
    assert ahead.peak - fwd.peak == pytest.approx(2 * largest - biggest_layer, abs=2)
    # nothing streams: no buffer, and the resident blocks dequantize in their forward
    kept = estimate_memory(spec, FLUX_1024, OffloadConfig("chunkflow", "16MB", 1.0, decode="ahead"), hw=hw)
    assert (kept.dequant, kept.decode_buffers) == (biggest_layer, 0.0)
    # bf16 has nothing to decode
    plain = estimate_memory(get_model("flux"), FLUX_1024, OffloadConfig("chunkflow", "16MB", 0.0, decode="ahead"),
                            hw=hw)
    assert (plain.dequant, plain.decode_buffers) == (0.0, 0.0)


def test_the_setting_carries_its_decode():
    cfg = OffloadConfig("chunkflow", "16MB", 0.2, decode="ahead")
    assert cfg.label.endswith(" decode-ahead") and OffloadConfig("chunkflow", "16MB").decode == "forward"
    assert cfg.with_overrides(residency=0.5).decode == "ahead"
    assert cfg.with_overrides(decode="forward").decode == "forward"
    assert OffloadConfig.model_validate(json.loads(cfg.model_dump_json())) == cfg
    with pytest.raises(OffloadConfigError, match="unknown decode 'early'; use ahead .* or forward"):
        OffloadConfig("chunkflow", decode="early")


def _plan_file(tmp_path):
    spec = with_format(get_model("flux"), "q8_0")
    plan, _, _ = make_plan(spec, FLUX_1024, resolve_hardware("h200"), budget=6 * 10**9, pipeline=False)
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return plan, path


def test_run_decode_overrides_the_plans_and_a_bad_one_is_one_line(tmp_path):
    plan, path = _plan_file(tmp_path)
    assert plan.offload.decode == "forward"
    bad = runner.invoke(app, ["run", "--plan", str(path), "--decode", "sideways", "--device", "cpu"])
    assert bad.exit_code == 2, bad.output
    assert "unknown decode 'sideways'" in bad.output and "Traceback" not in bad.output
    helped = runner.invoke(app, ["run", "--help"])
    assert "--decode" in helped.output


def test_the_planned_decode_buffers_are_the_runtimes(tmp_path):
    """The memory model's two decode buffers against the ones the runtime allocates for the same GGUF file (priced
    from its header): equal but for the runtime's 256-byte alignment of each tensor."""
    import sys
    from pathlib import Path

    import torch
    from diffusers import FluxTransformer2DModel

    import chunkflow
    from chunkflow_planner.stored_file import from_file

    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_files import Q, load_gguf, write_gguf
    from test_plan_formats import _flux_256

    module, spec = _flux_256()
    path = write_gguf(tmp_path / "flux.gguf", module.state_dict(), Q.Q8_0)
    planned = estimate_memory(from_file(spec, path), Workload(batch=1, frames=1, height=64, width=64, steps=1),
                              OffloadConfig("chunkflow", "64KB", 0.0, decode="ahead"))
    module.save_config(tmp_path / "transformer")  # the config diffusers' from_single_file reads beside the file
    m = load_gguf(FluxTransformer2DModel, path, tmp_path)
    with torch.no_grad():
        h = chunkflow.offload(m, mode="chunkflow", chunk_size="64KB", residency=0.0, device="cpu", decode="ahead")
        got = h.stats()
        h.remove()
    tensors = got.decoded_tensors  # every decoded tensor: a bound on one block's alignment padding
    assert planned.decode_buffers > 0 and got.decode == "ahead"
    assert planned.decode_buffers <= got.decode_buffer_bytes < planned.decode_buffers + 2 * 256 * tensors
