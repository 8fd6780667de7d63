"""`chunkflow run --prompts FILE --transformer FILE`: every job of a prompt file on one load whose transformer is read
from a single file (the same file for every job). On the tiny FLUX pipeline saved with save_pretrained and its
transformer as a Q8_0 GGUF file, each job's PNG equals diffusers' FluxPipeline holding the transformer
`from_single_file(..., GGUFQuantizationConfig)` builds from the same file, pixel for pixel; a bad file is one line
before any job runs or output is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gguf_files import Q, load_gguf, write_gguf
from pipelines import one_thread

JOBS = (("a red fox in the snow", 1), ("a lighthouse at dusk", 7))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny FLUX folder and its transformer as a GGUF file (diffusers' names: test_gguf_pipeline says why)."""
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("prompts")
    with one_thread():
        folder = save_catalog_pipeline("tiny-flux", root / "flux", 3)
    sd = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    return folder, write_gguf(root / "flux.gguf", sd, Q.Q8_0, "flux")


def _reference(folder: Path, gguf: Path, prompt: str, seed: int) -> np.ndarray:
    """diffusers alone: FluxPipeline from the folder with the GGUF transformer, as chunkflow calls it."""
    import diffusers

    from chunkflow_planner.catalog import get_model

    spec = get_model("tiny-flux")
    transformer = load_gguf(diffusers.FluxTransformer2DModel, gguf, folder)
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = diffusers.FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=dtypes)
    pipe.set_progress_bar_config(disable=True)
    w = spec.default_workload
    with torch.no_grad(), one_thread():
        image = pipe(prompt=prompt, height=w.height, width=w.width, num_inference_steps=w.steps,
                     guidance_scale=spec.pipeline.guidance, max_sequence_length=spec.pipeline.text_encoders[-1].tokens,
                     generator=torch.Generator("cpu").manual_seed(seed), output_type="pil").images[0]
    return np.asarray(image)


def _plan(cli) -> Path:
    result = cli("plan", "--model", "tiny-flux", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    return Path("plan.json")


def test_every_job_of_a_prompt_file_equals_diffusers_pipeline_on_the_file(cli, workdir, saved):
    from PIL import Image

    folder, gguf = saved
    Path("jobs.jsonl").write_text("".join(json.dumps({"prompt": p, "seed": s}) + "\n" for p, s in JOBS))
    with one_thread():
        result = cli("run", "--plan", _plan(cli), "--weights", folder, "--transformer", gguf, "--device", "cpu",
                     "--prompts", "jobs.jsonl", "--out-dir", "out", "--report", "jobs.json", "--mode", "chunkflow",
                     "--chunk-size", "16KB", "--residency", "0.3")
    assert result.exit_code == 0, result.output
    assert f"transformer: read from {gguf} (gguf)" in result.output
    rep = json.loads(Path("jobs.json").read_text())
    assert rep["loads"] == 1 and rep["load"]["transformer_formats"] == {"transformer": "gguf"}
    outs = [j["out"] for j in rep["jobs"] if j["state"] == "done"]
    assert len(outs) == len(JOBS)
    pictures = [np.asarray(Image.open(Path("out") / o)) for o in outs]
    for picture, (prompt, seed) in zip(pictures, JOBS):
        assert np.array_equal(picture, _reference(folder, gguf, prompt, seed))
    assert not np.array_equal(*pictures)


@pytest.mark.parametrize("damage,said", [("truncate", "truncated"), ("no weights", "--weights DIR")])
def test_a_bad_file_is_one_line_before_any_job(cli, workdir, saved, damage, said):
    folder, gguf = saved
    Path("jobs.jsonl").write_text(json.dumps({"prompt": "a cat"}) + "\n")
    bad = Path("bad.gguf")
    bad.write_bytes(gguf.read_bytes()[:-100] if damage == "truncate" else gguf.read_bytes())
    weights = ["--weights", folder] if damage != "no weights" else []
    result = cli("run", "--plan", _plan(cli), *weights, "--transformer", bad, "--device", "cpu", "--prompts",
                 "jobs.jsonl", "--out-dir", "out", "--report", "jobs.json")
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and said in out and "Traceback" not in result.output, result.output
    assert not Path("out").exists() and not Path("jobs.json").exists()
