"""Below the critical point (issue 15): batched CFG and fp8 weight storage.

- fp8 storage gives exactly what diffusers' layerwise casting (float8_e4m3fn storage) gives on the same blocks, in
  every mode and several (C, r); parameters are fp8 outside the forward as under diffusers; out-of-range weights are
  refused with the module untouched; remove() gives the compute dtype back.
- batched CFG on whole tiny Wan and Qwen-Image pipelines matches the unbatched pipeline within the stated tolerance
  (docs/levers.md: relative 1e-5 in float32 on the CPU), and never serves a half that was computed for other inputs.
- the planner's choices: each lever taken where it lowers residency or makes a plan feasible, left where it does not.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import chunkflow
from chunkflow import OffloadConfig
from pipelines import call_kwargs, one_thread, tiny_pipeline
from tiny import flux, wan

CFG_RTOL = 1e-5  # batched vs unbatched, float32 on the CPU, relative to the output's largest magnitude


# ------------------------------------------------------------------------------------------ fp8 storage


def _layerwise_reference(m, blocks):
    """The same model under diffusers' own layerwise casting (float8_e4m3fn storage, the model's dtype for compute,
    diffusers' default skip patterns): what fp8 storage must give exactly."""
    ref = copy.deepcopy(m)
    ref.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=m.dtype)
    return ref


SETTINGS = [OffloadConfig("layerwise", weight_dtype="fp8_e4m3"),
            OffloadConfig("chunkflow", 1000, 0.0, weight_dtype="fp8_e4m3"),
            OffloadConfig("chunkflow", 3001, 0.3, weight_dtype="fp8_e4m3"),
            OffloadConfig("chunkflow", 50000, 0.5, weight_dtype="fp8_e4m3"),
            OffloadConfig("chunkflow", 4096, 1.0, weight_dtype="fp8_e4m3"),
            # the cast on the copy stream, into a cast buffer per slot (fp8_cast="copy")
            OffloadConfig("layerwise", weight_dtype="fp8_e4m3", fp8_cast="copy"),
            OffloadConfig("chunkflow", 1000, 0.0, weight_dtype="fp8_e4m3", fp8_cast="copy"),
            OffloadConfig("chunkflow", 3001, 0.3, weight_dtype="fp8_e4m3", fp8_cast="copy")]


@pytest.mark.parametrize("build", [wan, lambda: wan(mixed=True), flux], ids=["wan", "wan-bf16-mixed", "flux"])
@pytest.mark.parametrize("cfg", SETTINGS, ids=lambda c: c.label.replace(" ", "-"))
def test_fp8_storage_equals_diffusers_layerwise_casting(build, cfg):
    m, blocks, kw = build()
    ref = _layerwise_reference(m, blocks)
    with torch.no_grad():
        expected = ref(**kw)[0]
        plain = m(**kw)[0]
    h = chunkflow.offload(m, cfg, device="cpu")
    with torch.no_grad():
        first, second = m(**kw)[0], m(**kw)[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert not torch.equal(first, plain)  # fp8 is lossy: the test would notice if nothing were cast
    stats = h.stats()
    fp8 = {n for n, p in m.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert fp8 == {n for n, p in ref.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert any("blocks" not in n for n in fp8) or build is not flux  # FLUX's embedders are cast too
    assert stats.fp8_tensors == len(fp8) > 0 and stats.weight_dtype == "fp8_e4m3"
    assert stats.cast_buffer_bytes > 0
    assert m.dtype == ref.dtype  # the compute dtype, as diffusers reports it under layerwise casting
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.remove()
    assert any("fp8" in str(w.message) for w in caught)
    assert not any(p.dtype == torch.float8_e4m3fn for p in m.parameters())
    with torch.no_grad():  # the fp8-rounded weights, now in their own dtype: what the offloaded model computed
        assert torch.equal(m(**kw)[0], expected)


def test_fp8_store_holds_half_the_bytes_and_state_dict_sees_fp8():
    m, blocks, kw = wan()
    h16 = chunkflow.offload(m, mode="layerwise", device="cpu")
    bf = h16.stats().host_bytes
    h16.remove()
    h8 = chunkflow.offload(m, mode="layerwise", weight_dtype="fp8_e4m3", device="cpu")
    s = h8.stats()
    assert s.host_bytes < 0.3 * bf  # fp32 -> 1 byte per weight, norms kept: well under a third
    sd = m.state_dict()
    assert sd["blocks.0.attn1.to_q.weight"].dtype == torch.float8_e4m3fn
    assert sd["blocks.0.norm2.weight"].dtype == torch.float32  # norms are skipped, as diffusers skips them
    h8.remove()


def test_fp8_refuses_weights_out_of_range_and_leaves_the_module_as_it_was():
    m, blocks, kw = wan()
    with torch.no_grad():
        m.blocks[1].ffn.net[0].proj.weight[0, 0] = 1000.0
    before = {n: p.detach().clone() for n, p in m.state_dict().items()}
    with pytest.raises(chunkflow.ChunkflowError, match="blocks.1.ffn.net.0.proj.weight.*448"):
        chunkflow.offload(m, mode="chunkflow", weight_dtype="fp8_e4m3", device="cpu")
    after = m.state_dict()
    assert all(torch.equal(after[n], v) and after[n].dtype == v.dtype for n, v in before.items())
    assert "_chunkflow_handle" not in m.__dict__
    f, _, _ = flux()  # a layer outside the blocks (kept on the device, in fp8 too)
    with torch.no_grad():
        f.x_embedder.weight[0, 0] = -500.0
    with pytest.raises(chunkflow.ChunkflowError, match="x_embedder.weight"):
        chunkflow.offload(f, mode="layerwise", weight_dtype="fp8_e4m3", device="cpu")
    assert f.x_embedder.weight.dtype == torch.float32 and "_chunkflow_handle" not in f.__dict__


def test_fp8_dtype_change_and_no_op_casts():
    """module.to(dtype) while stored in fp8: the compute dtype changes, the fp8 values stay as they were."""
    m, blocks, kw = wan()
    original = copy.deepcopy(m)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=3001, residency=0.3, weight_dtype="fp8_e4m3", device="cpu")
    stored = {n: v.clone() for n, v in m.state_dict().items() if v.dtype == torch.float8_e4m3fn}
    m.to(torch.float32)  # the compute dtype already: nothing to lay out again
    assert h.stats().relayouts == 0
    m.to(torch.bfloat16)
    assert h.stats().relayouts == 1
    now = m.state_dict()
    assert all(now[n].dtype == torch.float8_e4m3fn and torch.equal(now[n].view(torch.uint8), v.view(torch.uint8))
               for n, v in stored.items())
    ref = original.to(torch.bfloat16)  # what the offloaded model computes: the fp8 values, in bf16
    with torch.no_grad():
        for n, v in stored.items():
            ref.get_parameter(n).copy_(v.to(torch.bfloat16))
    kw16 = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        assert torch.equal(m(**kw16)[0], ref(**kw16)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.remove()


def test_fp8_setting_is_checked():
    m, blocks, kw = wan()
    with pytest.raises(chunkflow.ChunkflowError, match="mode none streams nothing"):
        chunkflow.offload(m, mode="none", weight_dtype="fp8_e4m3", device="cpu")
    with pytest.raises(chunkflow.ChunkflowError, match="unknown weight_dtype"):
        chunkflow.offload(m, mode="chunkflow", weight_dtype="int4", device="cpu")
    assert "_chunkflow_handle" not in m.__dict__


# ------------------------------------------------------------------------------------------ batched CFG


def _result(pipe, kind):
    out = pipe(**call_kwargs(kind))
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("kind", ["wan", "qwen"])
def test_batched_cfg_pipeline_matches_unbatched_within_tolerance(kind):
    from chunkflow.cfg import batch_cfg

    with one_thread():
        pipe = tiny_pipeline(kind)
        ref = _result(pipe, kind)
        with batch_cfg(pipe) as b:
            ours = _result(pipe, kind)
            again = _result(pipe, kind)  # a second generation records its own prompts
        assert b.stats.batched_forwards == 4 and b.stats.served == 4 and b.stats.unbatched == 0
        after = _result(pipe, kind)
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= CFG_RTOL * scale
    assert torch.equal(ours, again)
    assert torch.equal(after, ref)  # removed: the pipeline is itself again
    assert "forward" not in pipe.transformer.__dict__ and "encode_prompt" not in pipe.__dict__


def test_batched_cfg_with_an_offloaded_transformer():
    from chunkflow.cfg import batch_cfg

    with one_thread():
        pipe = tiny_pipeline("wan")
        ref = _result(pipe, "wan")
        h = chunkflow.offload(pipe.transformer, mode="chunkflow", chunk_size=4096, device="cpu")
        with batch_cfg(pipe) as b:
            ours = _result(pipe, "wan")
        forwards = h.stats().forwards
        h.remove()
    assert b.stats.batched_forwards == 2
    assert (ours - ref).abs().max() <= CFG_RTOL * ref.abs().max()
    assert forwards == 2  # one forward a step: each block streamed once a step


def test_batched_cfg_never_serves_a_half_computed_for_other_inputs():
    """A caller whose second pass differs from the first (here: other latents) gets a real forward."""
    from chunkflow.cfg import batch_cfg

    with one_thread():
        pipe = tiny_pipeline("wan")
        b = batch_cfg(pipe)
        pos, neg = pipe.encode_prompt("a cat walks on the grass", "blurry, low quality", max_sequence_length=16)
        t = pipe.transformer
        x = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
        step = torch.tensor([500.0])
        cond = t(hidden_states=x, timestep=step, encoder_hidden_states=pos, return_dict=False)[0]
        other = x + 1
        uncond_other = t(hidden_states=other, timestep=step, encoder_hidden_states=neg, return_dict=False)[0]
        b.remove()
        expect_cond = t(hidden_states=x, timestep=step, encoder_hidden_states=pos, return_dict=False)[0]
        expect_other = t(hidden_states=other, timestep=step, encoder_hidden_states=neg, return_dict=False)[0]
        stale = t(hidden_states=x, timestep=step, encoder_hidden_states=neg, return_dict=False)[0]
    # the first call's other half (neg at x) was not handed to the call at other latents: it ran itself
    assert b.stats.served == 0 and b.stats.discarded == 1 and b.stats.batched_forwards == 2
    assert (cond - expect_cond).abs().max() <= CFG_RTOL * expect_cond.abs().max()
    assert (uncond_other - expect_other).abs().max() <= CFG_RTOL * expect_other.abs().max()
    assert (uncond_other - stale).abs().max() > 100 * CFG_RTOL * stale.abs().max()


def test_batch_cfg_refuses_what_it_cannot_batch():
    from chunkflow.cfg import CfgBatchingError, batch_cfg

    with pytest.raises(CfgBatchingError, match="encode_prompt"):
        batch_cfg(object())
    with one_thread():
        pipe = tiny_pipeline("wan")
    b = batch_cfg(pipe)
    with pytest.raises(CfgBatchingError, match="already"):
        batch_cfg(pipe)
    b.remove()


def test_synthetic_run_with_batched_cfg(cli, workdir):
    """`chunkflow run --cfg-batched` over a plan: one forward a step (each block streamed once), half the H2D
    bytes of the unbatched run, and the report says which it ran."""
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--transformer-only", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(open("plan.json").read())
    assert plan["workload"]["cfg_passes"] == 2 and "cfg_batched" in plan["offload"]
    reports = {}
    for flag in ("--cfg-batched", "--no-cfg-batched"):
        out = f"r{flag}.json"
        result = cli("run", "--plan", "plan.json", "--device", "cpu", "--steps", "2", "--warmup", "0",
                     "--mode", "chunkflow", "--chunk-size", "4KB", flag, "--report", out,
                     "--latents", f"z{flag}.safetensors")
        assert result.exit_code == 0, result.output
        reports[flag] = json.loads(open(out).read())
    on, off = reports["--cfg-batched"], reports["--no-cfg-batched"]
    assert on["run"]["offload"]["cfg_batched"] is True and off["run"]["offload"]["cfg_batched"] is False
    assert on["stats"]["forwards"] == 2 and off["stats"]["forwards"] == 4
    from safetensors.torch import load_file

    z_on = load_file("z--cfg-batched.safetensors")["latents"].float()
    z_off = load_file("z--no-cfg-batched.safetensors")["latents"].float()
    assert (z_on - z_off).abs().max() <= 2e-2 * z_off.abs().max()  # bf16: the stated tolerance
    per_forward = on["stats"]["streamed_bytes_per_step"]
    assert off["stats"]["h2d_bytes_issued"] - on["stats"]["h2d_bytes_issued"] == 2 * per_forward > 0


# ------------------------------------------------------------------------------------------ the planner


def _decide(model, budget, levers, slowdown=None, hw=None, **workload):
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.policy import Problem, decide
    from chunkflow_planner.workload import make_workload

    spec = get_model(model)
    problem = Problem(spec, make_workload(spec, **workload), hw or get_hardware("h200"), levers=levers)
    return decide(problem, budget) if slowdown is None else decide(problem, budget, slowdown)


def test_batched_cfg_is_chosen_where_it_lowers_residency():
    from chunkflow_planner.policy import Levers

    w = dict(frames=41, height=480, width=832, cfg_passes=2)
    auto = _decide("wan2.2", 8 * 10**9, Levers.of(2), **w)
    off = _decide("wan2.2", 8 * 10**9, Levers.of(2, "off"), **w)
    assert auto.chosen.cfg.cfg_batched and auto.chosen.cfg.residency == 0
    assert not off.chosen.cfg.cfg_batched and off.chosen.cfg.residency > 0.2
    assert "batched CFG" in auto.reason and f"{off.chosen.cfg.residency:.0%}" in auto.reason


def test_batched_cfg_is_not_chosen_where_it_does_not_pay():
    from chunkflow_planner.policy import Levers

    # hidden regime (81 frames at 704x1280): both stream at r = 0 within the target; batching only costs memory
    hidden = _decide("wan2.2", 16 * 10**9, Levers.of(2), frames=121, height=704, width=1280, cfg_passes=2)
    assert hidden.chosen.cfg.residency == 0 and not hidden.chosen.cfg.cfg_batched
    assert "unbatched CFG" in hidden.reason
    # one guidance pass (FLUX): nothing to batch
    assert Levers.of(1, "on").cfg_batched == (False,)
    flux_plan = _decide_slow("flux", 16 * 10**9, Levers.of(1, "on"), 1.5)
    assert flux_plan.chosen.cfg.mode == "chunkflow" and not flux_plan.chosen.cfg.cfg_batched
    # the doubled activations do not fit: unbatched
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.policy import Problem
    from chunkflow_planner.workload import make_workload

    spec = get_model("wan2.2")
    big = dict(frames=121, height=704, width=1280, cfg_passes=2)
    p = Problem(spec, make_workload(spec, **big), get_hardware("h200"), levers=Levers.of(2))
    unbatched = p.evaluate(OffloadConfig("chunkflow", 16 * 10**6, 0.0))
    batched = p.evaluate(OffloadConfig("chunkflow", 16 * 10**6, 0.0, cfg_batched=True))
    assert batched.need > unbatched.need
    tight = _decide("wan2.2", (unbatched.need + batched.need) // 2, Levers.of(2), **big)
    assert not tight.chosen.cfg.cfg_batched and tight.chosen.cfg.residency == 0


def test_fp8_only_when_allowed_and_where_it_pays():
    from chunkflow_planner.catalog import get_hardware
    from chunkflow_planner.policy import Infeasible, Levers

    w = dict(frames=41, height=480, width=832, cfg_passes=2)
    never = _decide("wan2.2", 8 * 10**9, Levers.of(2, "off", "auto", allow_fp8=False), slowdown=1.10, **w)
    allowed = _decide("wan2.2", 8 * 10**9, Levers.of(2, "off", "auto", allow_fp8=True), slowdown=1.10, **w)
    assert never.chosen.cfg.weight_dtype == "bf16"
    assert allowed.chosen.cfg.weight_dtype == "fp8_e4m3"
    assert allowed.chosen.cfg.residency < never.chosen.cfg.residency
    assert "fp8 weight storage" in allowed.reason
    # at 1.05x the cast (the H200's 1387 GB/s: 0.24 ms of a 6.7 ms block) leaves too little room: fp8 would not
    # lower residency, so the exact weights are kept
    tight = _decide("wan2.2", 8 * 10**9, Levers.of(2, "off", "auto", allow_fp8=True), slowdown=1.05, **w)
    assert tight.chosen.cfg.weight_dtype == "bf16" and "exact weights are kept" in tight.reason
    free_cast = get_hardware("h200").model_copy(update={"fp8_cast_gbps": 1e6})
    assert _decide("wan2.2", 8 * 10**9, Levers.of(2, "off", "auto", allow_fp8=True), slowdown=1.05, hw=free_cast,
                   **w).chosen.cfg.weight_dtype == "fp8_e4m3"
    # where bf16 streams at r = 0 already, fp8 would not lower residency: the exact weights are kept
    hidden = _decide("wan2.2", 16 * 10**9, Levers.of(2, "off", "auto", allow_fp8=True), frames=121, height=704,
                     width=1280, cfg_passes=2)
    assert hidden.chosen.cfg.weight_dtype == "bf16" and "exact weights are kept" in hidden.reason
    # Qwen-Image at 1328x1328 in 24 GB: infeasible at 1.10x without the levers, feasible with batched CFG
    with pytest.raises(Infeasible, match="Batched CFG would make it feasible"):
        _decide_slow("qwen-image", 24 * 10**9, Levers.of(2, "off"), 1.10)
    qwen = _decide_slow("qwen-image", 24 * 10**9, Levers.of(2), 1.10)
    assert qwen.chosen.cfg.cfg_batched


def _decide_slow(model, budget, levers, slowdown):
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.policy import Problem, decide
    from chunkflow_planner.workload import make_workload

    spec = get_model(model)
    return decide(Problem(spec, make_workload(spec), get_hardware("h200"), levers=levers), budget, slowdown)


def test_levers_in_the_prediction():
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.predict import predict
    from chunkflow_planner.workload import make_workload

    spec, hw = get_model("wan2.2"), get_hardware("h200")
    w = make_workload(spec, frames=41, height=480, width=832, cfg_passes=2)
    base = predict(spec, w, hw, OffloadConfig("chunkflow", "16MB", 0.0))
    batched = predict(spec, w, hw, OffloadConfig("chunkflow", "16MB", 0.0, cfg_batched=True))
    fp8 = predict(spec, w, hw, OffloadConfig("chunkflow", "16MB", 0.0, weight_dtype="fp8_e4m3"))
    assert batched.step_time_s < 0.6 * base.step_time_s  # exposed: one stream a step instead of two
    assert batched.compute_s == pytest.approx(base.compute_s, rel=0.1)  # the same FLOPs
    assert batched.peak_memory_bytes > base.peak_memory_bytes  # twice the activations
    # one byte a cast weight; the norms and Wan's modulation table fp8 storage keeps (params.fp8_kept_params) as
    # they are: a little over half
    assert fp8.pinned_host_bytes == sum(spec.block_stored_bytes(g, True) for g in spec.block_sequence())
    assert base.pinned_host_bytes / 2 < fp8.pinned_host_bytes < 1.001 * base.pinned_host_bytes / 2
    assert fp8.compute_s > base.compute_s  # the cast is paid on the compute path


def test_plan_cli_flags(cli, workdir):
    result = cli("plan", "--model", "wan2.2", "--frames", "41", "--height", "480", "--width", "832",
                 "--mem-budget", "8GB", "--transformer-only", "--cfg-batching", "off", "--weight-dtype", "auto",
                 "--allow-fp8", "--max-slowdown", "1.10", "--hardware", "h200", "--out", "p.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(open("p.json").read())
    assert plan["offload"]["cfg_batched"] is False and plan["offload"]["weight_dtype"] == "fp8_e4m3"
    assert "fp8" in result.output
    result = cli("plan", "--model", "wan2.2", "--weight-dtype", "int4")
    assert result.exit_code == 2 and "--weight-dtype" in result.output
    result = cli("plan", "--model", "wan2.2", "--cfg-batching", "maybe")
    assert result.exit_code == 2 and "--cfg-batching" in result.output


def test_fp8_with_lora_loaded_before_offload_and_refused_after():
    """A LoRA loaded before offload runs with fp8 base weights as under diffusers' layerwise casting (adapter layers
    kept in their dtype); loading one while the blocks are stored in fp8 is refused and changes nothing."""
    pytest.importorskip("peft")
    from test_pipelines import _clone, _lora_state_dict

    with one_thread():
        pipe = tiny_pipeline("wan")
        sd = _lora_state_dict(pipe, 5)
        pipe.load_lora_weights(_clone(sd), adapter_name="a")
        t = pipe.transformer
        ref = _layerwise_reference(t, [t.blocks])
        kw = dict(hidden_states=torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0)),
                  timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, 16, 32), return_dict=False)
        with torch.no_grad():
            expected = ref(**kw)[0]
        h = chunkflow.offload(t, mode="chunkflow", chunk_size=3001, residency=0.3, weight_dtype="fp8_e4m3",
                              device="cpu")
        with torch.no_grad():
            assert torch.equal(t(**kw)[0], expected)
        lora_dtypes = {p.dtype for n, p in t.named_parameters() if "lora_" in n}
        assert lora_dtypes == {torch.float32}
        fresh = tiny_pipeline("qwen")
        sd2 = _lora_state_dict(fresh, 6)
        h2 = chunkflow.offload(fresh.transformer, mode="layerwise", weight_dtype="fp8_e4m3", device="cpu")
        before = _result(fresh, "qwen")
        with pytest.raises(chunkflow.ChunkflowError, match="fp8"):
            fresh.load_lora_weights(_clone(sd2), adapter_name="b")
        assert not any("lora_" in n for n, _ in fresh.transformer.named_parameters())
        assert torch.equal(_result(fresh, "qwen"), before)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h.remove()
            h2.remove()


def test_the_analysis_of_each_lever():
    """Batched CFG doubles F_block (the critical frame count about halves); fp8 halves B_pref and F*."""
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.overlap import analyse
    from chunkflow_planner.workload import make_workload

    spec, hw = get_model("wan2.2"), get_hardware("h100-pcie-x2-paper")  # a scalar eta: F* is eq. 4's closed form
    w = make_workload(spec, frames=81, height=704, width=1280, cfg_passes=2)
    base = analyse(spec, w, hw)
    batched = analyse(spec, w, hw, cfg=OffloadConfig("chunkflow", cfg_batched=True))
    fp8 = analyse(spec, w, hw, cfg=OffloadConfig("chunkflow", weight_dtype="fp8_e4m3"))
    assert batched.F_block == pytest.approx(2 * base.F_block) and batched.F_star == base.F_star
    assert 0.4 < batched.critical.value / base.critical.value < 0.6
    assert fp8.B_pref == pytest.approx(base.B_pref / 2) and fp8.F_star == pytest.approx(base.F_star / 2)
    assert 0.4 < fp8.critical.value / base.critical.value < 0.6
    qwen = get_model("qwen-image")  # the batch axis: the user's batch, two samples each per batched forward
    wq = make_workload(qwen, cfg_passes=2)
    q0, q1 = analyse(qwen, wq, hw), analyse(qwen, wq, hw, cfg=OffloadConfig("chunkflow", cfg_batched=True))
    assert q1.critical.value == pytest.approx(q0.critical.value / 2)


def test_batched_cfg_with_two_experts():
    """Wan2.2-A14B's pipeline: two transformers switched at a boundary timestep, each pass batched."""
    from diffusers import WanPipeline

    with one_thread():
        p = tiny_pipeline("wan")
        t2 = copy.deepcopy(p.transformer)
        with torch.no_grad():
            for q in t2.parameters():
                q.add_(0.01)
        pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, scheduler=p.scheduler,
                           transformer=p.transformer, transformer_2=t2, boundary_ratio=0.5)
        pipe.set_progress_bar_config(disable=True)
        ref = pipe(**call_kwargs("wan", num_inference_steps=4, guidance_scale_2=3.0)).frames
        with chunkflow.batch_cfg(pipe) as b:
            ours = pipe(**call_kwargs("wan", num_inference_steps=4, guidance_scale_2=3.0)).frames
    assert b.stats.batched_forwards == 4 and b.stats.served == 4
    assert (ours - ref).abs().max() <= CFG_RTOL * ref.abs().max()
    assert "forward" not in t2.__dict__


def test_whole_pipeline_plan_takes_the_levers(cli, workdir):
    """The whole-pipeline planner streams the transformer with batched CFG where that avoids residency, and says so;
    with --cfg-batching off it keeps residency instead."""
    args = ["plan", "--model", "wan2.2", "--frames", "41", "--height", "480", "--width", "832", "--mem-budget",
            "12GB", "--host-mem-budget", "64GB", "--hardware", "h200", "--json"]
    on = json.loads(cli(*args).stdout)
    off = json.loads(cli(*args, "--cfg-batching", "off").stdout)
    placed = {c["kind"]: c["placement"] for c in on["pipeline"]["components"]}
    assert placed["transformer"] == "stream" and on["offload"]["cfg_batched"] is True
    assert on["offload"]["residency"] == 0 and "batched CFG" in on["reason"]
    assert off["offload"]["cfg_batched"] is False and off["offload"]["residency"] > 0
    # batched: the denoise phase holds the doubled activations, not the resident heads
    assert on["prediction"]["phases"]["denoise"]["peak_memory_bytes"] < off["prediction"]["phases"]["denoise"][
        "peak_memory_bytes"]


def test_fp8_cast_on_the_copy_stream_follows_writes_parks_and_dtype_changes():
    """fp8_cast="copy": a block is cast when its copies finish, into its slot's cast buffer; a write to the weights
    while offloaded, a park and a dtype change are seen by the next forward as with the cast on the compute stream."""
    outs = {}
    for where in ("compute", "copy"):
        m, blocks, kw = flux()
        h = chunkflow.offload(m, mode="chunkflow", chunk_size=2000, residency=0.3, weight_dtype="fp8_e4m3",
                              fp8_cast=where, device="cpu")
        assert h.cfg.fp8_cast == where and h.stats().cast_buffer_bytes > 0
        with torch.no_grad():
            first = m(**kw)[0]
            w = m.transformer_blocks[0].ff.net[2].weight  # a write into fp8-stored weights between forwards
            w.copy_((w.float() * 0.5).to(w.dtype))
            second = m(**kw)[0]
            h.park()
            third = m(**kw)[0]
        m.to(torch.bfloat16)
        kw16 = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        with torch.no_grad():
            fourth = m(**kw16)[0]
        assert not torch.equal(first, second) and torch.equal(second, third)
        outs[where] = (first, second, fourth)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h.remove()
    assert all(torch.equal(a, b) for a, b in zip(outs["compute"], outs["copy"]))
    copy_cfg = OffloadConfig("chunkflow", weight_dtype="fp8_e4m3", fp8_cast="copy")
    assert copy_cfg.label.endswith("fp8 cast-on-copy")
    for bad in (dict(fp8_cast="copy"), dict(weight_dtype="fp8_e4m3", fp8_cast="stream"),
                dict(weight_dtype="fp8_e4m3", fp8_cast="")):
        with pytest.raises(ValueError, match="fp8_cast"):  # nothing to cast in bf16; unknown places
            OffloadConfig("chunkflow", **bad)
    assert copy_cfg.with_overrides(weight_dtype="bf16").fp8_cast == "compute"  # back to bf16: nothing to cast
    assert copy_cfg.with_overrides(mode="layerwise").fp8_cast == "copy"


def test_fp8_park_and_unpark_keep_the_arithmetic():
    m, blocks, kw = flux()
    ref = _layerwise_reference(m, blocks)
    with torch.no_grad():
        expected = ref(**kw)[0]
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=2000, residency=0.3, weight_dtype="fp8_e4m3", device="cpu")
    h.park()
    assert h.parked and m.x_embedder.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        assert torch.equal(m(**kw)[0], expected)  # the forward takes the device memory back first
    assert not h.parked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.remove()
    assert m.x_embedder.weight.dtype == torch.float32


def test_batched_cfg_cache_is_per_module_and_sees_changes_in_place():
    """The other half is served only to the same transformer, with inputs unchanged since (also in place)."""
    from chunkflow.cfg import batch_cfg
    from diffusers import WanPipeline

    with one_thread():
        p = tiny_pipeline("wan")
        t = p.transformer
        t2 = copy.deepcopy(t)
        with torch.no_grad():
            for q in t2.parameters():
                q.add_(0.05)
        pipe = WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, scheduler=p.scheduler,
                           transformer=t, transformer_2=t2, boundary_ratio=0.5)
        pos, neg = pipe.encode_prompt("a cat walks on the grass", "blurry, low quality", max_sequence_length=16)
        x = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
        step = torch.tensor([500.0])

        def call(m, latents, text):
            return m(hidden_states=latents, timestep=step, encoder_hidden_states=text, return_dict=False)[0]

        b = batch_cfg(pipe)
        pipe.encode_prompt("a cat walks on the grass", "blurry, low quality", max_sequence_length=16)
        call(t, x, pos)
        other_expert = call(t2, x, neg)  # the other half was computed by t, not t2
        xx = x.clone()
        call(t, xx, pos)
        xx.add_(1.0)  # in place, between the passes
        changed = call(t, xx, neg)
        b.remove()
        want_expert, want_changed = call(t2, x, neg), call(t, xx, neg)
    assert b.stats.served == 0
    assert (other_expert - want_expert).abs().max() <= CFG_RTOL * want_expert.abs().max()
    assert (changed - want_changed).abs().max() <= CFG_RTOL * want_changed.abs().max()


@pytest.mark.parametrize("kind", ["flux", "hunyuan"])
def test_batched_true_cfg_swaps_every_prompt_tensor(kind):
    """Pipelines whose passes differ in pooled embeddings and masks too (true CFG in FLUX, HunyuanVideo): each
    batched forward serves the other pass."""
    from chunkflow.cfg import batch_cfg

    kw = dict(negative_prompt="blurry, low quality", true_cfg_scale=4.0)
    with one_thread():
        pipe = tiny_pipeline(kind)
        ref = _result_kw(pipe, kind, kw)
        with batch_cfg(pipe) as b:
            ours = _result_kw(pipe, kind, kw)
    assert b.stats.batched_forwards == 2 and b.stats.served == 2 and b.stats.discarded == 0
    assert (ours - ref).abs().max() <= CFG_RTOL * ref.abs().max()


def _result_kw(pipe, kind, extra):
    out = pipe(**call_kwargs(kind, **extra))
    return out.frames if hasattr(out, "frames") else out.images


def test_a_plan_with_batched_cfg_warns_the_api_user(tmp_path):
    from typer.testing import CliRunner

    from chunkflow.commands.cli import app

    path = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "cpu", "--transformer-only",
                                      "--cfg-batching", "on", "--mem-budget", "10GB", "--out", str(path)])
    assert result.exit_code == 0, result.output
    plan = json.loads(path.read_text())
    plan["offload"] = dict(plan["offload"], mode="chunkflow", chunk_bytes=4096, residency=0.0, cfg_batched=True)
    path.write_text(json.dumps(plan))
    from chunkflow_planner.catalog import get_model
    from diffusers import WanTransformer3DModel

    m = WanTransformer3DModel(**get_model("tiny-wan").diffusers.config)
    with pytest.warns(UserWarning, match="batch_cfg"):
        h = chunkflow.offload(m, plan=str(path), device="cpu")
    h.remove()


def test_batched_cfg_leaves_stateful_diffusers_hooks_and_changed_weights_alone():
    """A cache hook applied straight with diffusers.hooks (its state advances per call) turns batching off; a weight
    changed between the passes is not answered from the half computed before."""
    from diffusers.hooks import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast

    from chunkflow.cfg import batch_cfg

    with one_thread():
        pipe = tiny_pipeline("wan")
        apply_pyramid_attention_broadcast(pipe.transformer, PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep))
        ref = _result_kw(pipe, "wan", dict(num_inference_steps=4))
        with batch_cfg(pipe) as b:
            ours = _result_kw(pipe, "wan", dict(num_inference_steps=4))
        assert b.stats.batched_forwards == 0 and torch.equal(ours, ref)

        pipe = tiny_pipeline("wan")
        t = pipe.transformer
        pos, neg = pipe.encode_prompt("a cat walks on the grass", "blurry, low quality", max_sequence_length=16)
        x = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
        kw = dict(hidden_states=x, timestep=torch.tensor([500.0]), return_dict=False)
        b = batch_cfg(pipe)
        pipe.encode_prompt("a cat walks on the grass", "blurry, low quality", max_sequence_length=16)
        t(encoder_hidden_states=pos, **kw)
        with torch.no_grad():
            t.proj_out.weight.mul_(2)
        after = t(encoder_hidden_states=neg, **kw)[0]
        b.remove()
        want = t(encoder_hidden_states=neg, **kw)[0]
    assert b.stats.served == 0
    assert (after - want).abs().max() <= CFG_RTOL * want.abs().max()


def test_a_model_under_diffusers_layerwise_casting_is_refused():
    m, blocks, kw = flux()
    m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    for dtype in ("fp8_e4m3", "bf16"):
        with pytest.raises(chunkflow.ChunkflowError, match="layerwise casting"):
            chunkflow.offload(m, mode="layerwise", weight_dtype=dtype, device="cpu")
        assert "_chunkflow_handle" not in m.__dict__


def test_planner_prices_the_cast_on_the_copy_stream():
    """fp8_cast="copy" holds a second cast buffer and does not take the cast off the compute path (its kernels share
    the SMs: measured on an H200, a copy-stream cast ran 1-2% faster than a compute-stream one, not the 12-17% a free
    cast would give): where the copies hide it costs what the compute-stream cast costs, where they are exposed the
    cast lengthens them too."""
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.policy import Problem
    from chunkflow_planner.workload import make_workload

    spec, hw = get_model("wan2.2"), get_hardware("h200")
    for frames, hidden in ((121, True), (9, False)):
        prob = Problem(spec, make_workload(spec, frames=frames, height=480, width=832), hw)
        on = {c: prob.evaluate(OffloadConfig("chunkflow", "16MB", 0.0, weight_dtype="fp8_e4m3", fp8_cast=c))
              for c in ("compute", "copy")}
        assert on["copy"].memory.cast_buffer == 2 * on["compute"].memory.cast_buffer > 0
        assert on["copy"].time.compute == pytest.approx(on["compute"].time.compute)
        if hidden:
            assert on["copy"].step_time == pytest.approx(on["compute"].step_time)
        else:
            assert on["copy"].time.prefetch_stall > on["compute"].time.prefetch_stall
            assert on["copy"].step_time > on["compute"].step_time
    full = Problem(spec, make_workload(spec, frames=41, height=480, width=832), hw)
    r1 = {c: full.evaluate(OffloadConfig("chunkflow", "16MB", 1.0, weight_dtype="fp8_e4m3", fp8_cast=c))
          for c in ("compute", "copy")}  # nothing streams: the runtime casts on the compute stream either way
    assert r1["copy"].step_time == r1["compute"].step_time and r1["copy"].memory.peak == r1["compute"].memory.peak


def test_bench_records_where_fp8_is_cast(cli, workdir):
    result = cli("bench", "--model", "tiny", "--frames", "5", "--modes", "chunkflow", "--weight-dtype", "fp8_e4m3",
                 "--fp8-cast", "copy", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-plots",
                 "--out", "b")
    assert result.exit_code == 0, result.output
    import csv

    rows = list(csv.DictReader(open(workdir / "b" / "bench.csv")))
    assert rows and all(r["fp8_cast"] == "copy" and r["weight_dtype"] == "fp8_e4m3" for r in rows)
    assert "fp8 cast-on-copy" in (workdir / "b" / "summary.md").read_text()
    bad = cli("bench", "--model", "tiny", "--frames", "5", "--fp8-cast", "stream", "--device", "cpu")
    assert bad.exit_code == 2 and "--fp8-cast" in bad.output


@pytest.mark.parametrize("dtype, cast", [("bf16", "compute"), ("fp8_e4m3", "compute"), ("fp8_e4m3", "copy")])
@pytest.mark.parametrize("outer, inner", [(0, 1), (1, 2), (0, 2), (2, 1)])
def test_a_block_called_inside_another_leaves_both_right(dtype, cast, outer, inner):
    """A block run from inside the one before it must not have its slot (or its slot's cast buffer) refilled
    while it still runs: the prefetch waits until the outer block is done."""
    m, blocks, kw = wan()
    with torch.no_grad():
        for b in m.blocks:  # blocks that differ in every tensor, norms included
            for n, p in b.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
    ref = copy.deepcopy(m)
    if dtype != "bf16":
        ref.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=m.dtype)
    args = {}
    hooks = [b.register_forward_pre_hook(lambda mod, a, k, i=i: args.setdefault(i, (a, k)), with_kwargs=True)
             for i, b in enumerate(ref.blocks)]
    with torch.no_grad():
        ref(**kw)
    for h in hooks:
        h.remove()

    def nested(model):
        h = model.blocks[outer].attn1.register_forward_hook(lambda *_: model.blocks[inner](*args[inner][0],
                                                                                          **args[inner][1]))
        with torch.no_grad():
            out = model(**kw)[0]
        h.remove()
        return out

    want = nested(ref)
    handle = chunkflow.offload(m, mode="chunkflow", chunk_size=3001, residency=0.0, weight_dtype=dtype,
                               fp8_cast=cast, device="cpu")
    assert torch.equal(nested(m), want)
    with torch.no_grad():
        assert torch.equal(m(**kw)[0], ref(**kw)[0])  # and the next plain forward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle.remove()


def test_a_forward_under_inference_mode_after_park_leaves_later_forwards_working():
    m, blocks, kw = wan()
    with torch.no_grad():
        want = m(**kw)[0]
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=3001, residency=0.3, device="cpu")
    h.park()
    with torch.inference_mode():
        assert torch.equal(m(**kw)[0], want)
    with torch.no_grad():
        assert torch.equal(m(**kw)[0], want)
    h.remove()


def test_cast_buffers_with_some_blocks_streamed_and_others_resident():
    """fp8_cast="copy" with blocks that stream and blocks wholly resident: a cast buffer per slot for the first, the
    compute stream's one for the others; the planner counts the same three."""
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.memory import cast_volumes, estimate_memory, stored_volumes

    m, blocks, kw = flux()
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=50000, residency=0.5, weight_dtype="fp8_e4m3",
                          fp8_cast="copy", device="cpu")
    streamed = [b.cast_extent for b in h.layouts if b.is_streamed]
    resident = [b.cast_extent for b in h.layouts if not b.is_streamed]
    assert streamed and resident  # the setting gives both kinds
    assert h.stats().cast_buffer_bytes == 2 * max(streamed) + max(resident)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h.remove()
    spec = get_model("flux")
    cfg = OffloadConfig("chunkflow", "16MB", 0.975, weight_dtype="fp8_e4m3", fp8_cast="copy")
    full = cast_volumes(spec)  # the cast tensors in bf16: what a cast buffer holds (cast_extent)
    stored = stored_volumes(spec, cfg)
    streams = [v - cfg.resident_bytes(v) > 0 for v in stored]
    assert any(streams) and not all(streams)
    expected = 2 * max(f for f, s in zip(full, streams) if s) + max(f for f, s in zip(full, streams) if not s)
    assert estimate_memory(spec, spec.default_workload, cfg).cast_buffer == expected
