"""diffusers' own context-parallel pipeline, the reference for chunkflow's SP generation (issue 42): run under
torchrun, every rank loads the folder with `from_pretrained` in chunkflow's dtypes onto its own GPU (or the CPU),
turns on Ulysses context parallelism on the transformer (`enable_parallelism(config=ContextParallelConfig(
ulysses_degree=WORLD))`), and calls the pipeline as `chunkflow run --plan P --prompt ...` calls it (the same keyword
arguments, the same seeded generator on the same device); rank 0 saves the denoising loop's last latents.

    torchrun --nproc-per-node 2 scripts/diffusers_cp.py PLAN.json FOLDER OUT.safetensors --prompt "..." [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan")
    ap.add_argument("folder")
    ap.add_argument("out")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import diffusers
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from safetensors.torch import save_file

    from chunkflow.generate import call_kwargs
    from chunkflow.parallel import _accelerators, _cpu_resolver
    from chunkflow_planner.plan import load_plan, model_of

    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    plan = load_plan(Path(a.plan))
    spec, w = model_of(plan), plan.workload.to_workload()
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    t0 = time.perf_counter()
    pipe = getattr(diffusers, spec.pipeline.cls).from_pretrained(a.folder, torch_dtype=dtypes).to(device)
    pipe.set_progress_bar_config(disable=True)
    t = pipe.transformer
    if not cuda:
        assert _accelerators() == 0
        t._resolve_parallel_config = _cpu_resolver(t)  # the CPU's resolve; the rest is diffusers' own
    t.enable_parallelism(config=ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    if not cuda:
        del t._resolve_parallel_config
    seen = {}

    def keep(p, i, step, kw):
        seen["latents"] = kw["latents"].detach().clone()
        return kw

    generator = torch.Generator(device=device).manual_seed(a.seed)
    kwargs = call_kwargs(spec, w, a.prompt, a.negative_prompt, None, w.steps, generator, type(pipe))
    kwargs.update(output_type="latent", callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"])
    loaded = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    with torch.no_grad():
        pipe(**kwargs)
    if cuda:
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        save_file({"latents": seen["latents"].contiguous().cpu()}, a.out)
        print(f"diffusers context parallel x{dist.get_world_size()}: loaded in {loaded:.1f} s, generated in "
              f"{time.perf_counter() - t1:.2f} s; latents to {a.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
