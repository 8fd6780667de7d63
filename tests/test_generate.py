"""`chunkflow run --prompt`: whole tiny pipelines (Wan and FLUX) saved with save_pretrained, generated through the CLI
with every placement, give the latents diffusers' own pipeline gives with the same seed; videos and images are
written and readable; a Hub id resolves from a local Hugging Face cache."""

from __future__ import annotations

import json
import statistics
import shutil
from pathlib import Path

import pytest
import torch

from pipelines import one_thread

pytest.importorskip("imageio_ffmpeg")

PROMPTS = {"tiny": ("a cat walks on the grass", "blurry, low quality"), "tiny-flux": ("a red fox in the snow", None)}


def _save_pipeline(name: str, folder: Path, seed: int = 3) -> Path:
    """The catalog's tiny pipeline with random weights, saved as a diffusers pipeline folder."""
    from pipelines import save_catalog_pipeline

    return save_catalog_pipeline(name, folder, seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    with one_thread():
        return {n: _save_pipeline(n, root / n) for n in PROMPTS}


def _reference_latents(name: str, folder: Path, seed: int, steps: int) -> torch.Tensor:
    """diffusers alone: from_pretrained in the dtypes chunkflow runs (bf16; the Wan VAE in fp32), the same call."""
    import diffusers

    from chunkflow_planner.catalog import get_model

    spec = get_model(name)
    cls = getattr(diffusers, spec.pipeline.cls)
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = cls.from_pretrained(folder, torch_dtype=dtypes)
    pipe.set_progress_bar_config(disable=True)
    prompt, negative = PROMPTS[name]
    w = spec.default_workload
    kw = dict(prompt=prompt, height=w.height, width=w.width, num_inference_steps=steps,
              generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")
    if spec.pipeline.adapter == "wan":
        kw.update(negative_prompt=negative, num_frames=w.frames, guidance_scale=spec.pipeline.guidance,
                  max_sequence_length=spec.pipeline.text_encoders[0].tokens)
    else:
        kw.update(guidance_scale=spec.pipeline.guidance, max_sequence_length=spec.pipeline.text_encoders[-1].tokens)
    with torch.no_grad(), one_thread():
        out = pipe(**kw)
    return out.frames if hasattr(out, "frames") else out.images


def _plan(cli, name: str, placements: dict[str, str] | None = None) -> Path:
    result = cli("plan", "--model", name, "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    path = Path("plan.json")
    if placements:
        plan = json.loads(path.read_text())
        for c in plan["pipeline"]["components"]:
            c["placement"] = placements.get(c["kind"], c["placement"])
        path.write_text(json.dumps(plan))
    return path


PLACEMENTS = [  # (text encoders, transformer, run flags for the transformer)
    ("gpu", "gpu", []),
    ("phase", "stream", ["--mode", "chunkflow", "--chunk-size", "16KB", "--residency", "0.3"]),
    ("stream", "phase", []),
    ("cpu", "stream", ["--mode", "layerwise"]),
]


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("text, transformer, flags", PLACEMENTS, ids=[f"te-{t}-tr-{r}" for t, r, _ in PLACEMENTS])
def test_latents_identical_to_diffusers(cli, workdir, saved, name, text, transformer, flags):
    from safetensors.torch import load_file

    plan = _plan(cli, name, {"text_encoder": text, "transformer": transformer})
    prompt, negative = PROMPTS[name]
    args = ["run", "--plan", plan, "--weights", saved[name], "--prompt", prompt, "--seed", "11", "--latents",
            "latents.safetensors", "--report", "report.json", *flags]
    if negative:
        args += ["--negative-prompt", negative]
    with one_thread():
        result = cli(*args)
    assert result.exit_code == 0, result.output
    ours = load_file("latents.safetensors")["latents"]
    ref = _reference_latents(name, saved[name], 11, 2)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    rep = json.loads(Path("report.json").read_text())
    gen = rep["generation"]
    assert set(gen["phases"]) == {"encode", "denoise", "decode"}
    assert all(p["measured_time_s"] > 0 for p in gen["phases"].values())
    placed = gen["components"]
    assert placed["transformer"] == transformer and placed["text_encoder"] == text
    assert rep["measured"]["step_times_s"] and len(rep["measured"]["step_times_s"]) == 2
    assert gen["host_peak_bytes"] > 0
    # the steps' allocation held the whole pipeline's tensors: each phase's peak is compared, not the transformer's
    assert rep["rel_error"]["peak_memory"] is None
    # on the CPU the plan's times are not compared (they are a GPU's); host memory is: the CPU's 'device' is host
    assert gen["predicted_generation_time_s"] is None and gen["predicted_host_memory_bytes"] > 0


def test_video_and_image_are_written_and_readable(cli, workdir, saved):
    from chunkflow.media import read_image, read_video
    from chunkflow_planner.catalog import get_model

    wan, flux = get_model("tiny"), get_model("tiny-flux")
    plan = _plan(cli, "tiny")
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", saved["tiny"], "--prompt", "a cat", "--out", "cat.mp4")
    assert result.exit_code == 0, result.output
    video = read_video("cat.mp4")
    w = wan.default_workload
    assert video.shape == (w.frames, w.height, w.width, 3)
    plan = _plan(cli, "tiny-flux")
    with one_thread():
        result = cli("run", "--plan", plan, "--prompt", "a red fox", "--out", "fox.png")  # random weights
    assert result.exit_code == 0, result.output
    w = flux.default_workload
    assert read_image("fox.png").shape == (w.height, w.width, 3)
    assert "encode" in result.output and "decode" in result.output


def test_hub_id_resolves_from_the_local_cache(cli, workdir, saved, monkeypatch):
    cache = workdir / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--someone--tiny-wan"
    shutil.copytree(saved["tiny"], repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plan = _plan(cli, "tiny")
    with one_thread():
        ok = cli("run", "--plan", plan, "--weights", "someone/tiny-wan", "--prompt", "a cat", "--latents", "a.safetensors")
    assert ok.exit_code == 0, ok.output
    missing = cli("run", "--plan", plan, "--weights", "someone/not-here", "--prompt", "a cat")
    assert missing.exit_code == 2
    assert "not in the local" in missing.output and str(cache) in missing.output.replace("\n", "")


@pytest.mark.parametrize("args, message", [
    (["--out", "x.gif"], ".mp4"),
    (["--out", "missing/x.mp4"], "does not exist"),
    (["--guidance", "nan"], "--guidance"),
    (["--weights", "/no/such/folder"], "/no/such/folder"),
])
def test_bad_generation_flags_fail_before_any_work(cli, workdir, args, message):
    plan = _plan(cli, "tiny")
    result = cli("run", "--plan", plan, "--prompt", "a cat", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", "")


def test_generation_flags_need_a_prompt(cli, workdir):
    plan = _plan(cli, "tiny")
    result = cli("run", "--plan", plan, "--out", "x.mp4")
    assert result.exit_code == 2 and "--prompt" in result.output


def test_batched_cfg_generation_matches_diffusers_within_tolerance(cli, workdir, saved):
    """`run --prompt --cfg-batched`: both guidance passes in one forward a step; the latents match diffusers' own
    (unbatched) pipeline within the tolerance docs/levers.md states for bf16."""
    from safetensors.torch import load_file

    plan = _plan(cli, "tiny", {"transformer": "stream"})
    prompt, negative = PROMPTS["tiny"]
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", saved["tiny"], "--prompt", prompt, "--negative-prompt",
                     negative, "--seed", "11", "--latents", "latents.safetensors", "--report", "report.json",
                     "--mode", "chunkflow", "--chunk-size", "16KB", "--cfg-batched")
    assert result.exit_code == 0, result.output
    ours = load_file("latents.safetensors")["latents"].float()
    ref = _reference_latents("tiny", saved["tiny"], 11, 2).float()
    rep = json.loads(Path("report.json").read_text())
    assert rep["run"]["offload"]["cfg_batched"] is True
    assert rep["stats"]["forwards"] == 2  # two steps, one forward each
    assert (ours - ref).abs().max() <= 2e-2 * ref.abs().max()


def _tiny_generation(cli, saved) -> tuple[Path, list]:
    """A plan for the tiny pipeline and the `chunkflow run` arguments that generate from its saved weights."""
    plan = _plan(cli, "tiny")
    prompt, negative = PROMPTS["tiny"]
    return plan, ["run", "--plan", plan, "--weights", saved["tiny"], "--prompt", prompt, "--negative-prompt", negative,
                  "--seed", "5"]


def test_warmup_generations_leave_the_result_alone_and_measure_the_startup(cli, workdir, saved):
    """`--warmup 1` runs a whole generation first: the measured one gives the same latents, the report keeps the
    first one's phase times, and `calibrate --from-report` turns first-less-later into the profile's start-up."""
    from safetensors.torch import load_file

    from chunkflow.commands.calibrate.refit import read_reports, refit
    from chunkflow_planner.catalog import get_hardware

    plan, base = _tiny_generation(cli, saved)
    with one_thread():
        cold = cli(*base, "--latents", "cold.safetensors", "--report", "cold.json")
        warm = cli(*base, "--warmup", "1", "--latents", "warm.safetensors", "--report", "warm.json")
    assert cold.exit_code == 0 and warm.exit_code == 0, cold.output + warm.output
    assert torch.equal(load_file("cold.safetensors")["latents"], load_file("warm.safetensors")["latents"])
    g_cold = json.loads(Path("cold.json").read_text())["generation"]
    data = json.loads(Path("warm.json").read_text())
    g = data["generation"]
    assert g_cold["warmup_generations"] == 0 and g_cold["first_phase_times_s"] is None
    assert g["warmup_generations"] == 1 and data["run"]["warmup"] == 1
    assert set(g["first_phase_times_s"]) == {"encode", "denoise", "decode"}
    assert "first generation:" in warm.output and "warm-up generation(s)" in " ".join(warm.output.split())
    # made to look measured on a GPU with known gaps: the refit finds them (median over reports, never negative)
    data["gpu"], data["run"]["device"] = "NVIDIA H200", "cuda:0"
    gaps = {"encode": 0.42, "denoise": 0.3, "decode": -0.1}
    for name, gap in gaps.items():
        g["first_phase_times_s"][name] = g["phases"][name]["measured_time_s"] + gap
    Path("warm.json").write_text(json.dumps(data))
    new, notes = refit(get_hardware("cpu"), read_reports(["warm.json"]))  # the profile the plan was made with
    assert new.pipeline.startup_s == pytest.approx({"encode": 0.42, "denoise": 0.3, "decode": 0.0,
                                           "encode:umt5_encoder": 0.42})  # and per set of text encoders
    kept = get_hardware("cpu").model_copy(update={"startup_s": {"encode:qwen2_5_vl": 2.0, "encode": 9.0}})
    merged, _ = refit(kept, read_reports(["warm.json"]))  # what these reports do not measure stays
    assert merged.pipeline.startup_s["encode:qwen2_5_vl"] == 2.0 and merged.pipeline.startup_s["encode"] == pytest.approx(0.42)
    assert any("start-up" in n for n in notes)


def test_repeat_measures_several_generations_and_reports_their_median(cli, workdir, saved):
    """`--repeat 3` measures three generations after the warm-up: each phase's time is the median of its three
    times (all kept), the generation's the median of their totals, the latents those of any one of them (the same
    seed), and the table shows the spread. --repeat without --prompt, or below 1, is refused."""
    from safetensors.torch import load_file

    plan, base = _tiny_generation(cli, saved)
    with one_thread():
        one = cli(*base, "--latents", "one.safetensors", "--report", "one.json")
        many = cli(*base, "--warmup", "1", "--repeat", "3", "--latents", "many.safetensors", "--report", "many.json")
    assert one.exit_code == 0 and many.exit_code == 0, one.output + many.output
    assert torch.equal(load_file("one.safetensors")["latents"], load_file("many.safetensors")["latents"])
    data = json.loads(Path("many.json").read_text())
    g = data["generation"]
    assert g["measured_generations"] == 3 and g["warmup_generations"] == 1 and len(g["generation_times_s"]) == 3
    for ph in g["phases"].values():
        assert len(ph["measured_times_s"]) == 3
        assert ph["measured_time_s"] == pytest.approx(statistics.median(ph["measured_times_s"]))
    totals = [sum(ph["measured_times_s"][i] for ph in g["phases"].values()) for i in range(3)]
    assert g["generation_times_s"] == pytest.approx(totals)
    assert g["generation_time_s"] == pytest.approx(statistics.median(totals))
    assert data["stats"]["forwards"] == 3 * json.loads(Path("one.json").read_text())["stats"]["forwards"]
    assert "median of 3 generations" in " ".join(many.output.split()) and "spread" in many.output
    assert all(len(ph["gc_s"]) == 3 and min(ph["gc_s"]) >= 0 for ph in g["phases"].values())
    for ph in g["phases"].values():  # each generation's longest collection, within its time in the collector
        assert len(ph["gc_longest"]) == 3
        assert all(c is None or 0 <= c["seconds"] <= s + 1e-9 for c, s in zip(ph["gc_longest"], ph["gc_s"]))
    # run's output names the longest collection once it matters: its phase, generation and what it freed
    from rich.console import Console

    from chunkflow.commands.plan_tables import print_generation
    from chunkflow.reports import load_reports

    ph = g["phases"]["denoise"]
    ph["gc_s"][1], ph["gc_longest"][1] = 0.334, {"seconds": 0.33, "generation": 2, "collected": 17}
    Path("gc-long.json").write_text(json.dumps(data))
    console = Console(record=True, width=120)
    print_generation(console, load_reports(["gc-long.json"])[0])
    said = " ".join(console.export_text().split())
    assert "its longest collection: 330.0 ms in denoise, generation 2 (full), 17 objects freed" in said
    assert json.loads(Path("one.json").read_text())["generation"]["measured_generations"] == 1
    bad = cli("run", "--plan", plan, "--repeat", "2", "--device", "cpu")
    assert bad.exit_code == 2 and "needs --prompt" in " ".join(bad.output.split()) and "Traceback" not in bad.output
    zero = cli(*base, "--repeat", "0")
    assert zero.exit_code != 0 and "--repeat must be at least 1" in " ".join(zero.output.split())
    assert "Traceback" not in zero.output
    cold = cli(*base, "--repeat", "2", "--warmup", "0")  # a first generation's start-up is not a repeat
    assert cold.exit_code != 0 and "--warmup 1" in " ".join(cold.output.split()) and "Traceback" not in cold.output
    with one_thread():
        implied = cli(*base, "--repeat", "2", "--steps", "1", "--report", "implied.json")
    assert implied.exit_code == 0, implied.output
    g2 = json.loads(Path("implied.json").read_text())["generation"]
    assert g2["warmup_generations"] == 1 and g2["measured_generations"] == 2 and g2["first_phase_times_s"]


def test_garbage_collection_is_counted_in_its_phase_and_the_run_leaves_gc_as_it_was(cli, workdir, saved):
    """A collection forced after a denoising step is counted in denoise's gc_s (and not in encode's); generate()
    leaves gc.callbacks as they were; `chunkflow run --prompt` freezes the built pipeline's objects for its
    generations and unfreezes them after."""
    import gc

    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.workload import make_workload

    spec = get_model("tiny")
    everything = {n: "gpu" for n in ("text_encoder", "transformer", "vae")}
    callbacks = list(gc.callbacks)
    with one_thread():
        built = build_pipeline(spec, everything, OffloadConfig("none"), torch.device("cpu"), weights=saved["tiny"])
        try:
            def collect(i, n):
                for _ in range(3):
                    gc.collect()

            gen = generate(built, make_workload(spec, steps=2), PROMPTS["tiny"][0], steps=2, on_step=collect)
        finally:
            built.remove()
    assert gen.phases["denoise"].gc_s > 0 and gen.phases["denoise"].gc_s < gen.phases["denoise"].time_s
    assert gen.phases["encode"].gc_s < gen.phases["denoise"].gc_s
    longest = gen.phases["denoise"].gc_longest  # the longest: one of the full ones forced
    seconds, generation, freed = longest.seconds, longest.generation, longest.collected
    assert generation == 2 and 0 < seconds <= gen.phases["denoise"].gc_s and freed >= 0
    assert gc.callbacks == callbacks
    frozen = gc.get_freeze_count()
    plan = _plan(cli, "tiny")
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", saved["tiny"], "--prompt", "a cat", "--steps", "2",
                     "--report", "gc.json")
    assert result.exit_code == 0, result.output
    assert gc.get_freeze_count() == frozen and gc.callbacks == callbacks
    # with --repeat, what each generation leaves alive is frozen too before the next, all of it unfrozen after
    import chunkflow.generate as generation

    counts, left, real = [], [], generation.generate

    class LeftAlive:  # what a generation leaves alive: one object made at its end, tracked by the collector
        pass

    def counting(*args, **kwargs):
        counts.append(gc.get_freeze_count())
        tracked = {id(o) for o in gc.get_objects()}  # frozen objects are not the collector's to scan
        counts.append([id(o) in tracked for o in left])
        out = real(*args, **kwargs)
        left.append(LeftAlive())
        return out

    generation.generate = counting
    try:
        with one_thread():
            result = cli("run", "--plan", plan, "--weights", saved["tiny"], "--prompt", "a cat", "--steps", "1",
                         "--repeat", "2", "--report", "gc2.json")
    finally:
        generation.generate = real
    assert result.exit_code == 0, result.output
    assert len(counts) == 6 and counts[0] > frozen
    assert counts[1] == [] and counts[3] == [False] and counts[5] == [False, False]  # each frozen before the next
    assert gc.get_freeze_count() == frozen


def test_encode_is_accounted_per_text_encoder(cli, workdir, saved, monkeypatch):
    """Each text encoder's forwards are timed inside encode (both of Wan's guidance prompts in one sum), a parked
    one's move to the device apart, the rest of the phase is host work: on a clock that the text encoder's forward
    moves 0.05 s (and every reading 1 us), those 0.1 s land in its part (prompt and negative prompt), not in the
    move or the rest; the report keeps every generation's parts and the plan says what it expects of each."""
    import types

    import chunkflow.generate as generation
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig
    from chunkflow_planner.workload import make_workload

    clock = types.SimpleNamespace(t=0.0)

    def perf_counter() -> float:
        clock.t += 1e-6
        return clock.t

    monkeypatch.setattr(generation, "time", types.SimpleNamespace(perf_counter=perf_counter))
    spec = get_model("tiny")
    placements = {"text_encoder": "phase", "transformer": "gpu", "vae": "gpu"}
    with one_thread():
        built = build_pipeline(spec, placements, OffloadConfig("none"), torch.device("cpu"), weights=saved["tiny"])
        slow = built.pipe.text_encoder.register_forward_pre_hook(lambda m, a: setattr(clock, "t", clock.t + 0.05))
        try:
            gen = generation.generate(built, make_workload(spec, steps=1), PROMPTS["tiny"][0],
                                      negative=PROMPTS["tiny"][1], steps=1)
        finally:
            slow.remove()
            built.remove()
    enc = gen.phases["encode"]
    assert set(enc.parts_s) == {"text_encoder", "text_encoder to device"}  # placed `phase`: parked before encode
    assert enc.parts_s["text_encoder"] == pytest.approx(0.1, abs=1e-3)  # both forwards' 0.05 s
    assert 0 < enc.parts_s["text_encoder to device"] < 1e-3  # the move, on its own: none of the forwards' time
    assert 0 < enc.time_s - sum(enc.parts_s.values()) < 1e-3  # nor in the rest
    assert not gen.phases["denoise"].parts_s and not gen.phases["decode"].parts_s

    plan, base = _tiny_generation(cli, saved)
    encode = json.loads(Path(plan).read_text())["prediction"]["phases"]["encode"]
    assert {"text_encoder", "host", "startup"} <= set(encode["parts_s"])
    assert sum(encode["parts_s"].values()) == pytest.approx(encode["time_s"])
    with one_thread():
        result = cli(*base, "--warmup", "1", "--repeat", "2", "--steps", "1", "--report", "parts.json")
    assert result.exit_code == 0, result.output
    assert "encode: text_encoder" in " ".join(result.output.split()) and "the rest" in result.output
    phases = json.loads(Path("parts.json").read_text())["generation"]["phases"]
    parts = phases["encode"]["parts_s"]["text_encoder"]
    assert len(parts) == 2 and all(0 < p < t for p, t in zip(parts, phases["encode"]["measured_times_s"]))


def test_refit_measures_the_host_and_allocator_terms_of_the_phases(cli, workdir):
    """Generation reports made to look measured on a GPU with known host time in encode (outside the text
    encoder's timed forwards, and inside them a known multiple of what calibrate timed), a known postprocessing
    rate in decode and a known allocator slack: `calibrate --from-report` finds all four, and a plan with the refit
    profile predicts those reports' phases."""
    from chunkflow.commands.calibrate.refit import generation_estimate, read_reports, refit
    from chunkflow_planner.catalog import get_hardware, get_model
    from chunkflow_planner.pipeline import output_bytes, text_device_s

    plan = _plan(cli, "tiny")
    with one_thread():
        result = cli("run", "--plan", plan, "--prompt", "a cat", "--report", "r.json")
    assert result.exit_code == 0, result.output
    spec = get_model("tiny")
    te = spec.pipeline.text_encoders[0]
    hw = get_hardware("cpu").model_copy(update={"text_layer_host_us": {te.arch: 20000.0}})  # as calibrate timed it
    data = json.loads(Path("r.json").read_text())
    data["gpu"], data["run"]["device"] = "NVIDIA H200", "cuda:0"
    data["generation"]["components"][te.component] = "gpu"  # as if kept on the GPU (bound by the host)
    for c in data["plan"]["pipeline"]["components"]:
        c["placement"] = "gpu" if c["name"] == te.component else c["placement"]
    Path("r.json").write_text(json.dumps(data))
    base = hw.model_copy(update={"postprocess_gbps": 1e4, "encode_host_s": 0.0, "alloc_slack": 0.0})
    e, w = generation_estimate(read_reports(["r.json"])[0], base)
    truth = {"encode_host_s": 0.04, "postprocess_gbps": 0.5, "alloc_slack": 0.3, "host_margin": 2.0}
    assert w.cfg_passes == 2  # the prompt and the negative prompt: two forwards of the encoder per generation
    calibrated = 2 * te.shape()["layers"] * 20000e-6
    assert e.phases["encode"].detail[te.component] == pytest.approx(calibrated)  # bound by the host: the device
    assert calibrated > 10 * w.cfg_passes * text_device_s(te, hw)  # takes far less (eta_comp refit or not)
    forwards = truth["host_margin"] * calibrated
    for name, ph in data["generation"]["phases"].items():
        t = e.phases[name].time_s
        if name == "encode":  # three generations: timed forwards and host work outside them that move apart
            each = [forwards * 0.95, forwards, forwards * 1.05]
            rest = [truth["encode_host_s"] + d for d in (0.02, 0.0, -0.01)]  # the medians: forwards, the truth
            ph["parts_s"] = {te.component: each}
            ph["measured_times_s"] = [f + r + e.phases[name].startup_s for f, r in zip(each, rest)]
            t = statistics.median(ph["measured_times_s"])
        else:
            t += output_bytes(w) / 0.5e9 - output_bytes(w) / 1e13 if name == "decode" else 0.0
            ph["measured_times_s"] = [t, t, t]
        ph["measured_time_s"] = t
        ph["measured_peak_allocated_bytes"] = int(e.phases[name].allocated_bytes)
        ph["measured_peak_memory_bytes"] = int(e.phases[name].allocated_bytes + hw.context_bytes
                                               + truth["alloc_slack"] * e.phases[name].activation_bytes)
    # a process's first generation with no start-up known: its times hold the start-up, so they are not used
    Path("r.json").write_text(json.dumps(data))
    cold, notes = refit(hw, read_reports(["r.json"]))
    assert cold.pipeline.encode_host_s == hw.pipeline.encode_host_s and cold.pipeline.postprocess_gbps == hw.pipeline.postprocess_gbps
    assert cold.pipeline.host_margin == hw.pipeline.host_margin
    assert cold.alloc_slack == pytest.approx(truth["alloc_slack"], rel=1e-3)
    assert any("without --warmup" in n for n in notes)
    # run with a warm-up generation (its first generation no slower here): all four are measured
    g = data["generation"]
    g["warmup_generations"] = 1
    g["first_phase_times_s"] = {name: ph["measured_time_s"] for name, ph in g["phases"].items()}
    Path("r.json").write_text(json.dumps(data))
    new, notes = refit(hw, read_reports(["r.json"]))
    for k, v in truth.items():
        assert new.figure(k) == pytest.approx(v, rel=1e-3), k
    # a profile where calibrate did not time the encoder's architecture: no dispatch to compare with, kept
    untimed, _ = refit(hw.model_copy(update={"text_layer_host_us": {}}), read_reports(["r.json"]))
    assert untimed.pipeline.host_margin == hw.pipeline.host_margin and untimed.pipeline.encode_host_s == pytest.approx(truth["encode_host_s"])
    e2, _ = generation_estimate(read_reports(["r.json"])[0], new)  # (denoise: eta_comp is refit from this run too)
    for name in ("encode", "decode"):
        assert e2.phases[name].time_s == pytest.approx(data["generation"]["phases"][name]["measured_time_s"], rel=1e-6)
        ph = data["generation"]["phases"][name]
        assert new.reserve_fraction == 0  # the slack replaces the flat reserve
        assert e2.peak_memory(name) == pytest.approx(ph["measured_peak_memory_bytes"], abs=16)  # whole bytes
    assert new.mem_margin <= 0.001  # the refit model misses nothing here: no margin needed
    # the decode phase peaks 8% above that prediction: the refit slack (a median over the phases) moves at most
    # some of the way, and the margin covers what is left, so every measured peak is within predicted x
    # (1 + mem_margin), and no more margin than that
    ph = data["generation"]["phases"]["decode"]
    ph["measured_peak_memory_bytes"] = int(e2.peak_memory("decode") * 1.08)
    Path("r.json").write_text(json.dumps(data))
    wary, notes = refit(hw, read_reports(["r.json"]))
    e3, _ = generation_estimate(read_reports(["r.json"])[0], wary)
    ratios = [p["measured_peak_memory_bytes"] / e3.peak_memory(n) for n, p in data["generation"]["phases"].items()]
    assert 0.01 < wary.mem_margin <= 0.081
    assert max(ratios) <= 1 + wary.mem_margin < max(ratios) + 0.0015
    assert any(f"mem_margin {wary.mem_margin:.3g}" in n for n in notes)


@pytest.mark.parametrize("name", ["tiny", "tiny-flux"])
def test_calibrate_calls_text_encoders_as_their_pipeline_does(name):
    """TextEncoderSpec.mask says which attention mask a pipeline passes its text encoder (the operators transformers
    dispatches depend on it): the tiny Wan and FLUX pipelines' own calls match the catalog, and calibrate's timed
    forward (calibrate_host._forward) passes the same: a short prompt then padding, every token, or no mask."""
    from chunkflow.commands.calibrate.host import PROMPT_TOKENS, _forward
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig

    spec = get_model(name)
    everything = {n: "gpu" for n in ("text_encoder", "text_encoder_2", "transformer", "vae")}
    with one_thread():
        built = build_pipeline(spec, everything, OffloadConfig("none"), torch.device("cpu"), seed=0)
    seen: dict[str, tuple] = {}
    for te in spec.pipeline.text_encoders:
        module = getattr(built.pipe, te.component)
        module.register_forward_pre_hook(lambda m, a, kw, te=te: seen.__setitem__(te.component, (a, kw)),
                                         with_kwargs=True)
    with torch.no_grad():
        built.pipe.encode_prompt(prompt=PROMPTS[name][0], device=torch.device("cpu"))
    for te in spec.pipeline.text_encoders:
        args, kw = seen[te.component]
        mask = kw.get("attention_mask", args[1] if len(args) > 1 else None)
        real = "none" if mask is None else ("full" if bool(mask.all()) else "padded")
        assert real == te.mask, te.component
        _forward(getattr(built.pipe, te.component), te, torch.device("cpu"))()
        args, kw = seen[te.component]
        ours = kw.get("attention_mask")
        assert (ours is None) == (te.mask == "none")
        if te.mask == "padded":
            assert int(ours.sum()) == min(PROMPT_TOKENS, te.tokens - 1) < te.tokens
    built.remove()
