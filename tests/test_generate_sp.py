"""`torchrun --nproc-per-node 2 -m chunkflow run --plan P --prompt ... --weights DIR`: the whole generation under
Ulysses sequence parallelism, on two gloo processes (issue 40, generation half). On the tiny Wan (video) and FLUX
(image) pipelines saved with save_pretrained:

* the run exits 0, rank 0 alone writes the output, the latents and the report (every file any rank opens for writing
  or renames into place is recorded by an audit hook, `sitecustomize` below), and prints the tables once; the report
  says SP=2;
* its latents equal those of one process (`chunkflow run`, same plan and seed) and those of diffusers' own
  context-parallel pipeline (the same folder with `from_pretrained`, `transformer.enable_parallelism(config=
  ContextParallelConfig(ulysses_degree=2))`, the same seeded CPU generator and call), run by this file under torchrun.

Tolerance: bit for bit, both. Against diffusers' own context parallelism: the same modules, weights, hooks and
kernels on the same values, so nothing may differ. Against one process: not guaranteed in general (Ulysses runs
every linear layer over half the rows and attention over half the heads, so GEMM blocking may round differently;
tests/test_parallel.py allows 1e-5 in fp32), but measured equal here on these bf16 pipelines: the tiny GEMMs are
computed row by row the same way whatever the number of rows. Should a torch build round them differently, the
bound to fall back to is bf16's: 2**-7 relative to the latents' scale (one ulp of bf16 at that scale, twice). We
assert the exact equality we measured and say in the message which bound a failure would still meet.

A plan made for one process (the CPU plans here: the planner's --sp 2 needs two GPUs and plans the transformer
alone) is run with 2 processes: the run says so and goes on with SP=2. A plan made with `--sp 2` (no pipeline
section on this branch: the other components for their phase only, the guidance passes batched) runs too.

Bad input under torchrun (a missing --weights folder) stops both ranks quickly with exit 2, rank 0 saying why on
stderr, rank 1 silent, neither with a traceback: the two ranks are started here as torchrun starts them (its
environment variables), so that each one's exit status and output can be told apart; and once through torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import one_thread

pytest.importorskip("diffusers")

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
PROMPT, NEGATIVE = "a red fox in the snow", "blurry, low quality"
SEED = 5
MODELS = {"tiny": "x.mp4", "tiny-flux": "x.png"}  # a video and an image model of the tiny catalog

# Records every path under the working directory a process opens for writing or renames into place, in
# $CHUNKFLOW_TEST_WRITES/writes-RANK.txt (the log opened before the hook, so its own writes are not seen).
SITECUSTOMIZE = '''
import os, sys
_dir = os.environ.get("CHUNKFLOW_TEST_WRITES")
if _dir:
    _root = os.path.realpath(os.getcwd())
    _log = open(os.path.join(_dir, "writes-%s.txt" % os.environ.get("RANK", "x")), "a", buffering=1)

    def _seen(path):
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if isinstance(path, str):
            full = os.path.realpath(path)
            if full.startswith(_root + os.sep):
                _log.write(os.path.relpath(full, _root) + "\\n")

    def _hook(event, args):
        if event == "open":
            path, mode, flags = args
            if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & (os.O_WRONLY | os.O_RDWR)):
                _seen(path)
        elif event == "os.rename":
            _seen(args[1])

    sys.addaudithook(_hook)
'''


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    with one_thread():
        return {name: save_catalog_pipeline(name, root / name, 3) for name in MODELS}


def _plan(cli, name: str, *extra) -> Path:
    result = cli("plan", "--model", name, "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json",
                 *extra)
    assert result.exit_code == 0, result.output
    return Path("plan.json").resolve()


def _latents(path) -> "torch.Tensor":  # noqa: F821
    from safetensors.torch import load_file

    return load_file(str(path))["latents"]


def _same(sp, ref, what: str) -> None:
    """Bit for bit (the module docstring); the message gives the largest difference against bf16's bound."""
    import torch

    assert sp.shape == ref.shape and sp.dtype == ref.dtype, (sp.shape, sp.dtype, ref.shape, ref.dtype)
    diff = (sp.float() - ref.float()).abs().max().item()
    bound = 2**-7 * ref.float().abs().max().item()
    assert torch.equal(sp, ref), f"SP latents differ from {what}'s by up to {diff:.3g} (bf16's bound: {bound:.3g})"


def _diffusers_cp(torchrun, name: str, folder: Path, out: Path) -> None:
    """This file's worker under torchrun: diffusers' own context-parallel pipeline's last latents, to `out`."""
    torchrun(2, [str(Path(__file__)), "reference", name, str(folder), str(out)], timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_sp_generation_is_one_process_and_diffusers_context_parallel(cli, workdir, saved, torchrun, monkeypatch,
                                                                     name):
    plan = _plan(cli, name)
    neg = ["--negative-prompt", NEGATIVE] if name == "tiny" else []  # FLUX takes none
    with one_thread():
        one = cli("run", "--plan", plan, "--weights", saved[name], "--device", "cpu", "--prompt", PROMPT, *neg,
                  "--seed", SEED, "--latents", "one.safetensors", "--report", "one.json")
    assert one.exit_code == 0, one.output
    hooks = workdir / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    Path("sp").mkdir()
    out = f"sp/{MODELS[name]}"
    t0 = time.monotonic()
    p = torchrun(2, ["-m", "chunkflow", "run", "--plan", str(plan), "--weights", str(saved[name]), "--prompt", PROMPT,
                     *neg, "--seed", str(SEED), "--out", out, "--latents", "sp/lat.safetensors", "--report",
                     "sp/report.json"], timeout=120, CHUNKFLOW_TEST_WRITES=str(hooks))
    assert time.monotonic() - t0 < 60
    # rank 0 alone wrote, and exactly the output, the latents and the report (each through a temporary file)
    written = {rank: set((hooks / f"writes-{rank}.txt").read_text().split()) for rank in (0, 1)}
    assert written[1] == set(), written[1]
    assert {out, "sp/lat.safetensors", "sp/report.json"} <= written[0]
    assert {f.name for f in Path("sp").iterdir()} == {Path(out).name, "lat.safetensors", "report.json"}
    # rank 0 printed the tables once; the note on the plan's SP degree is said once
    assert p.stdout.count("Run report written to") == 1 and p.stdout.count(f"Written: {out}") == 1
    assert "sequence parallel over 2 processes" in " ".join(p.stdout.split())
    assert p.stderr.count("the plan is for SP=1, this run has 2 processes") == 1
    assert "Traceback" not in p.stderr and "error:" not in p.stderr
    report = json.loads(Path("sp/report.json").read_text())
    assert report["run"]["sp_degree"] == 2 and report["run"]["world_size"] == 2
    assert set(report["generation"]["phases"]) == {"encode", "denoise", "decode"}
    assert all(ph["measured_time_s"] > 0 for ph in report["generation"]["phases"].values())
    assert json.loads(Path("one.json").read_text())["run"]["sp_degree"] == 1

    sp = _latents("sp/lat.safetensors")
    _same(sp, _latents("one.safetensors"), "one process")
    _diffusers_cp(torchrun, name, saved[name], workdir / "diffusers.safetensors")
    _same(sp, _latents(workdir / "diffusers.safetensors"), "diffusers' context-parallel pipeline")


@pytest.mark.slow
def test_an_sp_plan_runs_with_its_degree_and_batched_guidance(cli, workdir, saved, torchrun):
    """A plan made with --sp 2 (for two GPUs; on this branch without a pipeline section): no note on the degree,
    the guidance passes batched through diffusers' context-parallel hooks, the latents one process's."""
    result = cli("plan", "--model", "tiny", "--hardware", "h200-x2", "--sp", "2", "--out", "sp.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("sp.json").read_text())
    assert plan["parallel"]["sp_degree"] == 2 and plan["offload"]["cfg_batched"]
    with one_thread():
        one = cli("run", "--plan", "sp.json", "--weights", saved["tiny"], "--device", "cpu", "--prompt", PROMPT,
                  "--seed", SEED, "--latents", "one.safetensors", "--report", "one.json")
    assert one.exit_code == 0, one.output
    p = torchrun(2, ["-m", "chunkflow", "run", "--plan", "sp.json", "--weights", str(saved["tiny"]), "--prompt",
                     PROMPT, "--seed", str(SEED), "--out", "x.mp4", "--latents", "lat.safetensors", "--report",
                     "r.json", "--warmup", "1", "--repeat", "2"], timeout=120)
    assert "the plan is for SP" not in p.stderr
    report = json.loads(Path("r.json").read_text())
    assert report["run"]["sp_degree"] == 2 and report["generation"]["measured_generations"] == 2
    _same(_latents("lat.safetensors"), _latents("one.safetensors"), "one process")


# Logs every batch_cfg's counts when it is removed (once a generation), in $CHUNKFLOW_TEST_CFG/cfg-RANK.txt.
CFG_SITECUSTOMIZE = '''
import os
_dir = os.environ.get("CHUNKFLOW_TEST_CFG")
if _dir:
    import chunkflow.cfg as _cfg

    _remove = _cfg.CfgBatching.remove

    def _logged(self):
        if not self._removed:
            with open(os.path.join(_dir, "cfg-%s.txt" % os.environ.get("RANK", "x")), "a") as f:
                s = self.stats
                f.write("%d %d %d\\n" % (s.batched_forwards, s.served, s.unbatched))
        _remove(self)

    _cfg.CfgBatching.remove = _logged
'''


@pytest.mark.slow
def test_the_demo_plan_batches_its_guidance_passes_under_torchrun(cli, workdir, torchrun, monkeypatch):
    """Issue 51: the README's demo plan (the planner chose the guidance passes batched; the transformer streamed,
    so it sits parked, with chunkflow's execution-device marker in `_hf_hook`, when the generation begins) under
    torchrun stopped with "runs under accelerate's hook (ExecutionDevice ...)": no accelerate hook was there, only
    diffusers' context-parallel hooks, which batch_cfg goes through. Now both ranks batch every step's two passes
    (counted on each rank) and the latents are bit for bit those of one process with the same plan, of the same
    ranks with the passes unbatched, and of diffusers' own context-parallel pipeline (unbatched)."""
    from pipelines import save_catalog_pipeline

    with one_thread():
        folder = save_catalog_pipeline("demo", workdir / "demo", 3)
    result = cli("plan", "--model", "demo", "--hardware", "cpu", "--mem-budget", "7MB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("plan.json").read_text())
    assert plan["offload"]["cfg_batched"] and plan["offload"]["mode"] == "chunkflow"
    common = ["--plan", "plan.json", "--weights", str(folder), "--device", "cpu", "--prompt", PROMPT,
              "--negative-prompt", NEGATIVE, "--seed", str(SEED)]
    with one_thread():
        one = cli("run", *common, "--latents", "one.safetensors", "--report", "one.json")
    assert one.exit_code == 0, one.output
    hooks = workdir / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(CFG_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    steps = plan["workload"]["steps"]
    for batched in (True, False):
        logs = workdir / f"cfg-{batched}"
        logs.mkdir()
        flag = "--cfg-batched" if batched else "--no-cfg-batched"
        p = torchrun(2, ["-m", "chunkflow", "run", *common, flag, "--out", f"{batched}.mp4", "--latents",
                         f"{batched}.safetensors", "--report", f"{batched}.json"], timeout=120,
                     CHUNKFLOW_TEST_CFG=str(logs))
        assert "accelerate's hook" not in p.stdout + p.stderr and "error:" not in p.stderr
        report = json.loads(Path(f"{batched}.json").read_text())
        assert report["run"]["sp_degree"] == 2 and report["run"]["offload"]["cfg_batched"] is batched
        counts = {r: (logs / f"cfg-{r}.txt").read_text().split() if batched else None for r in (0, 1)}
        if batched:  # one batched forward a step on each rank, its other half served, nothing run alone
            assert counts == {r: [str(steps), str(steps), "0"] for r in (0, 1)}, counts
        else:
            assert not any(logs.iterdir())
    sp = _latents("True.safetensors")
    _same(sp, _latents("one.safetensors"), "one process (batched)")
    _same(sp, _latents("False.safetensors"), "the same ranks unbatched")
    _diffusers_cp(torchrun, "demo", folder, workdir / "diffusers.safetensors")
    _same(sp, _latents(workdir / "diffusers.safetensors"), "diffusers' context-parallel pipeline")


# ------------------------------------------------------------------------------------------------ bad input


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_bad_input_stops_both_ranks_quickly_and_rank_0_says_why(cli, workdir, torchrun):
    plan = _plan(cli, "tiny")
    args = ["-m", "chunkflow", "run", "--plan", str(plan), "--weights", str(workdir / "nowhere"), "--prompt", PROMPT,
            "--out", "x.mp4"]
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, *args], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    said = [proc.communicate(timeout=60) for proc in procs]
    assert time.monotonic() - t0 < 30
    assert [proc.returncode for proc in procs] == [2, 2], said
    (out0, err0), (out1, err1) = said
    assert "error:" in err0 and "nowhere" in err0 and "Traceback" not in err0 + out0
    assert out1 + err1 == ""  # the other rank: nothing (rank 0 said it)
    assert not Path("x.mp4").exists()
    # the same through torchrun: non-zero, the message once
    pytest.importorskip("diffusers")
    p = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                        *args], env=dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1",
                                         CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and p.stderr.count("error:") == 1 and "nowhere" in p.stderr
    assert "chunkflow/" not in p.stderr  # torchrun's own report of the failed ranks, no frame of chunkflow's


def test_prompts_under_torchrun_is_refused_before_anything_runs(cli, workdir, monkeypatch):
    """--prompts is another code path (a session of jobs): under torchrun it is refused, with what to do."""
    plan = _plan(cli, "tiny")
    Path("jobs.txt").write_text("a cat\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("chunkflow.commands.ranks.together", lambda step: step())  # one process: no job to join
    result = cli("run", "--plan", plan, "--prompts", "jobs.txt")
    assert result.exit_code == 2 and "leave torchrun out" in result.output
    assert "run each prompt with --prompt under torchrun" in " ".join(result.output.split())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("cache", ["mag:ratios=flux", "taylorseer:2,lite", "first-block:0.8"])
def test_a_cache_every_rank_decides_alike_runs_under_torchrun_as_in_one_process(cli, workdir, saved, torchrun, cache, name):
    """A cache whose schedule follows from its setting and the steps (stepcache.schedule_known) decides the same on
    both ranks, and first-block caching does from its measure summed over the ranks (chunkflow/cache_ranks.py): the
    SP run skips the blocks one process skips, and its latents are one process's, bit for bit. On
    Wan the token split is a hook on the first block, where MagCache's head hook sits too (FLUX splits at the whole
    model): the cache is enabled before sequence parallelism, so the split wraps it and it sees each rank's share."""
    plan = _plan(cli, name, "--steps", "8")
    args = ["--plan", str(plan), "--weights", str(saved[name]), "--prompt", PROMPT, "--seed", str(SEED),
            "--cache", cache]
    with one_thread():
        one = cli("run", *args, "--device", "cpu", "--latents", "one.safetensors", "--report", "one.json")
    assert one.exit_code == 0, one.output
    p = torchrun(2, ["-m", "chunkflow", "run", *args, "--out", MODELS[name], "--latents", "sp.safetensors",
                     "--report", "sp.json"], timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    sp, ref = (json.loads(Path(f).read_text()) for f in ("sp.json", "one.json"))
    assert sp["run"]["sp_degree"] == 2
    got, want = sp["generation"]["cache"], ref["generation"]["cache"]
    assert want["blocks_skipped"] > 0 and 0 < want["forwards_skipped"] < want["forwards"]
    assert {k: got[k] for k in ("label", "blocks_skipped", "skipped_per_forward", "forwards_skipped")} == \
        {k: want[k] for k in ("label", "blocks_skipped", "skipped_per_forward", "forwards_skipped")}
    _same(_latents("sp.safetensors"), _latents("one.safetensors"), f"one process with --cache {cache}")


@pytest.mark.parametrize("cache", ["sea:0.3", "mag:calibrate"])
def test_a_cache_deciding_from_the_data_is_refused_under_torchrun_before_the_load(cli, workdir, monkeypatch, cache):
    """Each rank holds a share of the tokens, so a cache that decides (or measures) from them could decide
    differently on each: refused in one line, with the caches that do run under torchrun, before any file is read."""
    plan = _plan(cli, "tiny-flux")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("chunkflow.commands.ranks.together", lambda step: step())  # one process: no job to join
    result = cli("run", "--plan", plan, "--weights", str(workdir / "nowhere"), "--prompt", PROMPT, "--cache", cache)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "under torchrun" in said and "from the data" in said, said
    assert "mag:ratios=" in said and "nowhere" not in said and "Traceback" not in said


# ------------------------------------------------------------------------------------------- the reference


def _reference(name: str, folder: str, out: str) -> None:
    """diffusers alone under torchrun: `from_pretrained` in chunkflow's dtypes, context parallelism on the
    transformer with `enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))` (on the CPU through
    the device-mesh resolve of chunkflow.parallel, which diffusers' divides by the accelerator count for), the call
    chunkflow makes, the seeded CPU generator; rank 0 saves the denoising loop's last latents."""
    import diffusers
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from safetensors.torch import save_file

    from chunkflow.parallel import _accelerators, _cpu_resolver
    from chunkflow_planner.catalog import get_model

    dist.init_process_group("gloo")
    spec = get_model(name)
    w = spec.default_workload
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = getattr(diffusers, spec.pipeline.cls).from_pretrained(folder, torch_dtype=dtypes)
    pipe.set_progress_bar_config(disable=True)
    t = pipe.transformer
    assert _accelerators() == 0
    t._resolve_parallel_config = _cpu_resolver(t)  # the CPU's resolve; the rest is diffusers' own
    t.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    del t._resolve_parallel_config
    seen = {}

    def keep(p, i, step, kw):
        seen["latents"] = kw["latents"].detach().clone()
        return kw

    call = dict(height=w.height, width=w.width, guidance_scale=spec.pipeline.guidance, max_sequence_length=spec.text_len)
    if spec.is_video:
        call.update(num_frames=w.frames, negative_prompt=NEGATIVE)
    torch.set_num_threads(1)
    with torch.no_grad():
        pipe(prompt=PROMPT, num_inference_steps=w.steps, generator=torch.Generator("cpu").manual_seed(SEED),
             output_type="latent", callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"], **call)
    if dist.get_rank() == 0:
        save_file({"latents": seen["latents"].contiguous()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        _reference(*sys.argv[2:5])
        # the ranks end here, their results written: without Python's finalization, where gloo's teardown has aborted
        # a rank after its work ("terminate called without an active exception", twice in CI on 2026-12-06)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
