"""Many generations per load, in Python: `chunkflow.load(plan, weights=DIR)` on a tiny Wan pipeline saved with
save_pretrained. Repeated generations give what fresh loads give, a repeated prompt is not encoded again, a job of
another shape is planned against the loaded placement (and refused with the planner's reason where it does not
fit, before anything runs), and close() leaves nothing behind."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from pipelines import one_thread

pytest.importorskip("diffusers")

PROMPT, NEGATIVE = "a cat walks on the grass", "blurry, low quality"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from pipelines import save_catalog_pipeline

    with one_thread():
        return save_catalog_pipeline("tiny", tmp_path_factory.mktemp("pipelines") / "tiny", 3)


@pytest.fixture
def plan(cli, workdir) -> Path:
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return workdir / "plan.json"


def test_repeated_generations_equal_fresh_loads_and_reuse_the_prompt(plan, saved):
    import chunkflow

    with one_thread():
        with chunkflow.load(plan, weights=saved, device="cpu") as session:
            first = session.generate(PROMPT, negative_prompt=NEGATIVE, seed=11)
            other = session.generate("a dog runs on the beach", seed=5)
            again = session.generate(PROMPT, negative_prompt=NEGATIVE, seed=11)
            as_job = session.generate(session.job(PROMPT, negative_prompt=NEGATIVE, seed=11))  # a Job keeps its seed
            assert session.generations == 4
        with chunkflow.load(plan, weights=saved, device="cpu") as fresh:
            ref = fresh.generate(PROMPT, negative_prompt=NEGATIVE, seed=11)
            ref_other = fresh.generate("a dog runs on the beach", seed=5)
    assert torch.equal(first.latents, ref.latents) and torch.equal(again.latents, ref.latents)
    assert torch.equal(as_job.latents, ref.latents) and as_job.job.seed == 11
    assert torch.equal(other.latents, ref_other.latents)
    assert not torch.equal(first.latents, other.latents)
    assert not first.encode_cached and again.encode_cached  # the repeat ran no text encoder
    assert (first.index, other.index, again.index) == (0, 1, 2)
    assert first.output.shape == again.output.shape and first.phases.keys() == {"encode", "denoise", "decode"}
    assert first.predicted_s is None  # a CPU run: the plan's times are a GPU's


def test_a_job_of_another_shape_is_planned_against_the_loaded_placement(plan, saved):
    import chunkflow
    from chunkflow_planner.pipeline.jobs import JobError

    w = json.loads(plan.read_text())["workload"]
    with one_thread(), chunkflow.load(plan, weights=saved, device="cpu") as session:
        small = session.generate(PROMPT, seed=1, height=w["height"] // 2, width=w["width"] // 2, steps=1)
        assert small.output.shape[1:3] == (w["height"] // 2, w["width"] // 2)
        assert len(small.step_times_s) == 1
        with pytest.raises(JobError, match=r"needs .* host memory with the loaded placement.*chunkflow plan --height"):
            session.generate(PROMPT, height=4096, width=4096)
        with pytest.raises(JobError, match="divisible"):
            session.generate(PROMPT, height=w["height"] + 1)
        with pytest.raises(JobError, match="seed"):
            session.generate(PROMPT, seed=-1)
        with pytest.raises(JobError, match="takes no image"):
            session.generate(PROMPT, image="cat.png")
        assert session.generations == 1  # nothing ran for the refused ones


def test_close_leaves_nothing_behind(plan, saved):
    import chunkflow
    from chunkflow.session import SessionClosed

    with one_thread():
        session = chunkflow.load(plan, weights=saved, device="cpu")
        session.generate(PROMPT, seed=2)
        pipe = weakref.ref(session.pipe)
        handles = [weakref.ref(h) for h in session.built.handles.values()]
        blocks = weakref.ref(session.pipe.transformer.blocks[0])
        assert handles and pipe() is not None
        session.close()
        session.close()  # a second close does nothing
    gc.collect()
    assert pipe() is None and blocks() is None and all(h() is None for h in handles)
    with pytest.raises(SessionClosed, match="closed"):
        session.generate(PROMPT)
    assert "closed" in repr(session)


def test_a_step_callback_that_raises_stops_that_generation_only(plan, saved):
    import chunkflow

    class Stop(Exception):
        pass

    def stop(i, n):
        raise Stop

    with one_thread(), chunkflow.load(plan, weights=saved, device="cpu") as session:
        with pytest.raises(Stop):
            session.generate(PROMPT, seed=3, on_step=stop)
        after = session.generate(PROMPT, seed=3)
        with chunkflow.load(plan, weights=saved, device="cpu") as fresh:
            ref = fresh.generate(PROMPT, seed=3)
    assert torch.equal(after.latents, ref.latents)


def test_result_save_writes_the_model_kind(plan, saved, workdir):
    import imageio.v3 as iio

    import chunkflow

    pytest.importorskip("imageio_ffmpeg")
    with one_thread(), chunkflow.load(plan, weights=saved, device="cpu") as session:
        r = session.generate(PROMPT, seed=4)
        path = r.save(workdir / "cat.mp4")
    frames = iio.imread(path)
    assert frames.shape[0] == r.output.shape[0]


def test_a_hub_id_in_the_local_cache_loads_a_session_and_a_prompt_file(cli, plan, saved, workdir, monkeypatch):
    """The Hugging Face cache layout (snapshots/<commit>, refs/main) found by its Hub id, offline: the session and
    `run --prompts` read the same folder the saved one is, and give its latents; an id not in the cache is refused
    before anything loads."""
    import shutil

    import chunkflow
    from pipelines import as_hub_cache

    cache = workdir / "hub"
    as_hub_cache(saved, cache, "someone/tiny-wan")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with one_thread():
        with chunkflow.load(plan, weights="someone/tiny-wan", device="cpu") as session:
            hub = session.generate(PROMPT, seed=9)
        with chunkflow.load(plan, weights=saved, device="cpu") as session:
            local = session.generate(PROMPT, seed=9)
    assert torch.equal(hub.latents, local.latents)
    with pytest.raises(chunkflow.ChunkflowError, match="not in the local"):
        chunkflow.load(plan, weights="someone/not-here", device="cpu")
    Path("jobs.txt").write_text(PROMPT + "\n")
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", "someone/tiny-wan", "--device", "cpu", "--prompts", "jobs.txt",
                     "--out-dir", "clips", "--report", "r.json")
    assert result.exit_code == 0, result.output
    assert json.loads(Path("r.json").read_text())["jobs"][0]["state"] == "done"
    shutil.rmtree(cache)


def test_the_prompt_cache_sees_every_change_the_embeddings_depend_on(plan, saved):
    """issue 51: the same prompt after a change to what encodes it (a weight's data swapped, a text-encoder LoRA
    disabled, the tokenizer's padding side, another max_sequence_length through session.pipe) is encoded again and
    gives what encoding it afresh gives; put back, or unchanged, it is a cache hit with the first latents."""
    pytest.importorskip("peft")
    from collections import OrderedDict

    import chunkflow
    from diffusers.utils.peft_utils import set_adapter_layers
    from peft import LoraConfig, inject_adapter_in_model

    with one_thread(), chunkflow.load(plan, weights=saved, device="cpu") as session:
        cache, te, tok = session.built.prompts, session.pipe.text_encoder, session.pipe.tokenizer

        def fresh(call):  # the same call with nothing in the cache: the text encoder runs
            kept, cache.entries = cache.entries, OrderedDict()
            try:
                return call()
            finally:
                cache.entries = kept

        def gen():
            return session.generate(PROMPT, seed=7)

        def changed(got, *, cached=False):
            assert got.encode_cached is cached
            assert torch.equal(got.latents, fresh(gen).latents)
            return got.latents

        base = gen()
        assert not base.encode_cached
        again = gen()
        assert again.encode_cached and torch.equal(again.latents, base.latents)

        weight = te.get_input_embeddings().weight
        old = weight.data
        weight.data = old.flip(0).contiguous()  # same tensor object, same version counter: other values
        assert not torch.equal(changed(gen()), base.latents)
        weight.data = old
        assert torch.equal(changed(gen(), cached=True), base.latents)  # the first entry is valid again

        torch.manual_seed(5)
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], init_lora_weights=False), te)
        on = changed(gen())
        assert not torch.equal(on, base.latents)
        set_adapter_layers(te, enabled=False)  # what pipe.disable_lora() does to a text encoder: no tensor changes
        off = changed(gen())
        assert torch.equal(off, base.latents) and not torch.equal(off, on)
        set_adapter_layers(te, enabled=True)
        assert torch.equal(changed(gen(), cached=True), on)
        set_adapter_layers(te, enabled=False)

        tok.padding_side = "left"
        assert not torch.equal(changed(gen()), base.latents)
        tok.padding_side = "right"
        assert torch.equal(changed(gen(), cached=True), base.latents)

        def call(n):
            def run():
                hits = cache.hits
                out = session.pipe(PROMPT, height=32, width=32, num_frames=1, num_inference_steps=1,
                                   max_sequence_length=n, output_type="latent",
                                   generator=torch.Generator().manual_seed(0)).frames
                return out, cache.hits > hits
            return run

        (l8, _), (l4, hit4), (l8b, hit8b) = call(8)(), call(4)(), call(8)()
        assert not hit4 and hit8b
        assert torch.equal(l8, fresh(call(8))[0]) and torch.equal(l4, fresh(call(4))[0]) and torch.equal(l8b, l8)
        assert not torch.equal(l4, l8)

        last = gen()
        assert last.encode_cached and torch.equal(last.latents, base.latents)  # unchanged: still a hit
