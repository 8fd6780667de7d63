"""`chunkflow run --prompts FILE --out-dir DIR`: one load for every job of a prompt file. On tiny pipelines saved with
save_pretrained: the outputs equal single runs with the same seeds (FLUX's lossless PNGs, pixel for pixel), the
pipeline is built once, a broken line or a job too large for the loaded placement is skipped with its reason while
the others run, a job that breaks mid-way is reported and the next runs, and Ctrl-C leaves the finished outputs, a
report of what was done and no partial file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipelines import one_thread

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    with one_thread():
        return {name: save_catalog_pipeline(name, root / name, 3) for name in ("tiny-flux", "tiny")}


def _plan(cli, name: str) -> Path:
    result = cli("plan", "--model", name, "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return Path("plan.json")


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path))


def test_jobs_equal_single_runs_with_one_load(cli, workdir, saved, monkeypatch):
    import chunkflow.models.pipeline_build as pb

    plan = _plan(cli, "tiny-flux")
    Path("jobs.jsonl").write_text(
        '{"prompt": "a red fox in the snow", "seed": 1}\n'
        "# a comment, then a plain prompt (seed 0)\n"
        "a lighthouse at dusk\n"
        '{"prompt": "broken line", "seed": "x"}\n'
        '{"prompt": "too large", "height": 8192, "width": 8192}\n'
        '{"prompt": "a green apple", "seed": 7, "out": "apple"}\n')
    builds = []
    real = pb.build_pipeline

    def counted(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pb, "build_pipeline", counted)
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", saved["tiny-flux"], "--device", "cpu",
                     "--prompts", "jobs.jsonl", "--out-dir", "clips", "--report", "jobs-report.json")
    assert result.exit_code == 0, result.output
    assert len(builds) == 1
    rep = json.loads(Path("jobs-report.json").read_text())
    assert rep["loads"] == 1
    states = {j["line"]: j["state"] for j in rep["jobs"]}
    assert states == {1: "done", 3: "done", 4: "refused", 5: "refused", 6: "done"}
    errors = {j["line"]: j["error"] for j in rep["jobs"]}
    assert "seed" in errors[4] and "host memory with the loaded placement" in errors[5]
    assert "line 4: skipped" in result.output and "line 5: skipped" in result.output
    outs = {j["line"]: j["out"] for j in rep["jobs"] if j["state"] == "done"}
    assert outs == {1: "0001-a-red-fox-in-the-snow.png", 3: "0003-a-lighthouse-at-dusk.png", 6: "apple.png"}
    assert sorted(p.name for p in Path("clips").iterdir()) == sorted(outs.values())  # nothing else, no temporaries
    monkeypatch.setattr(pb, "build_pipeline", real)
    for line, prompt, seed in ((1, "a red fox in the snow", 1), (3, "a lighthouse at dusk", 0), (6, "a green apple", 7)):
        with one_thread():
            single = cli("run", "--plan", plan, "--weights", saved["tiny-flux"], "--device", "cpu", "--prompt",
                         prompt, "--seed", seed, "--out", f"single-{line}.png", "--report", f"r{line}.json")
        assert single.exit_code == 0, single.output
        assert np.array_equal(_png(Path("clips") / outs[line]), _png(Path(f"single-{line}.png")))
    assert not np.array_equal(_png(Path("clips") / outs[1]), _png(Path("clips") / outs[6]))


def test_command_options_are_defaults_and_bad_options_fail_before_the_load(cli, workdir, saved):
    plan = _plan(cli, "tiny")
    Path("jobs.txt").write_text("a cat walks on the grass\n")
    for args, message in ((["--prompt", "x"], "--prompt"), (["--out", "a.mp4"], "--out"),
                          (["--repeat", "2"], "--repeat"), (["--out-dir", "jobs.txt"], "is a file")):
        result = cli("run", "--plan", plan, "--device", "cpu", "--prompts", "jobs.txt", *args)
        assert result.exit_code == 2 and message in result.output, result.output
    assert cli("run", "--plan", plan, "--out-dir", "x").exit_code == 2  # --out-dir without --prompts
    Path("empty.txt").write_text("\n# nothing\n")
    result = cli("run", "--plan", plan, "--device", "cpu", "--prompts", "empty.txt")
    assert result.exit_code == 2 and "holds no job" in result.output
    Path("bad.jsonl").write_text('{"prompt": "x", "out": "../escape.mp4"}\n{"prompt": "y", "out": "a.png"}\n')
    result = cli("run", "--plan", plan, "--device", "cpu", "--prompts", "bad.jsonl")
    assert result.exit_code == 2 and "no job" in result.output
    assert "not a plain file name" in result.output and "makes videos" in result.output
    assert not Path("escape.mp4").exists()
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", saved["tiny"], "--device", "cpu", "--prompts", "jobs.txt",
                     "--seed", "9", "--steps", "1", "--out-dir", "o", "--report", "rep.json")
    assert result.exit_code == 0, result.output
    job = json.loads(Path("rep.json").read_text())["jobs"][0]
    assert job["seed"] == 9 and job["shape"].endswith("1 steps") and job["state"] == "done"


def _planned(cli, saved, text: str):
    from chunkflow.commands.run_jobs import plan_jobs
    from chunkflow.commands.steps import RunOptions
    from chunkflow_planner.pipeline.jobs import parse_jobs
    from chunkflow_planner.plan import load_plan, model_of
    from chunkflow_planner.plan import hardware_of

    p = load_plan(_plan(cli, "tiny"))
    planned = plan_jobs(p, model_of(p), hardware_of(p), parse_jobs(text), {})
    return p, RunOptions(device="cpu", weights=str(saved["tiny"]), warmup=0), planned


def test_a_job_that_breaks_is_reported_and_the_next_runs(cli, workdir, saved):
    from chunkflow.commands.run_jobs import run_jobs
    from chunkflow_planner.errors import ChunkflowError

    p, opts, planned = _planned(cli, saved, "one\ntwo\nthree\n")
    jobs = []

    def progress(phase, i, n):
        if phase == "denoise" and i == 1 and jobs[-1] == 2:
            raise ChunkflowError("the latents broke")

    with one_thread():
        rep = run_jobs(p, p.offload, opts, planned, workdir, "jobs.txt", progress=progress,
                       on_job=lambda k, n, job: jobs.append(k))
    assert [j.state for j in rep.jobs] == ["done", "failed", "done"]
    assert rep.jobs[1].error == "the latents broke" and not rep.interrupted
    assert sorted(x.name for x in workdir.glob("*.mp4")) == ["0001-one.mp4", "0003-three.mp4"]


def test_ctrl_c_keeps_what_was_done_and_reports_it(cli, workdir, saved):
    from chunkflow.commands.run_jobs import run_jobs

    p, opts, planned = _planned(cli, saved, "one\ntwo\nthree\n")
    jobs = []

    def progress(phase, i, n):
        if phase == "denoise" and i == 1 and jobs[-1] == 2:
            raise KeyboardInterrupt

    with one_thread(), pytest.raises(KeyboardInterrupt) as stopped:
        run_jobs(p, p.offload, opts, planned, workdir, "jobs.txt", progress=progress,
                 on_job=lambda k, n, job: jobs.append(k))
    rep = stopped.value.jobs_report
    assert rep.interrupted and [j.state for j in rep.jobs] == ["done", "interrupted", "not run"]
    assert [x.name for x in workdir.iterdir() if x.suffix == ".mp4" or x.name.startswith(".")] == ["0001-one.mp4"]


def test_prompt_file_lines(tmp_path):
    from chunkflow_planner.pipeline.jobs import JobError, parse_jobs, read_jobs

    lines = parse_jobs('  \n# c\nplain words\n{"prompt": "p", "seed": 3, "steps": 4}\n{"prompt": ""}\n[1]\n'
                       '{"prompt": "x", "colour": "red"}\n{not json\n{"prompt": "x", "guidance": NaN}\n'
                       + "[" * 50_000 + "]" * 50_000 + '\n{"prompt": "x", "seed": ' + "9" * 5000 + "}\n"
                       '{"prompt": "x", "steps": true}\n{"prompt": "x", "seed": "5"}\n')
    assert [ln.number for ln in lines] == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert lines[0].job.prompt == "plain words" and lines[1].job.seed == 3 and lines[1].job.steps == 4
    errors = [ln.error for ln in lines[2:]]
    assert all(errors) and "prompt" in errors[0] and "JSON object" in errors[1] and "colour" in errors[2]
    assert "not valid JSON" in errors[3] and "guidance" in errors[4]
    assert "nested too deeply" in errors[5] and "not valid JSON for a job" in errors[6]
    assert errors[7].startswith("steps") and errors[8].startswith("seed")  # JSON as given: no coercion
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "jobs.jsonl").write_text('{"prompt": "x", "image": "cat.png"}\n')
    assert read_jobs(tmp_path / "sub" / "jobs.jsonl")[0].job.image == str(tmp_path / "sub" / "cat.png")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(Exception, match="UTF-8"):
        read_jobs(tmp_path / "bin")
    (tmp_path / "empty").write_text("")
    with pytest.raises(JobError, match="holds no job"):
        read_jobs(tmp_path / "empty")


def test_image_jobs_animate_their_images_and_a_job_without_one_is_refused(cli, workdir):
    """A Wan2.2-TI2V-style folder: jobs that give an image make the run load the image pipeline of the family
    (WanImageToVideoPipeline), each job animates its own image (a path relative to the prompt file's folder) as
    `run --image` does; a job without an image in the same file is refused with what to do."""
    pytest.importorskip("ftfy")
    from PIL import Image

    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("tiny-ti2v", workdir / "ti2v")
    assert cli("plan", "--model", "tiny-ti2v", "--hardware", "cpu", "--out", "plan.json").exit_code == 0
    (workdir / "in").mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (56, 72, 3), dtype=np.uint8)).save(workdir / "in" / f"{name}.png")
    Path("in/jobs.jsonl").write_text('{"prompt": "a cat", "image": "a.png", "seed": 5}\n'
                                     '{"prompt": "no picture", "seed": 1}\n'
                                     '{"prompt": "a dog", "image": "b.png", "seed": 6, "out": "dog.mp4"}\n'
                                     '{"prompt": "lost", "image": "missing.png"}\n')
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", folder, "--device", "cpu", "--prompts",
                     "in/jobs.jsonl", "--out-dir", "clips", "--report", "rep.json")
    assert result.exit_code == 0, result.output
    jobs = {j["line"]: j for j in json.loads(Path("rep.json").read_text())["jobs"]}
    assert [jobs[n]["state"] for n in (1, 2, 3, 4)] == ["done", "refused", "done", "refused"]
    assert "WanImageToVideoPipeline" in jobs[2]["error"] and "give this job one" in jobs[2]["error"]
    assert "missing.png" in jobs[4]["error"]
    for line, image, seed in ((1, "a.png", 5), (3, "b.png", 6)):
        with one_thread():
            single = cli("run", "--plan", "plan.json", "--weights", folder, "--device", "cpu", "--prompt",
                         "a cat" if line == 1 else "a dog", "--image", f"in/{image}", "--seed", seed, "--out",
                         f"single-{line}.mp4", "--report", f"r{line}.json")
        assert single.exit_code == 0, single.output
        assert (Path("clips") / jobs[line]["out"]).read_bytes() == Path(f"single-{line}.mp4").read_bytes()


def test_ctrl_c_on_the_command_line_writes_the_report_and_exits_130(cli, workdir, saved, monkeypatch):
    """The command's side of an interrupt: the table and the report of what was done, exit 130 (the interrupt
    injected as the terminal's Ctrl-C arrives: a KeyboardInterrupt out of the second job's generation)."""
    from chunkflow.session import Session

    plan = _plan(cli, "tiny")
    Path("jobs.txt").write_text("one\ntwo\nthree\n")
    real, calls = Session.generate, []

    def interrupted(self, job, **kw):
        calls.append(job.prompt)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, job, **kw)

    monkeypatch.setattr(Session, "generate", interrupted)
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", saved["tiny"], "--device", "cpu", "--prompts", "jobs.txt",
                     "--out-dir", "o", "--report", "rep.json")
    assert result.exit_code == 130, result.output
    rep = json.loads(Path("rep.json").read_text())
    assert rep["interrupted"] and [j["state"] for j in rep["jobs"]] == ["done", "interrupted", "not run"]
    assert "Interrupted" in result.output and sorted(p.name for p in Path("o").iterdir()) == ["0001-one.mp4"]


def test_a_job_asking_an_image_model_for_frames_is_refused_in_its_words(cli, workdir):
    from chunkflow_planner.pipeline.jobs import Job, fit_job
    from chunkflow_planner.plan import load_plan, model_of
    from chunkflow_planner.plan import hardware_of

    p = load_plan(_plan(cli, "tiny-flux"))
    fit = fit_job(p, model_of(p), hardware_of(p), Job(prompt="x", frames=9))
    assert fit.reason == "frames: tiny-flux makes images, not videos; leave frames out"
    w = p.workload
    assert fit_job(p, model_of(p), hardware_of(p), Job(prompt="x", frames=1, height=w.height)).reason is None
    odd = fit_job(p, model_of(p), hardware_of(p), Job(prompt="x", height=w.height + 1)).reason
    assert "divisible" in odd and "Nearest valid" in odd


def test_a_plan_that_reads_the_checkpoint_at_run_time_needs_its_folder_everywhere(cli, workdir):
    """Blocks kept on disk or a component placed on disk: run --prompt, run --prompts, serve and chunkflow.load
    all refuse to start without the folder, with the same words (files_needed), before anything loads."""
    import chunkflow
    from chunkflow_planner.plan import files_needed, load_plan

    plan = json.loads(_plan(cli, "tiny").read_text())
    assert files_needed(load_plan(plan)) is None
    on_disk = json.loads(json.dumps(plan))
    next(c for c in on_disk["pipeline"]["components"] if c["kind"] == "text_encoder")["placement"] = "disk"
    Path("disk.json").write_text(json.dumps(on_disk))
    why = files_needed(load_plan(on_disk))
    assert "text_encoder" in why and "--weights DIR" in why
    assert files_needed(load_plan(on_disk), components=False) is None  # the synthetic steps read no component
    Path("jobs.txt").write_text("a cat\n")
    for args in (["run", "--plan", "disk.json", "--prompt", "a cat"], ["run", "--plan", "disk.json", "--prompts",
                                                                       "jobs.txt"], ["serve", "--plan", "disk.json"]):
        result = cli(*args)
        assert result.exit_code == 2 and "placement disk" in result.output, (args, result.output)
    with pytest.raises(chunkflow.ChunkflowError, match=r"placement disk.*weights=DIR"):
        chunkflow.load("disk.json", device="cpu")
    assert not Path("outputs").exists()  # refused before the output folder was made
    encoded = json.loads(json.dumps(plan))  # the codec encodes from the files and maps them outside the forward
    encoded["offload"].update(mode="chunkflow", chunk_bytes=16000, codec="exponent-pack")
    encoded["hardware"]["spec"]["codec_decode_gbps"] = 50.0
    for c in encoded["pipeline"]["components"]:
        c["placement"] = "stream" if c["kind"] == "transformer" else c["placement"]
    Path("codec.json").write_text(json.dumps(encoded))
    assert "codec exponent-pack" in files_needed(load_plan(encoded))
    result = cli("run", "--plan", "codec.json", "--prompt", "a cat")
    assert result.exit_code == 2 and "codec" in result.output and "--weights" in result.output, result.output


def test_the_file_is_read_first_and_no_output_lands_on_an_image(cli, workdir):
    """A prompt file that is a folder is said as such (not as an output clash); an output named over a job's image
    in the output folder is refused; a run with no job to run leaves no output folder behind."""
    from PIL import Image

    plan = _plan(cli, "tiny")
    (workdir / "somewhere").mkdir()
    result = cli("run", "--plan", plan, "--device", "cpu", "--prompts", "somewhere")
    assert result.exit_code == 2 and "is a directory" in result.output, result.output
    (workdir / "clips").mkdir()
    Image.new("RGB", (64, 64)).save(workdir / "clips" / "cat.png")
    Path("jobs.jsonl").write_text('{"prompt": "x", "image": "clips/cat.png", "out": "cat.png"}\n')
    from chunkflow.commands.run_jobs import plan_jobs
    from chunkflow_planner.pipeline.jobs import read_jobs
    from chunkflow_planner.plan import load_plan, model_of
    from chunkflow_planner.plan import hardware_of

    p = load_plan(plan)
    spec = model_of(p).model_copy(update={"vae_temporal": None})  # an image model's outputs are .png
    planned = plan_jobs(p, spec, hardware_of(p), read_jobs("jobs.jsonl"), {}, workdir / "clips")
    assert "written over line 1's image" in planned[0].error
    Path("bad.txt").write_text('{"prompt": ""}\n')
    result = cli("run", "--plan", plan, "--device", "cpu", "--prompts", "bad.txt", "--out-dir", "never")
    assert result.exit_code == 2 and not Path("never").exists()


def test_a_negative_prompt_for_a_model_without_one_is_refused_in_the_same_words_everywhere(cli, workdir, saved):
    """FLUX embeds its guidance: `run --prompt --negative-prompt`, a prompt file's line and a session's generate
    refuse a negative prompt with one message (models/adapters.negative_prompt_refusal), before anything runs; a
    session given an image as a Path says its pipeline takes none."""
    import chunkflow
    from chunkflow.commands.run_jobs import plan_jobs
    from chunkflow_planner.pipeline.jobs import parse_jobs
    from chunkflow_planner.plan import load_plan, model_of
    from chunkflow_planner.plan import hardware_of

    plan = _plan(cli, "tiny-flux")
    result = cli("run", "--plan", plan, "--prompt", "x", "--negative-prompt", "blur")
    assert result.exit_code == 2 and "distilled into the model: --guidance sets it" in " ".join(result.output.split())
    p = load_plan(plan)
    planned = plan_jobs(p, model_of(p), hardware_of(p), parse_jobs('{"prompt": "x", "negative_prompt": "blur"}'), {})
    assert "distilled into the model: guidance sets it); leave negative_prompt out" in planned[0].error
    with one_thread(), chunkflow.load(plan, weights=saved["tiny-flux"], device="cpu") as session:
        with pytest.raises(chunkflow.ChunkflowError, match="distilled into the model"):
            session.generate("x", negative_prompt="blur")
        with pytest.raises(chunkflow.ChunkflowError, match="takes no image"):
            session.generate("x", image=workdir / "cat.png")
        assert session.generations == 0


def test_an_image_line_on_a_folder_without_an_image_pipeline_is_skipped_and_the_others_run(cli, workdir, saved):
    """Issue 53: a FLUX folder (FluxPipeline takes no image, and no image pipeline of its family runs on its
    components alone) with one `image` line: that line is skipped with its reason, the text-only lines run."""
    from PIL import Image

    plan = _plan(cli, "tiny-flux")
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(workdir / "cat.png")
    Path("jobs.jsonl").write_text('{"prompt": "a red fox", "seed": 1}\n'
                                  '{"prompt": "the cat", "image": "cat.png"}\n'
                                  '{"prompt": "a green apple", "seed": 2}\n')
    with one_thread():
        r = cli("run", "--plan", plan, "--weights", saved["tiny-flux"], "--device", "cpu", "--prompts",
                "jobs.jsonl", "--out-dir", "out", "--report", "rep.json")
    assert r.exit_code == 0, r.output
    assert "line 2: skipped: this folder's pipeline takes no image: FluxPipeline takes no image" in \
        " ".join(r.stderr.split())
    jobs = {j["line"]: j for j in json.loads(Path("rep.json").read_text())["jobs"]}
    assert [jobs[n]["state"] for n in (1, 2, 3)] == ["done", "refused", "done"]
    assert sorted(p.name for p in Path("out").iterdir()) == sorted([jobs[1]["out"], jobs[3]["out"]])


def test_an_error_that_stops_the_batch_still_gives_the_report_of_what_ran(cli, workdir, saved):
    """Issue 53: not a signal but an unexpected error in the second job: the batch stops, and the report says the
    first done, the second failed with the error, the third not run (not an interrupt)."""
    from chunkflow.commands.run_jobs import run_jobs

    p, opts, planned = _planned(cli, saved, "one\ntwo\nthree\n")
    jobs = []

    def progress(phase, i, n):
        if phase == "denoise" and i == 1 and jobs[-1] == 2:
            raise RuntimeError("a bug")

    with one_thread(), pytest.raises(RuntimeError) as stopped:
        run_jobs(p, p.offload, opts, planned, workdir, "jobs.txt", progress=progress,
                 on_job=lambda k, n, job: jobs.append(k))
    rep = stopped.value.jobs_report
    assert not rep.interrupted and [j.state for j in rep.jobs] == ["done", "failed", "not run"]
    assert rep.jobs[1].error == "RuntimeError: a bug" and "stopped on RuntimeError" in rep.jobs[2].error


def test_max_job_time_skips_a_job_predicted_over_it_and_says_each_prediction(cli, workdir, saved):
    """Issue 53: --max-job-time admits by time: a job whose predicted time's upper band end is over the limit is
    skipped before the load with both figures; each job that runs has its prediction said before it starts."""
    from chunkflow.commands.run_prompts import admit_by_time
    from chunkflow.commands.run_jobs import plan_jobs
    from chunkflow_planner.pipeline.jobs import parse_jobs
    from chunkflow_planner.plan import hardware_of, load_plan, model_of

    text = ('{"prompt": "small", "seed": 1}\n{"prompt": "huge", "height": 1024, "width": 1024}\n'
            '{"prompt": "small too", "seed": 2}\n')
    p = load_plan(_plan(cli, "tiny"))
    planned = plan_jobs(p, model_of(p), hardware_of(p), parse_jobs(text), {})
    admit_by_time(p, planned, None)
    small, huge = max(planned[0].upper_s, planned[2].upper_s), planned[1].upper_s
    assert huge > 2 * small
    limit = (small + huge) / 2
    Path("jobs.jsonl").write_text(text)
    with one_thread():
        r = cli("run", "--plan", "plan.json", "--weights", saved["tiny"], "--device", "cpu", "--prompts",
                "jobs.jsonl", "--out-dir", "out", "--report", "rep.json", "--max-job-time", f"{limit}s")
    assert r.exit_code == 0, r.output
    err = " ".join(r.stderr.split())
    assert "line 2: skipped: predicted" in err and "over --max-job-time" in err, err
    assert "line 1: starting, predicted" in err and "line 3: starting, predicted" in err
    jobs = {j["line"]: j["state"] for j in json.loads(Path("rep.json").read_text())["jobs"]}
    assert jobs == {1: "done", 2: "refused", 3: "done"}
    bad = cli("run", "--plan", "plan.json", "--prompt", "x", "--max-job-time", "1min")
    assert bad.exit_code == 2 and "--max-job-time goes with --prompts" in bad.output
    bad = cli("run", "--plan", "plan.json", "--prompts", "jobs.jsonl", "--max-job-time", "soon")
    assert bad.exit_code == 2 and "--max-job-time" in bad.output
