"""An offloaded model is still a normal model, round two (CPU, tiny real pipelines, every result compared with the
same pipeline without chunkflow): training gives diffusers' gradients, two threads share one offloaded transformer,
diffusers' block hooks and from_pipe find its blocks and its class, and a refused call changes nothing."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from pipelines import call_kwargs, one_thread, tiny_pipeline

pytest.importorskip("diffusers")

import chunkflow  # noqa: E402
from chunkflow import OffloadError  # noqa: E402

SETTINGS = [dict(mode="chunkflow", chunk_size="4KB", residency=0.0), dict(mode="chunkflow", chunk_size="4KB",
                                                                          residency=0.3), dict(mode="layerwise")]
IDS = ["chunkflow-r0", "chunkflow-r0.3", "layerwise"]


def _output(pipe, kind: str):
    out = pipe(**call_kwargs(kind))
    return out.frames if hasattr(out, "frames") else out.images


# ------------------------------------------------------------------------------------------------ training


def _transformer_inputs(kind: str, t) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "wan":
        return dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    c = t.config
    return dict(hidden_states=torch.randn(1, 16, c.in_channels, generator=g), timestep=torch.tensor([0.5]),
                encoder_hidden_states=torch.randn(1, 8, c.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g),
                txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(16, 3), guidance=torch.tensor([3.5]))


def _train_step(kind: str, setting: dict | None, lora: bool, checkpointing: bool):
    """One forward, backward and SGD step of the tiny transformer (all of it, or a LoRA on a frozen base), then
    a second forward: the loss, the gradients and the output after the step."""
    t = tiny_pipeline(kind).transformer.float()
    if lora:
        from peft import LoraConfig

        t.requires_grad_(False)
        t.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    else:
        t.requires_grad_(True)
    if checkpointing:
        t.enable_gradient_checkpointing()
    t.train()
    handle = chunkflow.offload(t, device="cpu", **setting) if setting else None
    trained = [p for p in t.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.1)
    kw = _transformer_inputs(kind, t)
    with one_thread():
        loss = t(**kw, return_dict=False)[0].square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in t.named_parameters() if p.grad is not None}
        opt.step()
        with torch.no_grad():
            after = t(**kw, return_dict=False)[0]
    if handle is not None:
        handle.remove()
    return loss.detach(), grads, after


@pytest.mark.parametrize("kind", ["wan", "flux"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_training_gives_the_gradients_of_the_model_not_offloaded(kind, lora, checkpointing):
    """A backward pass through an offloaded transformer (full fine-tune, or a LoRA on a frozen base; with and without
    diffusers' gradient checkpointing) gives the loss and the gradients of the same model not offloaded, bit for
    bit, and an optimizer step on it gives the same next output: each block is recomputed for backward, its weights
    brought back, instead of autograd keeping views of the streaming slots that later blocks overwrite."""
    ref_loss, ref_grads, ref_after = _train_step(kind, None, lora, checkpointing)
    assert ref_grads
    for setting in SETTINGS:
        loss, grads, after = _train_step(kind, setting, lora, checkpointing)
        assert torch.equal(loss, ref_loss), setting
        assert grads.keys() == ref_grads.keys(), setting
        wrong = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
        assert not wrong, (setting, wrong[:5])
        assert torch.equal(after, ref_after), setting


# ------------------------------------------------------------------------------------------------- threads


def test_two_threads_share_one_offloaded_transformer():
    """Two pipelines sharing one offloaded transformer (each with its own scheduler, which diffusers keeps state in),
    called from two threads: every output is the single-threaded one (forwards take turns through the module), and
    the handle works after."""
    from diffusers import WanPipeline

    pipe = tiny_pipeline("wan")
    with one_thread():
        ref = _output(pipe, "wan")
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[1])
    other = WanPipeline(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)})
    other.set_progress_bar_config(disable=True)
    outputs, errors = [], []

    def work(p):
        try:
            for _ in range(4):
                outputs.append(_output(p, "wan"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(p,)) for p in (pipe, other)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(outputs) == 8
    assert all(torch.equal(o, ref) for o in outputs)
    with one_thread():
        assert torch.equal(_output(pipe, "wan"), ref)
    handle.remove()


# ------------------------------------------------------------------------------------- diffusers' block hooks


def _hooks(kind: str):
    from diffusers.hooks import FirstBlockCacheConfig, LayerSkipConfig, apply_first_block_cache, apply_layer_skip

    blocks = "blocks" if kind == "wan" else "transformer_blocks"
    return {
        "enable_cache(FirstBlockCacheConfig)": lambda t: t.enable_cache(FirstBlockCacheConfig(threshold=0.5)),
        "apply_first_block_cache": lambda t: apply_first_block_cache(t, FirstBlockCacheConfig(threshold=0.5)),
        # (skipping attention fails in diffusers itself for these two: their processors are not in its registry)
        "apply_layer_skip": lambda t: apply_layer_skip(t, LayerSkipConfig(
            indices=[1], fqn=blocks, skip_attention=False, skip_ff=True)),
    }


@pytest.mark.parametrize("kind", ["wan", "flux"])
@pytest.mark.parametrize("hook", ["enable_cache(FirstBlockCacheConfig)", "apply_first_block_cache",
                                  "apply_layer_skip"])
def test_diffusers_block_hooks_work_after_offload(kind, hook):
    """diffusers' hooks that look a block's class up (its block registry) find an offloaded block as its own
    class: the output is the one the same hook gives without chunkflow."""
    outs = []
    for setting in (None, SETTINGS[1]):
        pipe = tiny_pipeline(kind)
        handle = chunkflow.offload(pipe.transformer, device="cpu", **setting) if setting else None
        _hooks(kind)[hook](pipe.transformer)
        with one_thread():
            outs.append(_output(pipe, kind))
        if handle is not None:
            assert type(pipe.transformer.transformer_blocks[0] if kind == "flux" else pipe.transformer.blocks[0]) \
                == type(tiny_pipeline(kind).transformer.transformer_blocks[0] if kind == "flux"
                        else tiny_pipeline(kind).transformer.blocks[0])
    assert torch.equal(outs[0], outs[1])


def test_from_pipe_carries_the_offloaded_transformer_over():
    from diffusers import WanPipeline

    pipe = tiny_pipeline("wan")
    with one_thread():
        ref = _output(pipe, "wan")
    chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[0])
    new = WanPipeline.from_pipe(pipe)
    assert new.transformer is pipe.transformer
    new.set_progress_bar_config(disable=True)
    with one_thread():
        assert torch.equal(_output(new, "wan"), ref)


# ---------------------------------------------------------------------------------- refusals change nothing


def _snapshot(module):
    return {n: (p.dtype, p.device, p.detach().clone()) for n, p in module.named_parameters()}


def _unchanged(module, before) -> bool:
    now = _snapshot(module)
    return now.keys() == before.keys() and all(
        now[n][0] == before[n][0] and now[n][1] == before[n][1] and torch.equal(now[n][2], before[n][2]) for n in now)


@pytest.mark.parametrize("what", ["enable_layerwise_casting", "apply_layerwise_casting", "part to meta", "part half",
                                  "block to float64", "enable_group_offload"])
def test_a_refused_call_changes_nothing(what):
    """Calls that would change where or how part of an offloaded module is stored are refused before anything
    changes: the weights, their dtypes and devices, and the next output are as before, and remove() works."""
    from diffusers.hooks import apply_layerwise_casting

    pipe = tiny_pipeline("flux")
    with one_thread():
        ref = _output(pipe, "flux")
    t = pipe.transformer
    handle = chunkflow.offload(t, device="cpu", **SETTINGS[1])
    before = _snapshot(t)
    call = {
        "enable_layerwise_casting": lambda: t.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                                                       compute_dtype=torch.float32),
        "apply_layerwise_casting": lambda: apply_layerwise_casting(t, storage_dtype=torch.float8_e4m3fn,
                                                                   compute_dtype=torch.float32),
        "part to meta": lambda: t.transformer_blocks[1].ff.to("meta"),
        "part half": lambda: t.x_embedder.half(),
        "block to float64": lambda: t.single_transformer_blocks[0].to(torch.float64),
        "enable_group_offload": lambda: t.enable_group_offload(torch.device("cpu"), offload_type="block_level",
                                                               num_blocks_per_group=1),
    }[what]
    with pytest.raises(OffloadError, match="nothing was changed"):
        call()
    assert _unchanged(t, before)
    with one_thread():
        assert torch.equal(_output(pipe, "flux"), ref)
    t.transformer_blocks[0].to("cpu")  # where it already is: nothing to do, nothing refused
    handle.remove()
    assert _unchanged(t, before)


def test_whole_module_conversions_are_those_of_a_normal_module():
    """`pipe.to(dtype)` converts the offloaded transformer's host store; `pipe.to("meta")` leaves every component
    on the meta device, the offloaded one too (its offload ends: remove() after it has nothing to undo)."""
    pipe = tiny_pipeline("wan")
    with one_thread():
        ref = _output(pipe, "wan")
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[1])
    pipe.to(torch.float64)
    assert pipe.transformer.dtype == torch.float64 and handle.stats().relayouts == 1
    pipe.to(torch.float32)
    with one_thread():
        assert torch.equal(_output(pipe, "wan"), ref)
    pipe.to("meta")
    assert handle.removed and all(p.device.type == "meta" for p in pipe.transformer.parameters())
    assert all(p.device.type == "meta" for p in pipe.text_encoder.parameters())
    handle.remove()


def test_remove_inside_a_forward_is_refused_and_the_handle_keeps_working():
    pipe = tiny_pipeline("wan")
    with one_thread():
        ref = _output(pipe, "wan")
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[1])
    seen = []

    def remove_now(module, args):
        try:
            handle.remove()
        except OffloadError as exc:
            seen.append(str(exc))

    hook = pipe.transformer.blocks[1].register_forward_pre_hook(remove_now)
    with one_thread():
        assert torch.equal(_output(pipe, "wan"), ref)
    hook.remove()
    assert seen and "inside a forward" in seen[0] and not handle.removed
    with one_thread():
        assert torch.equal(_output(pipe, "wan"), ref)
    handle.remove()
    assert handle.removed


# -------------------------------------------------------------------------------------------- batch_cfg


def test_batch_cfg_after_model_cpu_offload_says_why_it_is_refused():
    """diffusers' model CPU offload wraps the transformer's forward with accelerate's hook and puts it back after
    every call (which would drop batch_cfg's wrapper after the first generation, silently): batch_cfg refuses it
    naming enable_model_cpu_offload, changing nothing; applied twice it says so."""
    pytest.importorskip("accelerate")
    pipe = tiny_pipeline("wan")
    with chunkflow.batch_cfg(pipe):
        with pytest.raises(chunkflow.ChunkflowError, match="already on"):
            chunkflow.batch_cfg(pipe)
    assert "forward" not in pipe.transformer.__dict__
    pipe.enable_model_cpu_offload(device="cpu")
    wrapped = pipe.transformer.__dict__.get("forward")
    with pytest.raises(chunkflow.ChunkflowError, match="enable_model_cpu_offload") as err:
        chunkflow.batch_cfg(pipe)
    assert "applied twice" not in str(err.value) and "nothing was changed" in str(err.value)
    assert pipe.transformer.__dict__.get("forward") is wrapped and "encode_prompt" not in pipe.__dict__


def test_batch_cfg_names_the_forward_it_found_not_accelerate_for_a_parked_module():
    """A parked offloaded transformer carries chunkflow's execution-device marker in `_hf_hook` (no accelerate
    hook: it replaces no forward). batch_cfg batches it; and where something else replaced the forward, the
    refusal names that function, not accelerate (issue 51: diffusers' context-parallel hooks were called
    "accelerate's hook (ExecutionDevice ...)")."""
    import functools

    pipe = tiny_pipeline("wan")
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[1])
    handle.park()
    assert "_hf_hook" in pipe.transformer.__dict__
    with chunkflow.batch_cfg(pipe) as b:
        _output(pipe, "wan")
    assert b.stats.batched_forwards > 0 and b.stats.unbatched == 0
    handle.park()

    def someone_elses_forward(module, *args, **kwargs):
        return type(module).forward(module, *args, **kwargs)

    pipe.transformer.forward = functools.partial(someone_elses_forward, pipe.transformer)
    with pytest.raises(chunkflow.ChunkflowError, match="someone_elses_forward") as err:
        chunkflow.batch_cfg(pipe)
    assert "accelerate's hook" not in str(err.value) and "nothing was changed" in str(err.value)
    assert "encode_prompt" not in pipe.__dict__
    handle.remove()


# ----------------------------------------------------------------------------- settings that do not apply


@pytest.mark.parametrize("mode, flag", [("none", "--chunk-size"), ("none", "--residency"),
                                        ("layerwise", "--chunk-size"), ("layerwise", "--residency")])
def test_a_chunk_size_or_residency_for_a_mode_without_them_is_refused(cli, workdir, mode, flag):
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--transformer-only", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    value = "4MB" if flag == "--chunk-size" else "0.3"
    result = cli("run", "--plan", "plan.json", "--device", "cpu", "--mode", mode, flag, value)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "is for mode chunkflow" in said and "Traceback" not in said
    with pytest.raises(chunkflow.ChunkflowError, match="is for mode chunkflow"):  # a setting's overrides: the same
        chunkflow.OffloadConfig("chunkflow").with_overrides(
            mode, **({"chunk_size": "4MB"} if flag == "--chunk-size" else {"residency": 0.3}))


def test_a_part_copied_or_pickled_is_a_plain_module():
    """A module inside an offloaded one, deep-copied (peft's modules_to_save does) or pickled, is a plain module of
    its own class with its values; the original stays offloaded and refuses its own moves."""
    import pickle

    pipe = tiny_pipeline("wan")
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[1])
    q = pipe.transformer.blocks[0].attn1.to_q
    for copied in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert type(copied) is torch.nn.Linear and torch.equal(copied.weight, q.weight)
        copied.half()  # its own now
        assert copied.weight.dtype == torch.float16 and q.weight.dtype == torch.float32
    with pytest.raises(OffloadError, match="nothing was changed"):
        q.half()
    handle.remove()
    assert type(q) is torch.nn.Linear


def test_an_interrupted_forward_leaves_the_module_usable_from_another_thread():
    """A KeyboardInterrupt inside an offloaded forward (a notebook's interrupt) gives the handle back: a forward
    from another thread, park() and remove() then run instead of waiting for ever."""
    pipe = tiny_pipeline("wan")
    with one_thread():
        ref = _output(pipe, "wan")
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[1])

    def interrupt(module, args):
        raise KeyboardInterrupt

    hook = pipe.transformer.blocks[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), one_thread():
        _output(pipe, "wan")
    hook.remove()
    done = []
    th = threading.Thread(target=lambda: done.append(_output(pipe, "wan")))
    th.start()
    th.join(60)
    assert done and torch.equal(done[0], ref)
    handle.park()
    handle.remove()
