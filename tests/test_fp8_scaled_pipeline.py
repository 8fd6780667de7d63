"""`--transformer FILE` with an fp8-scaled safetensors file (ComfyUI's layout, Wan's own names) beside the folder:
`chunkflow run --prompt` streams the e4m3 bytes as stored and its latents equal diffusers' pipeline whose
transformer holds the plain torch reference of the format's dequantization (`w.to(bf16) * scale.to(bf16)`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from pipelines import one_thread  # noqa: E402
from test_fp8_scaled import reference, wan_groups, wan_name, write_file  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Wan pipeline's folder, its transformer as an fp8-scaled file, and the reference transformer."""
    import diffusers

    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("fp8pipe")
    with one_thread():
        folder = save_catalog_pipeline("tiny", root / "tiny", 3)
    m = diffusers.WanTransformer3DModel.from_pretrained(folder / "transformer", torch_dtype=torch.bfloat16)
    linear = {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    other = {k: wan_name(k) for k in m.state_dict() if k.rsplit(".", 1)[0] not in linear}
    path = root / "wan-tiny-fp8_scaled.safetensors"
    ref = write_file(path, m, wan_groups(m), other)
    return folder, path, reference(m, ref).eval()


def test_run_latents_equal_the_reference_pipeline(cli, workdir, saved):
    import diffusers

    from chunkflow_planner.catalog import get_model

    folder, path, ref = saved
    assert cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB",
               "--out", "plan.json").exit_code == 0
    result = cli("run", "--plan", "plan.json", "--weights", folder, "--transformer", path, "--prompt", "a cat",
                 "--negative-prompt", "blurry", "--seed", "5", "--latents", "l.safetensors", "--device", "cpu",
                 "--mode", "chunkflow", "--chunk-size", "16KB", "--residency", "0.3")
    assert result.exit_code == 0, result.output
    assert "fp8-scaled" in result.output
    spec = get_model("tiny")
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = diffusers.WanPipeline.from_pretrained(folder, transformer=ref, torch_dtype=dtypes)
    pipe.set_progress_bar_config(disable=True)
    w = spec.default_workload
    with torch.no_grad(), one_thread():
        want = pipe(prompt="a cat", negative_prompt="blurry", height=w.height, width=w.width, num_frames=w.frames,
                    num_inference_steps=spec.default_workload.steps, guidance_scale=spec.pipeline.guidance,
                    max_sequence_length=spec.pipeline.text_encoders[0].tokens,
                    generator=torch.Generator("cpu").manual_seed(5), output_type="latent").frames
    got = next(iter(load_file("l.safetensors").values()))
    assert torch.equal(got, want.to(got.dtype).reshape(got.shape))


@pytest.mark.parametrize("attack", ["truncated", "a header longer than the file", "e5m2 bytes under a scale",
                                    "a per-row scale"])
def test_a_lying_file_is_one_line_before_the_load(cli, workdir, saved, attack):
    """`run --transformer` with a damaged or lying fp8-scaled file: exit 2, one line naming the file, no traceback,
    nothing loaded or written."""
    from test_fp8_scaled import ATTACKS

    folder, path, _ = saved
    bad = workdir / "bad.safetensors"
    bad.write_bytes(path.read_bytes())
    damage, said = ATTACKS[attack]
    damage(bad)
    assert cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB",
               "--out", "plan.json").exit_code == 0
    result = cli("run", "--plan", "plan.json", "--weights", folder, "--transformer", bad, "--prompt", "a cat",
                 "--device", "cpu", "--report", "r.json")
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "bad.safetensors" in out and (said in out or "not an fp8-scaled transformer" in out), out
    assert not Path("r.json").exists()
