"""`--transformer FILE` beside `--weights DIR`: `chunkflow run --prompt` and `chunkflow.load` read the transformer
from a GGUF file (the module diffusers' from_single_file builds, its quantized bytes streamed as stored) and the rest
of the pipeline from the folder; the latents equal diffusers' own pipeline built with the same GGUF transformer
(`from_pretrained(DIR, transformer=<from_single_file module>)`), bit for bit, on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import chunkflow
from gguf_files import Q, load_gguf, wan_original_name, write_gguf
from pipelines import one_thread

PROMPTS = {"tiny": ("a cat walks on the grass", "blurry, low quality"), "tiny-flux": ("a red fox in the snow", None)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each tiny pipeline folder and its transformer as a Q8_0 GGUF file (Wan in Wan's own names, as city96's
    files; FLUX in diffusers' names: diffusers' FLUX converter fixes a 3072 width no tiny model has)."""
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    out = {}
    with one_thread():
        for name in PROMPTS:
            folder = save_catalog_pipeline(name, root / name, 3)
            sd = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
            if name == "tiny":
                sd = {wan_original_name(k): v for k, v in sd.items()}
            out[name] = (folder, write_gguf(root / f"{name}.gguf", sd, Q.Q8_0, "wan" if name == "tiny" else "flux"))
    return out


def _reference(name: str, folder: Path, gguf: Path, seed: int, steps: int) -> torch.Tensor:
    """diffusers alone: the pipeline from the folder with the GGUF transformer from_single_file, the same call."""
    import diffusers

    from chunkflow_planner.catalog import get_model

    spec = get_model(name)
    transformer = load_gguf(getattr(diffusers, spec.diffusers.cls), gguf, folder)
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = getattr(diffusers, spec.pipeline.cls).from_pretrained(folder, transformer=transformer, torch_dtype=dtypes)
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


def _plan(cli, name: str) -> Path:
    result = cli("plan", "--model", name, "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return Path("plan.json")


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("flags", [["--mode", "chunkflow", "--chunk-size", "16KB", "--residency", "0.3"],
                                   ["--mode", "layerwise"]], ids=["chunkflow", "layerwise"])
def test_run_latents_identical_to_diffusers_gguf_pipeline(cli, workdir, saved, name, flags):
    folder, gguf = saved[name]
    plan = _plan(cli, name)
    prompt, negative = PROMPTS[name]
    args = ["run", "--plan", plan, "--weights", folder, "--transformer", gguf, "--prompt", prompt, "--seed", "11",
            "--latents", "latents.safetensors", "--report", "report.json", "--device", "cpu", *flags]
    if negative:
        args += ["--negative-prompt", negative]
    with one_thread():
        result = cli(*args)
    assert result.exit_code == 0, result.output
    assert f"transformer: read from {gguf} (gguf)" in result.output
    ours = load_file("latents.safetensors")["latents"]
    ref = _reference(name, folder, gguf, 11, 2)
    assert ours.dtype == ref.dtype and torch.equal(ours, ref)
    load = json.loads(Path("report.json").read_text())["generation"]["load"]
    assert load["transformer_files"] == {"transformer": str(gguf)}
    assert load["transformer_formats"] == {"transformer": "gguf"}


def test_session_latents_identical(cli, workdir, saved):
    folder, gguf = saved["tiny"]
    plan = _plan(cli, "tiny")
    prompt, negative = PROMPTS["tiny"]
    with one_thread(), chunkflow.load(plan, weights=folder, transformer=gguf, device="cpu") as session:
        assert session.load_result.transformer_formats == {"transformer": "gguf"}
        r = session.generate(prompt, negative_prompt=negative, seed=11, steps=2)
    ref = _reference("tiny", folder, gguf, 11, 2)
    assert r.latents is not None and torch.equal(r.latents, ref)


@pytest.mark.parametrize("damage,match", [("truncate", "truncated"), ("flux", "lacks tensor")])
def test_bad_file_refused_before_the_load(cli, workdir, saved, damage, match):
    """A truncated file, or another model's, is one line and exit 2 before anything is loaded."""
    folder, gguf = saved["tiny"]
    bad = workdir / "bad.gguf"
    bad.write_bytes(gguf.read_bytes()[:-100] if damage == "truncate" else saved["tiny-flux"][1].read_bytes())
    plan = _plan(cli, "tiny")
    result = cli("run", "--plan", plan, "--weights", folder, "--transformer", bad, "--prompt", "a cat",
                 "--device", "cpu", "--report", "r.json")
    assert result.exit_code == 2, result.output
    assert match in result.output and "bad.gguf" in result.output and "Traceback" not in result.output
    assert not Path("r.json").exists()


def test_transformer_needs_weights(cli, workdir, saved):
    plan = _plan(cli, "tiny")
    result = cli("run", "--plan", plan, "--transformer", saved["tiny"][1], "--prompt", "a cat", "--device", "cpu")
    assert result.exit_code == 2 and "--weights DIR" in result.output


def test_plan_checks_the_file_and_serve_refuses_a_bad_one(cli, workdir, saved):
    folder, gguf = saved["tiny"]
    ok = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--weights", folder,
             "--transformer", gguf, "--out", "plan.json")
    assert ok.exit_code == 0, ok.output
    assert f"transformer: {gguf} (gguf), checked" in ok.output
    other = saved["tiny-flux"][1]
    bad = cli("plan", "--model", "tiny", "--hardware", "cpu", "--weights", folder, "--transformer", other)
    assert bad.exit_code == 2 and "lacks tensor" in bad.output and "Traceback" not in bad.output
    served = cli("serve", "--plan", "plan.json", "--weights", folder, "--transformer", other, "--port", "8765")
    assert served.exit_code == 2 and "lacks tensor" in served.output, served.output


def test_a_format_plan_runs_only_its_format(cli, workdir, saved, tmp_path):
    """A plan priced for a stored format (plan --format, or from a file) never runs the folder's bf16 weights or a
    file of another format: one line before the load; the plan made from the file itself runs it."""
    folder, gguf = saved["tiny"]
    base = ["--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB"]
    run = ["--weights", folder, "--prompt", "a cat", "--device", "cpu", "--steps", "1"]
    assert cli("plan", *base, "--format", "q4_0", "--out", "q4.json").exit_code == 0
    no_file = cli("run", "--plan", "q4.json", *run)
    assert no_file.exit_code == 2 and "q4_0" in no_file.output and "--transformer FILE" in no_file.output
    assert "Traceback" not in no_file.output and not Path("report.json").exists()
    other = cli("run", "--plan", "q4.json", "--transformer", gguf, *run)
    assert other.exit_code == 2 and "stores the transformer as q8_0" in other.output, other.output
    made = cli("plan", *base, "--weights", folder, "--transformer", gguf, "--out", "q8.json")
    assert made.exit_code == 0, made.output
    assert json.loads(Path("q8.json").read_text())["format"]["name"] == "q8_0"
    both = cli("plan", *base, "--weights", folder, "--transformer", gguf, "--format", "q8_0")
    assert both.exit_code == 2 and "one or the other" in both.output
    ok = cli("run", "--plan", "q8.json", "--transformer", gguf, *run, "--latents", "l.safetensors")
    assert ok.exit_code == 0, ok.output
    with pytest.raises(chunkflow.ChunkflowError, match="--transformer FILE"):
        chunkflow.load("q4.json", folder, device="cpu")


@pytest.mark.parametrize("placement", ["gpu", "stream"])
def test_the_report_measures_the_decode_against_the_plan(cli, workdir, saved, placement):
    """A plan made from the file prices its decode; the run measures the decode of the same weights on its device:
    the bytes every block's quantized weights decode into a step (diffusers' own dequantization of each, counted
    here apart from chunkflow), a rate, and the plan's figure beside it (no error on the CPU: the plan's device is
    not this one)."""
    import diffusers
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    folder, gguf = saved["tiny"]
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--weights", folder,
                 "--transformer", gguf, "--out", "plan.json")
    assert result.exit_code == 0, result.output
    data = json.loads(Path("plan.json").read_text())
    for c in data["pipeline"]["components"]:
        c["placement"] = placement if c["name"] == "transformer" else c["placement"]
    Path("plan.json").write_text(json.dumps(data))
    prompt, negative = PROMPTS["tiny"]
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--weights", folder, "--transformer", gguf, "--prompt", prompt,
                     "--negative-prompt", negative, "--seed", "3", "--report", "r.json", "--device", "cpu",
                     "--mode", "chunkflow", "--chunk-size", "16KB", "--residency", "0.3")
    assert result.exit_code == 0, result.output
    report = json.loads(Path("r.json").read_text())
    dec, stats = report["generation"]["decode"], report["stats"]
    module = load_gguf(diffusers.WanTransformer3DModel, gguf, folder)
    per_forward = sum(dequantize_gguf_tensor(p).to(torch.bfloat16).nbytes for b in module.blocks
                      for p in b.parameters() if isinstance(p, GGUFParameter) and p.quant_type == Q.Q8_0)
    assert report["generation"]["components"]["transformer"] == placement
    if placement == "stream":  # the forwards counted: the conditional and unconditional passes
        assert stats["forwards"] == 2 * report["generation"]["steps"]
    assert dec["decoded_bytes_per_step"] == per_forward * 2 > 0
    assert dec["measured_gbps"] > 0 and dec["measured_s_per_step"] > 0
    assert dec["planned_s_per_step"] > 0 and "q8_0" in dec["planned_gbps"] and dec["error"] is None
    assert "decode: " in result.output and "a forward" in result.output
