"""The planner's side of the lossless codec (issue 39): the setting, its price (ratio on the link and in host
memory, decode on the GPU, the staging ring), the policy's on/off decision, the plan file and `plan --codec`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chunkflow.commands.cli import app
from chunkflow_planner.catalog import get_hardware, get_model
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.memory import estimate_memory
from chunkflow_planner.offload import (
    CODEC_DECODE_BYTES,
    CODEC_STAGING_CHUNKS,
    OffloadConfig,
    OffloadConfigError,
    codec_group_chunks,
    codec_groups,
    codec_staging_bytes,
    disk_block_indices,
)
from chunkflow_planner.memory import stored_volumes
from chunkflow_planner.plan import load_plan
from chunkflow_planner.planner import ResolvedHardware, make_plan
from chunkflow_planner.policy import CODEC, Infeasible, Levers, codec_refusal
from chunkflow_planner.steptime import codec_terms, step_time
from chunkflow_planner.tiers import CODEC_RATE_REMEDY, SUPPOSED_CODEC_RATIO, CodecRateUnknown
from chunkflow_planner.workload import make_workload

GB = 10**9
MB = 10**6
runner = CliRunner()


def _hw(name: str = "h200", **update) -> ResolvedHardware:
    return ResolvedHardware(get_hardware(name).model_copy(update=update), "test")


def _plan(model: str, budget: float, codec: str = "auto", hw: ResolvedHardware | None = None, host: float | None = None,
          weight_dtype: str = "bf16", allow_fp8: bool = False, **workload):
    """The transformer alone at a GPU budget, 4x no offload allowed (the 6 GB FLUX case of issue 39 needs it)."""
    hw = hw or _hw()
    spec = get_model(model)
    w = make_workload(spec, **workload)
    levers = Levers.of(w.cfg_passes, "auto", weight_dtype, allow_fp8, codec, codec_refusal(spec, hw.spec))
    return make_plan(spec, w, hw, budget=int(budget * GB), pipeline=False, max_slowdown=4, levers=levers,
                     host_budget=None if host is None else int(host * GB), host_mem_margin=0.0)[0]


# ---------------------------------------------------------------------------------------------------- the setting


def test_the_setting_validates_and_carries_the_codec():
    cfg = OffloadConfig("chunkflow", "16MB", 0.2, codec=CODEC)
    assert cfg.codec == CODEC and cfg.label.endswith(" codec=exponent-pack")
    assert OffloadConfig.model_validate(cfg.model_dump()) == cfg  # a plan file's round trip
    assert cfg.with_overrides(residency=0.5).codec == CODEC  # carried over
    assert cfg.with_overrides(codec="none").codec == "none"
    assert cfg.with_overrides(mode="layerwise").codec == CODEC  # layerwise streams: still encoded
    assert cfg.with_overrides(mode="none").codec == "none"  # nothing streams: nothing to encode
    assert cfg.with_overrides(weight_dtype="fp8_e4m3").codec == "none"  # fp8 storage is the other way
    with pytest.raises(OffloadConfigError, match="unknown codec 'zstd'"):
        OffloadConfig(codec="zstd")
    with pytest.raises(OffloadConfigError, match="mode none streams nothing"):
        OffloadConfig("none", codec=CODEC)
    with pytest.raises(OffloadConfigError, match="weight_dtype fp8_e4m3"):
        OffloadConfig(weight_dtype="fp8_e4m3", codec=CODEC)
    with pytest.raises(ValueError):
        OffloadConfig.model_validate({**cfg.model_dump(), "codec": "gzip"})


def test_the_staging_ring_is_three_of_the_largest_decode_group():
    """A decode group is as many whole chunks as fit CODEC_DECODE_BYTES (at least one), within a block's tail."""
    assert CODEC_STAGING_CHUNKS == 3
    V = [100 * MB, 40 * MB, 10 * MB]
    per = codec_group_chunks(16 * MB)
    assert per == CODEC_DECODE_BYTES // (16 * MB) > 1
    assert codec_staging_bytes(OffloadConfig("chunkflow", "16MB", codec=CODEC), V) == 3 * min(100 * MB, per * 16 * MB)
    assert codec_groups(OffloadConfig("chunkflow", "16MB", codec=CODEC), 100 * MB) == -(-7 // per)  # 7 chunks
    # disk blocks encoded too: the disk tier's stream has a ring of its own (its largest group: the 40 MB block's,
    # disk_block_indices(3, 1) == [1])
    assert disk_block_indices(3, 1) == [1]
    both = codec_staging_bytes(OffloadConfig("chunkflow", "16MB", codec=CODEC, disk_blocks=1), V)
    assert both == 3 * min(100 * MB, per * 16 * MB) + 3 * min(40 * MB, per * 16 * MB)
    assert codec_staging_bytes(OffloadConfig("chunkflow", "64MB", codec=CODEC), [50 * MB, 30 * MB]) == 3 * 50 * MB
    assert codec_staging_bytes(OffloadConfig("layerwise", codec=CODEC), V) == 3 * 100 * MB  # the largest tail
    assert codec_staging_bytes(OffloadConfig("chunkflow", "16MB"), V) == 0  # no codec, no ring
    assert codec_staging_bytes(OffloadConfig("chunkflow", "16MB", 1.0, codec=CODEC), V) == 0  # nothing streams


# ---------------------------------------------------------------------------------------------------- the price


def test_encoded_bytes_cost_the_ratio_on_the_link_and_in_host_memory_and_the_ring_on_the_device():
    spec, hw = get_model("flux"), get_hardware("h200")
    w = spec.default_workload
    raw, enc = (OffloadConfig("chunkflow", "16MB", 0.2, codec=c) for c in ("none", CODEC))
    m_raw, m_enc = estimate_memory(spec, w, raw, hw=hw), estimate_memory(spec, w, enc, hw=hw)
    tails = m_raw.pinned_host - m_raw.resident_block_weights  # the host store: resident heads and streamed tails
    assert m_enc.codec_raw == pytest.approx(tails)
    assert m_enc.codec_stored == pytest.approx(SUPPOSED_CODEC_RATIO * tails)
    assert m_enc.pinned_host == pytest.approx(m_raw.pinned_host - (1 - SUPPOSED_CODEC_RATIO) * tails)
    assert m_enc.peak - m_raw.peak == pytest.approx(3 * codec_group_chunks(16 * MB) * 16 * MB, abs=1)  # the ring
    measured = hw.model_copy(update={"codec_ratio": 0.65})
    assert estimate_memory(spec, w, enc, hw=measured).codec_stored == pytest.approx(0.65 * tails)


def test_decode_goes_on_the_compute_path_and_the_link_carries_rho_b():
    """Streaming-bound FLUX: encoded copies shorten the stall by more than the decode adds; the decode is B / D plus
    each decode launch's host cost (codec_launch_us, one a decode group)."""
    spec, hw = get_model("flux"), get_hardware("h200")
    w = spec.default_workload
    raw, enc = (OffloadConfig("chunkflow", "16MB", 0.0, codec=c) for c in ("none", CODEC))
    t_raw, t_enc = step_time(spec, w, hw, raw), step_time(spec, w, hw, enc)
    streamed = estimate_memory(spec, w, enc, hw=hw).codec_raw
    launches = sum(codec_groups(enc, v) for v in stored_volumes(spec, enc) if enc.streamed_bytes(v) > 0)
    assert t_enc.compute - t_raw.compute == pytest.approx(streamed / (hw.codec_decode_gbps * GB)
                                                          + launches * hw.codec_launch_us * 1e-6)
    assert t_enc.prefetch_stall < t_raw.prefetch_stall and t_enc.total < t_raw.total
    slower = hw.model_copy(update={"codec_decode_gbps": 50.0})  # a decoder slower than the link: no gain
    assert step_time(spec, w, slower, enc).total > t_raw.total
    with pytest.raises(CodecRateUnknown, match="calibrate"):
        step_time(spec, w, get_hardware("a100-80gb"), enc)


def _disk_case(codec: str, ratio: float | None = None, rate: float = 2.0, k: int = 8):
    """FLUX with `k` of its blocks on a disk of `rate` GB/s, 20% resident: (spec, hw, cfg, memory, step time)."""
    spec = get_model("flux")
    hw = get_hardware("h200").model_copy(update={"disk_read_gbps": rate, "codec_ratio": ratio})
    cfg = OffloadConfig("chunkflow", "16MB", 0.2, disk_blocks=k, codec=codec)
    return (spec, hw, cfg, estimate_memory(spec, spec.default_workload, cfg, hw=hw),
            step_time(spec, spec.default_workload, hw, cfg))


def test_the_disk_tiers_blocks_stream_encoded_too():
    """With the codec a disk block's tail is read encoded from the spill file (rho of its bytes a forward), copied
    encoded and decoded on the compute path like a host-tier block's; its ring entries are the largest encoded tail."""
    spec, hw, raw_cfg, raw, _ = _disk_case("none", 0.65)
    _, _, cfg, enc, _ = _disk_case(CODEC, 0.65)
    V = stored_volumes(spec, cfg)
    rho, dec, last = codec_terms(V, cfg, hw)
    disk = disk_block_indices(len(V), 8)
    assert all(rho[l] == 0.65 and dec[l] > 0 and last[l] > 0 for l in disk)  # as every streamed block
    assert dec[disk[0]] == pytest.approx(dec[(disk[0] + 1) % len(V)])  # alike blocks, either tier: the same decode
    tails = [V[l] - cfg.resident_bytes(V[l]) for l in disk]
    assert raw.disk_read == pytest.approx(sum(tails)) and raw.disk_ring == pytest.approx(2 * max(tails))
    assert enc.disk_read == pytest.approx(0.65 * sum(tails))  # a forward's reads: the encoded tails
    assert enc.disk_ring == pytest.approx(0.65 * raw.disk_ring)  # DISK_RING_BLOCKS of the largest encoded tail
    assert enc.codec_spill == enc.disk_read and enc.codec_spill_raw == pytest.approx(sum(tails))  # the spill file
    host_tails = sum(V) - raw.resident_block_weights - sum(tails)
    assert enc.codec_raw == pytest.approx(host_tails)  # the host store's tails; the disk tier's are not held
    assert enc.pinned_host == pytest.approx(raw.pinned_host - 0.35 * host_tails - 0.35 * raw.disk_ring)
    assert enc.codec_saved == pytest.approx(0.35 * host_tails)  # host memory
    assert enc.codec_saved_link == pytest.approx(0.35 * (host_tails + sum(tails)))  # a forward's copies


def test_the_disk_stall_shrinks_by_the_ratio():
    """A 2 GB/s disk cannot hide 8 FLUX blocks' tails a forward: the stall is the encoded reads less the forward."""
    _, hw, _, raw, t_raw = _disk_case("none")
    _, _, _, enc, t_enc = _disk_case(CODEC)
    assert t_raw.disk_stall > 0
    assert t_enc.disk_stall == pytest.approx(SUPPOSED_CODEC_RATIO * raw.disk_read / (2.0 * GB) - sum(t_enc.per_block))
    assert t_enc.disk_stall < t_raw.disk_stall and t_enc.total < t_raw.total


def test_without_the_codec_the_disk_tier_is_priced_as_before():
    """Regression: the numbers the planner gave before the disk tier streamed encoded (codec off)."""
    _, _, _, m, t = _disk_case("none")
    assert (m.disk_read, m.disk_ring, m.pinned_host) == (2750905856.0, 1103325184.0, 22026985984.0)
    assert (m.codec_spill, m.codec_spill_raw) == (0.0, 0.0)
    assert t.total == pytest.approx(1.3754529279999996, rel=1e-12)
    assert t.disk_stall == pytest.approx(1.0303561155949366, rel=1e-12)
    hw = _hw("h200", disk_read_gbps=2.0)
    plan = _plan("flux", 6, "off", hw=hw, host=12)
    p = plan.prediction
    assert plan.offload.disk_blocks == 34 and p.codec_spill_bytes == 0
    assert p.step_time_s == pytest.approx(6.9948, abs=1e-4) and p.disk_read_bytes_per_step == 13989511680
    spec = get_model("wan2.1-14b")  # the whole pipeline: the load leaves the disk tails in the files
    w = make_workload(spec, frames=81, height=720, width=1280, steps=50)
    hw = _hw("h200", disk_read_gbps=1.5)
    levers = Levers.of(w.cfg_passes, "auto", "bf16", False, "off", codec_refusal(spec, hw.spec))
    p = make_plan(spec, w, hw, budget=24 * GB, host_budget=32 * GB, levers=levers)[0].prediction
    assert p.disk_read_bytes_per_step == 8434446336 and p.host_memory_bytes == 30232733824
    assert p.load.read_bytes == 24925698124 and p.load.time_cold_s == pytest.approx(16.645136245776975, rel=1e-9)
    assert "spill" not in p.load.parts_cold_s and p.generation_time_s == pytest.approx(1401.5648378160124, rel=1e-9)


# ---------------------------------------------------------------------------------------------------- the policy


def test_streaming_bound_flux_at_a_small_budget_turns_the_codec_on():
    raw, enc = _plan("flux", 6, "off"), _plan("flux", 6, "auto")
    assert raw.offload.codec == "none" and raw.analysis.regime == "exposed"
    assert enc.offload.codec == CODEC
    assert enc.prediction.step_time_s < raw.prediction.step_time_s
    p = enc.prediction
    assert p.codec_ratio == SUPPOSED_CODEC_RATIO and p.codec_ratio_measured is False
    assert p.codec_saved_bytes_per_step > 5 * GB and p.codec_saved_host_bytes == p.codec_saved_bytes_per_step  # 1 pass
    assert p.codec_staging_bytes == 3 * enc.offload.chunk_bytes
    assert "codec exponent-pack at ratio 0.71 (supposed)" in enc.reason


def test_compute_bound_large_workload_keeps_the_codec_off():
    plan = _plan("wan2.1-14b", 40, "auto", frames=81, height=720, width=1280)
    assert plan.analysis.regime == "hidden" and plan.offload.mode == "chunkflow"
    assert plan.offload.codec == "none" and plan.prediction.codec_ratio is None
    assert "the codec would not shorten the step" in plan.reason


def test_a_host_budget_only_the_encoded_store_fits_turns_it_on_and_the_plan_fits():
    """Wan2.1-14B at 480p streams 28 GB of blocks; 25 GB of host memory holds them only encoded (no disk rate)."""
    kw = dict(frames=81, height=480, width=832)
    with pytest.raises(Infeasible, match="host memory is the binding constraint"):
        _plan("wan2.1-14b", 30, "off", host=25, **kw)
    plan = _plan("wan2.1-14b", 30, "auto", host=25, **kw)
    assert plan.offload.codec == CODEC
    assert plan.prediction.host_memory_bytes <= 25 * GB
    assert plan.prediction.pinned_host_bytes < 25 * GB < plan.prediction.pinned_host_bytes + plan.prediction.codec_saved_host_bytes
    assert "its host store does not fit the host budget" in plan.reason and "streamed bytes raw" not in plan.reason


def test_a_host_budget_that_needs_disk_blocks_reads_fewer_bytes_and_runs_faster_encoded():
    """FLUX at 6 GB of GPU and 12 GB of host memory on a 2 GB/s disk: raw, 34 blocks read 14 GB a step from the
    checkpoint's files; encoded, the host store holds more blocks and the disk tier's are read encoded from the spill
    file, so fewer blocks read fewer bytes each and the step is faster."""
    hw = _hw("h200", disk_read_gbps=2.0)
    raw, enc = _plan("flux", 6, "off", hw=hw, host=12), _plan("flux", 6, "auto", hw=hw, host=12)
    assert enc.offload.codec == CODEC and 0 < enc.offload.disk_blocks < raw.offload.disk_blocks
    r, e = raw.prediction, enc.prediction
    assert e.host_memory_bytes <= 12 * GB and r.host_memory_bytes <= 12 * GB
    assert e.disk_read_bytes_per_step < SUPPOSED_CODEC_RATIO * r.disk_read_bytes_per_step
    assert e.disk_stall_s < r.disk_stall_s and e.step_time_s < 0.6 * r.step_time_s
    assert e.codec_spill_bytes == e.disk_read_bytes_per_step  # one pass a step: the spill file is read once a step
    m = estimate_memory(get_model("flux"), enc.workload.to_workload(), enc.offload, hw=hw.spec)
    assert e.codec_saved_bytes_per_step == int(m.codec_saved_link) > e.codec_saved_host_bytes
    assert "spill file" in enc.reason


def test_no_decode_rate_keeps_it_off_and_on_is_refused_with_the_remedy():
    hw = _hw("h200", codec_decode_gbps=None)
    assert _plan("flux", 6, "auto", hw=hw).offload.codec == "none"
    with pytest.raises(ChunkflowError, match="--codec on: .*no decode rate") as exc:
        _plan("flux", 6, "on", hw=hw)
    assert CODEC_RATE_REMEDY in str(exc.value)


def test_fp8_storage_and_non_bf16_weights_never_take_the_codec():
    plan = _plan("flux", 6, "auto", weight_dtype="fp8_e4m3")
    assert plan.offload.weight_dtype == "fp8_e4m3" and plan.offload.codec == "none"
    assert all(c == "none" for _, d, c in Levers.of(1, weight_dtype="auto", allow_fp8=True, codec="auto").combos()
               if d != "bf16")
    with pytest.raises(ChunkflowError, match="use one or the other"):
        Levers.of(1, weight_dtype="fp8_e4m3", codec="on")
    fp32 = get_model("flux").model_copy(update={"dtype_bytes": 4})
    assert "16-bit" in codec_refusal(fp32, get_hardware("h200"))


def test_codec_on_is_forced_where_auto_would_not_take_it():
    plan = _plan("wan2.1-14b", 40, "on", frames=81, height=720, width=1280)
    assert plan.offload.codec == CODEC and "as asked" in plan.reason


def test_the_plan_file_records_the_codec_and_reads_back(tmp_path):
    plan = _plan("flux", 6, "auto", hw=_hw("h200", codec_ratio=0.68))
    assert plan.prediction.codec_ratio == 0.68 and plan.prediction.codec_ratio_measured is True
    path = tmp_path / "plan.json"
    plan.write(str(path))
    data = json.loads(path.read_text())
    assert data["offload"]["codec"] == CODEC and data["prediction"]["codec_ratio_measured"] is True
    back = load_plan(str(path))
    assert back.offload == plan.offload and back.prediction.codec_saved_host_bytes == \
        plan.prediction.codec_saved_host_bytes


# ---------------------------------------------------------------------------------------------------- the CLI


@pytest.mark.usefixtures("workdir")
def test_plan_codec_flag_through_the_cli():
    args = ["plan", "--model", "flux", "--mem-budget", "6GB", "--max-slowdown", "4", "--transformer-only"]
    out = runner.invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["offload"]["codec"] == CODEC  # auto, the default
    off = runner.invoke(app, [*args, "--codec", "off", "--json"])
    assert json.loads(off.stdout)["offload"]["codec"] == "none"
    shown = runner.invoke(app, [*args, "--hardware", "h200"])
    assert "codec exponent-pack (ratio 0.710 (supposed)" in " ".join(shown.stdout.split())
    refused = runner.invoke(app, [*args, "--hardware", "a100-80gb", "--codec", "on"])
    assert refused.exit_code != 0 and "chunkflow calibrate" in refused.output
    bad = runner.invoke(app, [*args, "--codec", "maybe"])
    assert bad.exit_code != 0 and "--codec must be auto, on or off" in bad.output


# ---------------------------------------------------------------------------------------------------- calibrate


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    from pipelines import save_catalog_pipeline

    return save_catalog_pipeline("tiny", tmp_path_factory.mktemp("saved") / "tiny")


def test_calibrate_measures_the_ratio_on_the_saved_transformer_and_the_plan_uses_it(saved_tiny, workdir):
    import torch
    from safetensors import safe_open

    from chunkflow.commands.calibrate.codec import measure_codec, measure_ratio, streamed_tensors, transformer_files
    from chunkflow.commands.calibrate.profile import write_profile

    files = transformer_files(saved_tiny)
    assert files and all(f.parent.name == "transformer" for f in files)  # the transformer's, not the text encoder's
    tensors = streamed_tensors(files)
    assert tensors and all("blocks." in name for _, name, _ in tensors)
    with safe_open(str(files[0]), framework="pt") as f:
        assert all(f.get_tensor(name).dtype == torch.bfloat16 for p, name, _ in tensors if p == files[0])
    bounded = measure_ratio(saved_tiny, sample_bytes=4096, chunk_bytes=1024)
    assert bounded["raw_bytes"] <= 4096 and bounded["chunks"] <= 4 and bounded["tensors"] == len(tensors)
    whole = measure_ratio(saved_tiny)
    assert whole["raw_bytes"] == sum(min(n, 16 * 2**20) for _, _, n in tensors)  # every tensor sampled: tiny
    assert 0.5 < whole["ratio"] < 0.95  # random bf16 weights: the exponent shrinks, sign and mantissa do not
    assert whole["ratio"] == whole["stored_bytes"] / whole["raw_bytes"]
    logged: list[str] = []
    extra, raw = measure_codec(str(saved_tiny), torch.device("cpu"), logged.append)
    assert extra == {"codec_ratio": round(whole["ratio"], 4)} and raw["ratio"] == whole  # no decode rate on a CPU
    assert any("ratio" in line for line in logged)
    write_profile(get_hardware("h200").model_copy(update=extra), workdir / "measured.yaml")
    out = runner.invoke(app, ["plan", "--model", "flux", "--mem-budget", "6GB", "--max-slowdown", "4",
                              "--transformer-only", "--hardware", str(workdir / "measured.yaml"), "--json"])
    assert out.exit_code == 0, out.output
    pred = json.loads(out.stdout)["prediction"]
    assert pred["codec_ratio"] == extra["codec_ratio"] and pred["codec_ratio_measured"] is True


def test_calibrate_finds_nothing_to_sample_in_a_float32_transformer(tmp_path):
    import torch

    from chunkflow.commands.calibrate.codec import measure_codec, measure_ratio
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny", tmp_path / "fp32", dtype=torch.float32)
    assert measure_ratio(folder) is None
    logged: list[str] = []
    assert measure_codec(str(folder), torch.device("cpu"), logged.append) == ({}, {})
    assert any("stays supposed" in line for line in logged)


# ---------------------------------------------------------------------------------------------------- the run report


def test_the_run_report_compares_the_codec_measured_against_planned():
    from types import SimpleNamespace

    from chunkflow.commands.plan_tables import codec_rows
    from chunkflow.reports import codec_stats
    from chunkflow_planner.predict import predict

    assert codec_stats(None) == codec_stats({}) == codec_stats(SimpleNamespace()) == \
        dict(codec="none", codec_raw_bytes=0, codec_stored_bytes=0)  # a runtime without the codec
    got = dict(codec=CODEC, codec_raw_bytes=1000, codec_stored_bytes=700)
    assert codec_stats({**got, "pinned_bytes": 5}) == got == codec_stats(SimpleNamespace(**got))
    spec, hw = get_model("flux"), get_hardware("h200")
    p = predict(spec, spec.default_workload, hw, OffloadConfig("chunkflow", "16MB", codec=CODEC))
    assert p.codec == CODEC and p.codec_ratio == SUPPOSED_CODEC_RATIO and not p.codec_ratio_measured
    assert p.codec_stored_bytes == pytest.approx(SUPPOSED_CODEC_RATIO * p.codec_raw_bytes, abs=1)
    m = SimpleNamespace(codec=CODEC, codec_raw_bytes=p.codec_raw_bytes, codec_stored_bytes=int(0.7 * p.codec_raw_bytes))
    rows = {r[0]: r[1:] for r in codec_rows(m, p)}
    assert rows["codec"] == (CODEC, CODEC, "-")
    assert rows["codec ratio (stored / raw)"][:2] == ("0.700", "0.710 (supposed)")
    assert rows["codec ratio (stored / raw)"][2] == "-1.4%"
    raw = SimpleNamespace(codec="none", codec_raw_bytes=0, codec_stored_bytes=0)
    assert codec_rows(raw, p)[0] == ("codec", "none", CODEC, "differs")  # planned encoded, streamed raw
    assert codec_rows(raw, predict(spec, spec.default_workload, hw, OffloadConfig("chunkflow", "16MB"))) == []


def test_the_load_prices_encoding_the_streamed_tails():
    """With the codec a load reads each streamed tail to the GPU, encodes it and writes it back to pinned memory:
    its raw bytes at the profile's end-to-end encode rate, one more part of T_load; none without the codec."""
    from chunkflow_planner.memory import estimate_memory
    from chunkflow_planner.pipeline.load import LoadEstimate, load_parts

    spec = get_model("flux")
    hw = get_hardware("h200").model_copy(update={"disk_read_gbps": 2.0})
    assert hw.codec_encode_gbps is not None
    m = estimate_memory(spec, spec.default_workload, OffloadConfig("chunkflow", "16MB", 0.2, codec=CODEC), hw=hw)
    est = LoadEstimate(1e9, 1e9, 1e9, 1e9, encoded_bytes=m.codec_raw)
    assert load_parts(est, 0.0, hw)["encode"] == pytest.approx(m.codec_raw / (hw.codec_encode_gbps * 1e9))
    assert "encode" not in load_parts(LoadEstimate(1e9, 1e9, 1e9, 1e9), 0.0, hw)


def test_the_load_reads_encodes_and_spills_the_disk_tails_once():
    """With the codec the load reads each disk block's raw tail from the checkpoint's files (cold, at the disk's
    rate), encodes it with the host tier's tails and writes the encoded bytes to the spill file at the disk's rate;
    without it the tails stay in the files for the forwards."""
    spec = get_model("wan2.1-14b")
    w = make_workload(spec, frames=81, height=720, width=1280, steps=50)
    hw = _hw("h200", disk_read_gbps=1.5)

    def plan(codec: str, host: float):
        levers = Levers.of(w.cfg_passes, "auto", "bf16", False, codec, codec_refusal(spec, hw.spec))
        return make_plan(spec, w, hw, budget=24 * GB, host_budget=int(host * GB), levers=levers)[0]

    disk, none = plan("on", 24), plan("on", 32)  # encoded: with disk blocks, and with none
    raw = plan("off", 24)
    assert disk.offload.disk_blocks > 0 and none.offload.disk_blocks == 0 and raw.offload.disk_blocks > 0
    assert [c.placement for c in disk.pipeline.components] == [c.placement for c in none.pipeline.components]
    ld, ln, lr = disk.prediction.load, none.prediction.load, raw.prediction.load
    assert ld.read_bytes == ln.read_bytes > lr.read_bytes  # the disk tails are read at the load, raw
    m = estimate_memory(spec, disk.workload.to_workload(), disk.offload, hw=hw.spec)
    assert m.codec_spill_raw > 0 and m.codec_spill == pytest.approx(SUPPOSED_CODEC_RATIO * m.codec_spill_raw)
    parts = ld.parts_cold_s
    assert parts["encode"] == pytest.approx((m.codec_raw + m.codec_spill_raw) / (hw.spec.codec_encode_gbps * GB))
    assert parts["encode"] == pytest.approx(ln.parts_cold_s["encode"])  # every streamed tail, either tier
    assert parts["spill"] == pytest.approx(m.codec_spill / (1.5 * GB))  # written at the disk's (read) rate
    assert disk.prediction.codec_spill_bytes == int(m.codec_spill)
    assert ld.time_cold_s == pytest.approx(ln.time_cold_s + parts["spill"])
    assert "spill" not in lr.parts_cold_s and "spill" not in ln.parts_cold_s
