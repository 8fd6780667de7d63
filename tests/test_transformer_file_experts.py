"""Two experts, each from its own file (`--transformer A --transformer-2 B`, Wan2.2-A14B's high- and low-noise
files): a tiny Wan2.2-A14B-style pipeline saved with save_pretrained, its experts written as two GGUF files (and,
apart, two fp8-scaled files); `plan` checks both, `run` and `chunkflow.load` stream them (one expert from host
memory, the other from the file on disk) and the latents equal diffusers' WanPipeline holding both experts from the
same files, bit for bit. A file for an expert the folder lacks, or of another shape than its expert, is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import chunkflow
from file_pipelines import FORMATS, expert_file, reference_latents, two_expert_folder
from pipelines import one_thread

EXPERTS = ("transformer", "transformer_2")
PROMPT, NEGATIVE, SEED = "a red fox in the snow", "blurry", 5
SHAPE = ["--height", "64", "--width", "64", "--frames", "5", "--steps", "6"]  # 5 high-noise steps, 1 low-noise
# one expert streamed from host memory, the other read from its file on disk; a tiny GGUF expert cannot be parked
# on disk (its F32 norms are a quarter of its non-block bytes, which the disk tier refuses to hold converted), so
# both of its experts stream
PLACED = {"gguf": {"transformer": "stream", "transformer_2": "stream"},
          "fp8-scaled": {"transformer": "stream", "transformer_2": "disk"}}


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """The two-expert folder and, per format, its experts' files and diffusers' modules of them."""
    root = tmp_path_factory.mktemp("experts")
    folder = two_expert_folder(root / "pipe")
    files = {fmt: {n: expert_file(folder, n, fmt, root / f"{fmt}-{n}") for n in EXPERTS} for fmt in FORMATS}
    return folder, files, {}


def _plan(cli, folder: Path, files: dict, out: str = "plan.json") -> Path:
    result = cli("plan", "--weights", folder, "--hardware", "cpu", "--host-mem-budget", "8GB", *SHAPE,
                 "--transformer", files["transformer"][0], "--transformer-2", files["transformer_2"][0], "--out", out)
    assert result.exit_code == 0, result.output
    for name in EXPERTS:
        assert f"{name}: {files[name][0]} (" in result.output and "checked against the folder's config" in result.output
    return Path(out)


def _placed(plan: Path, where: dict[str, str]) -> Path:
    """The plan with its experts placed as `where` says (one streamed from host memory, one read from disk)."""
    data = json.loads(plan.read_text())
    for c in data["pipeline"]["components"]:
        c["placement"] = where.get(c["name"], c["placement"])
    out = plan.with_name("placed.json")
    out.write_text(json.dumps(data))
    return out


def _reference(experts, fmt: str, plan: Path) -> torch.Tensor:
    """diffusers' WanPipeline with both experts from the format's files (computed once a format)."""
    from chunkflow_planner.plan import load_plan, model_of

    folder, files, cache = experts
    if fmt not in cache:
        from chunkflow_planner.pipeline.experts import expert_steps

        p = load_plan(plan)
        spec, w = model_of(p), p.workload.to_workload()
        assert min(expert_steps(spec.pipeline, w.steps)) > 0  # each expert runs
        cache[fmt] = reference_latents(spec, folder, {n: files[fmt][n][1] for n in EXPERTS}, PROMPT, NEGATIVE, SEED,
                                       w)
    return cache[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_run_with_a_file_each_expert_equals_diffusers_pipeline(cli, workdir, experts, fmt):
    folder, files, _ = experts
    plan = _placed(_plan(cli, folder, files[fmt]), PLACED[fmt])
    with one_thread():
        result = cli("run", "--plan", plan, "--weights", folder, "--transformer", files[fmt]["transformer"][0],
                     "--transformer-2", files[fmt]["transformer_2"][0], "--prompt", PROMPT, "--negative-prompt",
                     NEGATIVE, "--seed", SEED, "--latents", "l.safetensors", "--report", "r.json", "--device", "cpu",
                     "--mode", "chunkflow", "--chunk-size", "16KB", "--residency", "0.3")
    assert result.exit_code == 0, result.output
    for name, where in PLACED[fmt].items():
        assert f"{name}: {where} (" in result.output, result.output
    gen = json.loads(Path("r.json").read_text())["generation"]
    on_disk = [n for n, where in PLACED[fmt].items() if where == "disk"]
    assert all(gen["disk_read_bytes"].get(n, 0) > 0 for n in on_disk), gen["disk_read_bytes"]  # read from the file
    load = gen["load"]
    assert load["transformer_files"] == {n: str(files[fmt][n][0]) for n in EXPERTS}
    assert load["transformer_formats"] == {n: fmt for n in EXPERTS}
    got = load_file("l.safetensors")["latents"]
    want = _reference(experts, fmt, plan)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_session_with_a_file_each_expert_equals_diffusers_pipeline(cli, workdir, experts, fmt):
    folder, files, _ = experts
    plan = _plan(cli, folder, files[fmt])
    with one_thread(), chunkflow.load(plan, weights=folder, transformer=files[fmt]["transformer"][0],
                                      transformer_2=files[fmt]["transformer_2"][0], device="cpu") as session:
        assert session.load_result.transformer_formats == {n: fmt for n in EXPERTS}
        r = session.generate(PROMPT, negative_prompt=NEGATIVE, seed=SEED)
    assert torch.equal(r.latents, _reference(experts, fmt, plan))


def test_a_file_for_an_expert_the_folder_lacks_is_one_line(cli, workdir, experts, tmp_path):
    from pipelines import save_catalog_pipeline

    _, files, _ = experts
    with one_thread():
        one = save_catalog_pipeline("tiny", tmp_path / "one", 3)
    second = files["gguf"]["transformer_2"][0]
    said = "--transformer-2 was given, but tiny-wan has no transformer_2 (1 transformer: transformer)"
    planned = cli("plan", "--model", "tiny", "--hardware", "cpu", "--weights", one, "--transformer-2", second)
    assert planned.exit_code == 2 and said in planned.output and "Traceback" not in planned.output, planned.output
    assert cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out",
               "tiny.json").exit_code == 0
    ran = cli("run", "--plan", "tiny.json", "--weights", one, "--transformer-2", second, "--prompt", "a cat",
              "--device", "cpu", "--report", "r.json")
    assert ran.exit_code == 2 and said in ran.output and "Traceback" not in ran.output, ran.output
    assert not Path("r.json").exists()
    with pytest.raises(chunkflow.ChunkflowError, match=r"has no transformer_2 \(1 transformer"):
        chunkflow.load("tiny.json", one, transformer_2=second, device="cpu")


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_of_another_shape_than_their_expert_are_one_line_naming_the_option(cli, workdir, experts, fmt,
                                                                                 tmp_path):
    """Each expert's file is checked against that expert's config: a file of another shape (another model's
    expert, the two of a pair of differently shaped experts swapped) names the option it was given with."""
    import diffusers

    folder, files, _ = experts
    cfg = diffusers.WanTransformer3DModel.load_config(str(folder / "transformer_2"))
    other = tmp_path / "other"
    with one_thread():
        m = diffusers.WanTransformer3DModel.from_config({**cfg, "ffn_dim": cfg["ffn_dim"] * 2}).to(torch.bfloat16)
        m.save_pretrained(other / "transformer_2")
    wrong, _ = expert_file(other, "transformer_2", fmt, tmp_path / "wrong")
    for order in ((files[fmt]["transformer"][0], wrong), (wrong, files[fmt]["transformer_2"][0])):
        flag = "--transformer-2" if order[1] == wrong else "--transformer"
        result = cli("plan", "--weights", folder, "--hardware", "cpu", *SHAPE, "--transformer", order[0],
                     "--transformer-2", order[1])
        out = " ".join(result.output.split())  # the terminal wraps long lines
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"{flag} {str(wrong)!r}" in out and "ffn" in out, out


def test_a_pair_whose_names_say_the_other_stage_is_refused_before_the_load(cli, workdir, experts, tmp_path):
    """The experts have the same shape, so a swapped pair passes every header check and would run each stage with
    the other's weights; where the files' own names say their stage (city96's `..._high_noise_...`, QuantStack's
    `...-LowNoise-...`), a file given for the other stage is one line naming the option, on plan and on run; named
    the right way round they plan as before."""
    import shutil

    folder, files, _ = experts
    named = {}
    for name, stage in (("transformer", "high_noise"), ("transformer_2", "LowNoise")):
        named[name] = tmp_path / f"wan2.2_t2v_{stage}_14B_Q8_0.gguf"
        shutil.copy(files["gguf"][name][0], named[name])
    right = _plan(cli, folder, {n: (named[n],) for n in EXPERTS})
    swapped = ["--transformer", named["transformer_2"], "--transformer-2", named["transformer"]]
    planned = cli("plan", "--weights", folder, "--hardware", "cpu", *SHAPE, *swapped)
    ran = cli("run", "--plan", right, "--weights", folder, *swapped, "--prompt", "a cat", "--device", "cpu",
              "--report", "r.json")
    for result in (planned, ran):
        out = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"--transformer {str(named['transformer_2'])!r} is named a low-noise expert" in out, out
        assert "give it as --transformer-2" in out
    assert not Path("r.json").exists()


def test_a_format_plan_runs_each_expert_from_a_file_of_its_format(cli, workdir, experts):
    """A plan priced from GGUF experts runs only GGUF experts: an fp8-scaled second expert, or none (the folder's
    own weights for it), is one line before anything is read."""
    folder, files, _ = experts
    plan = _plan(cli, folder, files["gguf"])
    for extra, said in ((["--transformer-2", files["fp8-scaled"]["transformer_2"][0]], "stores the transformer_2 as "
                         "fp8-scaled, and the plan was made for q8_0"),
                        ([], "transformer_2 was given no file: give it with --transformer-2 FILE")):
        ran = cli("run", "--plan", plan, "--weights", folder, "--transformer", files["gguf"]["transformer"][0],
                  *extra, "--prompt", "a cat", "--device", "cpu", "--report", "r.json")
        out = " ".join(ran.output.split())
        assert ran.exit_code == 2 and "Traceback" not in ran.output and said in out, out
        assert not Path("r.json").exists()


def test_a_session_refuses_a_pair_named_the_other_way_round(workdir, experts, tmp_path, cli):
    """chunkflow.load checks the names as the commands do."""
    import shutil

    folder, files, _ = experts
    plan = _plan(cli, folder, files["gguf"])
    low = tmp_path / "Wan2.2-T2V-A14B-LowNoise-Q8_0.gguf"
    shutil.copy(files["gguf"]["transformer_2"][0], low)
    with pytest.raises(chunkflow.ChunkflowError, match="is named a low-noise expert"):
        chunkflow.load(plan, weights=folder, transformer=low, transformer_2=files["gguf"]["transformer"][0],
                       device="cpu")
