"""The README's commands: the test command is the one CI runs, the main job runs and visibly streams, every plan
command it shows runs as written on any machine, and its Python snippet's calls work (on the CPU, the tiny
pipeline standing in for the 14B one)."""

import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README
    assert "pytest" in ci and "torch==2.13.0" in ci


def test_the_readme_main_job_runs_and_streams(cli, workdir):
    """The README's first command on a fresh machine, after its install: plan the demo pipeline under the small
    budget it gives, then generate from the prompt; both exit 0, write what they say, and the transformer's blocks
    were streamed from host memory (the run says how many and how many bytes a step)."""
    line = next(x for x in README.splitlines() if "chunkflow plan --model demo" in x and "&&" in x)
    steps = [shlex.split(part.strip()) for part in line.split("&&") if "bin/chunkflow " in part]
    assert [s[1] for s in steps] == ["plan", "run"]
    outputs = []
    for step in steps:
        result = cli(*step[1:])
        assert result.exit_code == 0, result.output
        outputs.append(" ".join(result.output.split()))
    plan = json.loads((workdir / "plan.json").read_text())
    assert plan["offload"]["mode"] == "chunkflow"
    assert {c["name"]: c["placement"] for c in plan["pipeline"]["components"]}["transformer"] == "stream"
    out = next(s[s.index("--out") + 1] for s in steps if s[1] == "run")
    assert (workdir / out).stat().st_size > 0
    stats = json.loads((workdir / "run-report.json").read_text())["stats"]
    assert stats["n_streamed_blocks"] == stats["n_blocks"] > 0 and stats["h2d_bytes_issued"] > 0
    assert "blocks streamed from host memory" in outputs[1] and "the weights are random, so the output is" in outputs[1]


def _plan_lines() -> list[str]:
    """Every `chunkflow plan` command in the README's code blocks that runs anywhere (no --weights: those need the
    checkpoint), joined over its continuation lines."""
    lines, block, cur = [], False, ""
    for raw in README.splitlines():
        if raw.startswith("```"):
            block = not block
            continue
        if not block:
            continue
        text = raw.split("#")[0].rstrip() if not raw.strip().startswith("python") else ""
        cur = cur + " " + text.rstrip("\\").strip() if cur else text.rstrip("\\").strip()
        if text.endswith("\\"):
            continue
        if cur.startswith("chunkflow plan ") and "--weights" not in cur:
            lines.append(cur)
        cur = ""
    return lines


def test_the_readme_has_plan_commands():
    assert len(_plan_lines()) >= 1


@pytest.mark.parametrize("line", _plan_lines())
def test_every_readme_plan_command_runs_as_written(cli, workdir, line):
    args = shlex.split(line)[1:]
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert all(len(x) <= 100 for x in result.output.splitlines()), "wider than 100 columns"


def test_the_readme_python_snippet_works_on_the_cpu(tmp_path):
    """The snippet's calls, on the CPU with the tiny catalog pipeline saved as a folder: the transformer offloaded
    (and a text encoder parked), the pipeline's output unchanged, stats, remove()."""
    import torch

    import chunkflow
    from pipelines import one_thread, save_catalog_pipeline
    from diffusers import WanPipeline

    folder = save_catalog_pipeline("tiny", tmp_path / "tiny")
    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(num_frames=5, height=64, width=64, num_inference_steps=2, output_type="latent", max_sequence_length=8)
    with one_thread():
        ref = pipe("a red fox in snow", generator=torch.Generator().manual_seed(0), **kw).frames
    handle = chunkflow.offload(pipe.transformer, mode="chunkflow", chunk_size="16MB", residency=0.0, device="cpu")
    te = chunkflow.offload(pipe.text_encoder, "none", device="cpu")
    te.park()
    with one_thread():
        video = pipe("a red fox in snow", generator=torch.Generator().manual_seed(0), **kw).frames
    assert torch.equal(video, ref)
    assert handle.stats().n_streamed_blocks > 0
    handle.remove()
    te.remove()
