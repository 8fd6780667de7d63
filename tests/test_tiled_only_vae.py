"""A VAE whose class decodes only tiled (diffusers' AutoencoderKLAllegro raises NotImplementedError without
`enable_tiling()`): the folder's derived model says so, every plan decodes it tiled, and the run decodes it as
diffusers does with tiling on, bit for bit. Before, the plan priced it untiled and the run failed at the decode,
after the whole denoise, blaming the folder's vae/config.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from pipelines import one_thread  # noqa: E402
from test_bad_input_5 import _allegro  # noqa: E402
from test_pipelines_53 import _pixart  # noqa: E402
from test_run_any import PROMPT, STREAM, _save, derived  # noqa: E402

WORK = dict(height=32, width=32, frames=5, steps=2)


@pytest.fixture(scope="module")
def allegro(tmp_path_factory) -> Path:
    return _save(_allegro(), tmp_path_factory.mktemp("tiled") / "allegro")


def test_the_derived_model_says_the_vae_decodes_only_tiled_and_a_vae_that_can_untiled_does_not(allegro, tmp_path):
    assert derived(allegro, **WORK).pipeline.vae.tiled_only
    assert not derived(_pixart(tmp_path / "pixart"), height=32, width=32, steps=2).pipeline.vae.tiled_only


def test_the_plan_decodes_it_tiled_and_says_so(cli, workdir, allegro):
    r = cli("plan", "--weights", allegro, "--hardware", "cpu", "--height", "32", "--width", "32", "--frames", "5",
            "--steps", "2", "--out", "plan.json")
    assert r.exit_code == 0, r.output
    assert "tiled" in r.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["pipeline"]["vae_tiling"] is True and plan["model"]["spec"]["pipeline"]["vae"]["tiled_only"] is True


def test_the_run_decodes_as_diffusers_does_with_tiling_on(allegro):
    """chunkflow's generation (the transformer streamed, the VAE tiled as planned) against AllegroPipeline from the
    same folder with vae.enable_tiling(): the same frames, bit for bit."""
    import diffusers

    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline

    spec = derived(allegro, **WORK)
    with one_thread():
        built = build_pipeline(spec, {"transformer": "stream"}, STREAM, torch.device("cpu"), weights=allegro,
                               vae_tiling=True)
        try:
            gen = generate(built, spec.default_workload, PROMPT, steps=2, seed=3)
        finally:
            built.discard()
        pipe = diffusers.AllegroPipeline.from_pretrained(allegro, torch_dtype=torch.bfloat16)
        pipe.vae.to(torch.float32)
        pipe.vae.enable_tiling()
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            want = pipe(prompt=PROMPT, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(3),
                        height=32, width=32, num_frames=5, guidance_scale=spec.pipeline.guidance,
                        output_type="np").frames
    assert np.array_equal(np.asarray(gen.output), np.asarray(want)[0]), "chunkflow's frames differ from diffusers'"


def test_a_build_asked_for_no_tiling_still_tiles_a_vae_that_only_tiles(allegro):
    """Every way in (a session, the API, a plan file edited by hand) builds through build_pipeline: asked for no
    tiling, it still turns tiling on for such a VAE, so no path reaches the decode that raises."""
    from chunkflow.models.pipeline_build import build_pipeline

    built = build_pipeline(derived(allegro, **WORK), {"transformer": "stream"}, STREAM, torch.device("cpu"),
                           weights=allegro, vae_tiling=False)
    try:
        assert built.pipe.vae.use_tiling
    finally:
        built.discard()
