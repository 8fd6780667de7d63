"""A step cache on the surfaces that generate many times from one load (issue 54): a session
(`chunkflow.load(plan, cache=...)`, and `generate(..., cache=...)` for one generation), a prompt file (`run --prompts
--cache`) and the server (`serve --cache`). Each generation gives the latents of diffusers' same cache config on the
pipeline built whole on the device, in a fresh build, bit for bit: the cache's state is reset before each generation
(one stopped between steps included) and MagCache's step count is the generation's. A bad cache is one line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from pipelines import one_thread

pytest.importorskip("diffusers")

PROMPT, OTHER = "a red fox in the snow", "a lighthouse at dusk"


@pytest.fixture
def plans(cli, workdir) -> Path:
    """The README's demo planned with its transformer streamed (7 MB), and again with a cache priced."""
    for name, extra in (("stream", ()), ("cached", ("--cache", "first-block:0.3"))):
        result = cli("plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--out", f"{name}.json",
                     *extra)
        assert result.exit_code == 0, result.output
    placements = {c["name"]: c["placement"] for c in json.loads((workdir / "stream.json").read_text())["pipeline"]
                  ["components"]}
    assert placements["transformer"] == "stream"
    return workdir


def _config(spec: str, steps: int):
    """diffusers' own config for the few specs the tests use."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    kind, _, threshold = spec.partition(":")
    if kind == "first-block":
        return FirstBlockCacheConfig(threshold=float(threshold))
    return MagCacheConfig(threshold=float(threshold.split(",")[0]), num_inference_steps=steps,
                          mag_ratios=FLUX_MAG_RATIOS)


def reference(spec: str | None, prompt: str, seed: int, steps: int) -> torch.Tensor:
    """The demo pipeline (random weights, build seed 0) whole on the CPU, no offload, diffusers' cache config
    enabled on a fresh build: one generation's latents."""
    return generation(spec, prompt, seed, steps).latents


@functools.cache
def generation(spec: str | None, prompt: str, seed: int, steps: int):
    """reference()'s generation (chunkflow.generate.Generation: its output and latents)."""
    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig

    model = get_model("demo")
    with one_thread():
        built = build_pipeline(model, {"transformer": "gpu"}, OffloadConfig(mode="none"), torch.device("cpu"),
                               seed=0)
        if spec is not None:
            built.pipe.transformer.enable_cache(_config(spec, steps))
        gen = generate(built, model.default_workload, prompt, steps=steps, seed=seed)
    built.remove()
    return gen


class _Stop(Exception):
    pass


def _stop_at(k: int):
    def on_step(i: int, n: int) -> None:
        if i >= k:
            raise _Stop

    return on_step


# ----------------------------------------------------------------------------------------------------- sessions


def test_each_generation_of_a_session_gives_a_fresh_process_s_latents_with_the_same_cache(plans):
    import chunkflow

    spec = "first-block:0.3"
    with one_thread(), chunkflow.load(plans / "stream.json", device="cpu", cache=spec) as session:
        first = session.generate(PROMPT, seed=1, steps=8)
        other = session.generate(OTHER, seed=2, steps=8)
        with pytest.raises(_Stop):  # stopped after its third step: the cache's state is left mid-generation
            session.generate(OTHER, seed=3, steps=8, on_step=_stop_at(3))
        again = session.generate(PROMPT, seed=1, steps=8)
        stats = session.built.handles["transformer"].stats()
    assert torch.equal(first.latents, reference(spec, PROMPT, 1, 8))
    assert torch.equal(other.latents, reference(spec, OTHER, 2, 8))
    assert torch.equal(again.latents, first.latents)
    assert not torch.equal(first.latents, reference(None, PROMPT, 1, 8))  # the cache changed the sample
    c = first.cache
    assert c.label == "first-block:threshold=0.3" and c.forwards == 16  # 8 steps, 2 guidance passes
    assert c.blocks_skipped > 0 and c.blocks_computed + c.blocks_skipped == 16 * 4
    assert again.cache.skipped_per_forward == c.skipped_per_forward  # the same skips as the first time
    assert c.skipped_h2d_bytes > 0  # streamed: what the prefetch copied for the skipped blocks, counted
    # the runtime counted the stopped generation's skips too (its first steps ran), and no more
    assert stats.blocks_skipped >= sum(r.cache.blocks_skipped for r in (first, other, again))


def test_magcache_counts_each_generation_s_own_steps_from_its_first(plans):
    import chunkflow
    from chunkflow_planner.pipeline.jobs import JobError

    spec = "mag:0.5,ratios=flux"
    with one_thread(), chunkflow.load(plans / "stream.json", device="cpu", cache=spec) as session:
        eight = session.generate(PROMPT, seed=1, steps=8)
        six = session.generate(PROMPT, seed=1, steps=6)
        with pytest.raises(_Stop):  # stopped after its third step: MagCache's step counter is left at 3
            session.generate(PROMPT, seed=1, steps=8, on_step=_stop_at(3))
        eight_again = session.generate(PROMPT, seed=1, steps=8)
        with pytest.raises(JobError, match=r"cache mag:threshold=0.5,ratios=flux: with 1 steps? .* would change "
                                           "nothing; run more steps, or without it"):
            session.generate(PROMPT, seed=1, steps=1)  # refused before it runs: one step has nothing to skip
        assert session.generations == 4
        assert session.fit(session.job(PROMPT, steps=1), cache=None).reason is None
    assert torch.equal(eight.latents, reference(spec, PROMPT, 1, 8))
    assert torch.equal(six.latents, reference(spec, PROMPT, 1, 6))
    assert torch.equal(eight_again.latents, eight.latents)
    assert six.cache.forwards == 12 and eight.cache.forwards == 16
    assert six.cache.blocks_skipped > 0 and eight.cache.blocks_skipped > 0


def test_a_generation_may_run_another_cache_or_none(plans):
    import chunkflow
    from chunkflow_planner.cache import CacheSpecError

    with one_thread(), chunkflow.load(plans / "cached.json", device="cpu") as session:
        assert session.cache is not None and session.cache.kind == "first-block"  # the plan's cache by default
        planned = session.generate(PROMPT, seed=1, steps=8)
        plain = session.generate(PROMPT, seed=1, steps=8, cache=None)
        mag = session.generate(PROMPT, seed=1, steps=8, cache="mag:0.5,ratios=flux")
        with pytest.raises(CacheSpecError) as bad:
            session.generate(PROMPT, seed=1, steps=8, cache="first:1")
        back = session.generate(PROMPT, seed=1, steps=8)
        assert session.generations == 4  # nothing ran for the refused one
    assert torch.equal(planned.latents, reference("first-block:0.3", PROMPT, 1, 8))
    assert torch.equal(plain.latents, reference(None, PROMPT, 1, 8)) and plain.cache is None
    assert torch.equal(mag.latents, reference("mag:0.5,ratios=flux", PROMPT, 1, 8))
    assert torch.equal(back.latents, planned.latents)
    assert "unknown cache 'first'" in str(bad.value) and "\n" not in str(bad.value)


def test_a_bad_cache_is_refused_before_the_load(plans, monkeypatch):
    import chunkflow
    import chunkflow.pipeline_setup as ps
    from chunkflow_planner.cache import CacheSpecError

    monkeypatch.setattr(ps, "setup_pipeline", lambda *a, **k: pytest.fail("loaded"))
    for spec, words in (("mag", "mag needs the model's magnitude ratios"),
                        ("taylorseer", "it hooks no module of transformer")):
        with pytest.raises(CacheSpecError, match=words):
            chunkflow.load(plans / "stream.json", device="cpu", cache=spec)


def test_the_plan_s_cache_is_the_default_and_none_turns_it_off(plans):
    from chunkflow.caches import resolve_cache
    from chunkflow_planner.cache import FirstBlockCache, parse_cache
    from chunkflow_planner.plan import load_plan

    cached, plain = load_plan(plans / "cached.json"), load_plan(plans / "stream.json")
    assert resolve_cache("plan", cached) == FirstBlockCache(threshold=0.3)
    assert resolve_cache("plan", plain) is None and resolve_cache(None, cached) is None
    assert resolve_cache("sea:0.3", cached) == parse_cache("sea:0.3")


def frames_of(path: Path):
    from chunkflow.media import read_video

    return read_video(path)


def reference_frames(spec: str | None, prompt: str, seed: int, steps: int, where: Path):
    """reference()'s output as a video file, read back (what a job's output is compared with)."""
    from chunkflow.media import write_media
    from chunkflow_planner.catalog import get_model

    path = where / f"ref-{seed}-{steps}-{(spec or 'none').replace(':', '_')}.mp4"
    write_media(str(path), generation(spec, prompt, seed, steps).output, fps=get_model("demo").pipeline.fps or 16)
    return frames_of(path)


# ------------------------------------------------------------------------------------------------- prompt files


def test_every_job_of_a_prompt_file_runs_with_the_cache_and_says_its_skips(cli, plans):
    import numpy as np

    Path("jobs.jsonl").write_text(f'{{"prompt": "{PROMPT}", "seed": 1, "steps": 8}}\n'
                                  f'{{"prompt": "{OTHER}", "seed": 2, "steps": 8}}\n')
    with one_thread():
        result = cli("run", "--plan", "stream.json", "--device", "cpu", "--prompts", "jobs.jsonl", "--cache",
                     "first-block:0.3", "--out-dir", "clips", "--report", "jobs.json")
        assert result.exit_code == 0, result.output
        planned = cli("run", "--plan", "cached.json", "--device", "cpu", "--prompts", "jobs.jsonl", "--out-dir",
                      "planned", "--report", "planned.json")  # the plan's cache, no --cache
        assert planned.exit_code == 0, planned.output
    jobs = json.loads(Path("jobs.json").read_text())["jobs"]
    assert [j["state"] for j in jobs] == ["done", "done"]
    for j, (prompt, seed) in zip(jobs, ((PROMPT, 1), (OTHER, 2))):
        np.testing.assert_array_equal(frames_of(Path("clips") / j["out"]),
                                      reference_frames("first-block:0.3", prompt, seed, 8, plans))
        c = j["cache"]
        assert c["label"] == "first-block:threshold=0.3" and c["forwards"] == 16
        assert c["blocks_skipped"] > 0 and c["blocks_computed"] + c["blocks_skipped"] == 16 * 4
        words = f"line {j['line']}: cache first-block:threshold=0.3: {c['blocks_skipped']} of 64 block runs skipped"
        assert words in " ".join(result.output.split())
    again = json.loads(Path("planned.json").read_text())["jobs"]
    assert [j["cache"] for j in again] == [j["cache"] for j in jobs]
    for j in jobs:
        np.testing.assert_array_equal(frames_of(Path("planned") / j["out"]), frames_of(Path("clips") / j["out"]))


def test_a_bad_cache_with_a_prompt_file_is_one_line_before_the_load(cli, plans):
    Path("p.txt").write_text("a cat\n")
    for spec, words in (("first:1", "unknown cache 'first'"), ("taylorseer", "it hooks no module of transformer")):
        result = cli("run", "--plan", "stream.json", "--prompts", "p.txt", "--cache", spec, "--out-dir", "o")
        assert result.exit_code == 2, result.output
        assert words in " ".join(result.output.split()) and "built the" not in result.output
        assert "Traceback" not in result.output and not Path("o").exists()


# ------------------------------------------------------------------------------------------------------ the server

SERVED = "mag:0.5,ratios=flux"  # MagCache counts steps: a job cancelled mid-way leaves its counter behind


def test_the_server_s_jobs_run_with_its_cache_and_say_their_skips(plans):
    import numpy as np

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import chunkflow
    from chunkflow.serve.app import make_app
    from chunkflow.serve.queue import JobQueue
    from test_serve import call, finished, serve_app

    class Served:
        url = ""

    stop_at: dict[str, int] = {}

    def observe(job_id: str, i: int, n: int) -> None:
        if stop_at.get(job_id) == i:
            queue.cancel(job_id)  # stops after this step

    with one_thread():
        session = chunkflow.load(plans / "stream.json", device="cpu", cache=SERVED)
        queue = JobQueue(session, plans / "served", observer=observe, paused=True)
        port, server, thread = serve_app(make_app(queue))
        try:
            s = Served()
            s.url = f"http://127.0.0.1:{port}"
            status, health, _ = call(s, "GET", "/health")
            assert health["cache"] == "mag:threshold=0.5,ratios=flux"
            status, body, _ = call(s, "POST", "/jobs", {"prompt": PROMPT, "cache": "first-block:0.1"})
            assert status == 422 and body["fields"] == ["cache"] and "serve --cache" in body["error"]
            status, body, _ = call(s, "POST", "/jobs", {"prompt": PROMPT, "steps": 1})  # nothing to skip: refused
            assert status == 422 and "so it would change nothing" in body["error"]
            jobs = [{"prompt": PROMPT, "seed": 1, "steps": 8}] * 2 + [{"prompt": OTHER, "seed": 2, "steps": 8}]
            ids = [call(s, "POST", "/jobs", job)[1]["id"] for job in jobs]
            stop_at[ids[0]] = 3
            queue.resume()
            snaps = [finished(s, i) for i in ids]
            assert [x["state"] for x in snaps] == ["cancelled", "done", "done"]
            frames = [call(s, "GET", x["result_url"])[1] for x in snaps[1:]]
        finally:
            server.should_exit = True
            thread.join(60)
            queue.shutdown(60)
    for (job, snap, content) in zip(jobs[1:], snaps[1:], frames):
        got = plans / f"got-{snap['id']}.mp4"
        got.write_bytes(content)
        np.testing.assert_array_equal(frames_of(got), reference_frames(SERVED, job["prompt"], job["seed"], 8, plans))
        c = snap["cache"]
        assert snap["settings"]["cache"] == c["label"] == "mag:threshold=0.5,ratios=flux"
        assert c["forwards"] == 16 and 0 < c["blocks_skipped"] < 64
    assert snaps[0]["cache"] is None  # cancelled: no result, no count


def test_serve_refuses_a_bad_cache_in_one_line_before_the_load(cli, plans):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    for spec, words in (("first:1", "unknown cache 'first'"), ("taylorseer", "it hooks no module of transformer")):
        result = cli("serve", "--plan", "stream.json", "--cache", spec, "--out-dir", "o")
        assert result.exit_code == 2, result.output
        assert words in " ".join(result.output.split()) and "Traceback" not in result.output
        assert "built the" not in result.output and "Serving" not in result.output
