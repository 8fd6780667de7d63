"""How often diffusers' first-block cache computes at each threshold, on a saved pipeline all on the GPU.

    python3 docs/data/gpu-cache/probe.py PLAN.json FOLDER --out probe.json [--thresholds 0.1,0.3,0.6,0.8]

The evidence pipelines hold random values, where a threshold skips far more or fewer steps than on trained weights:
the evidence script runs first-block caching at the threshold this probe finds nearest to the planner's prior hit rate
(stepcache.CACHE_PRIOR_HIT_RATE) among those that skip at all (on one H100, 0.1 and 0.3 skipped no step of FLUX's 28
and 0.6 skipped 86% of them: run-1-h100/probe-flux.json), so that the cache skips steps and some compute, and plans
it with the hit rate measured here (`plan --cache-hit-rate`: the calibration of the cache on the user's model the issue names): the share
of the transformer's forwards (each guidance pass of each step) that skipped its blocks, as `run` reports it.
Computed forwards are counted as the calls of the second block's first child module (a skipped block runs none of its
modules); the pipeline is called as `chunkflow run` and scripts/diffusers_load.py call it
(chunkflow.generate.call_kwargs, the plan's workload).
"""

from __future__ import annotations

import argparse
import json

import diffusers
import torch
from diffusers.hooks import FirstBlockCacheConfig

from chunkflow.generate import call_kwargs
from chunkflow.models.adapters import find_blocks
from chunkflow_planner.plan import load_plan, model_of
from chunkflow_planner.stepcache import CACHE_PRIOR_HIT_RATE


def computed_share(pipe, threshold: float, kw: dict, seed: int, device: str) -> float:
    """The share of the transformer's forwards (each guidance pass of each step) that ran its second block under
    FirstBlockCacheConfig(threshold): 1 - the hit rate, as `chunkflow run` reports it (measured_hit_rate)."""
    block = find_blocks(pipe.transformer)[1]
    calls: list[int] = []
    forwards: list[int] = []
    hooks = [next(block.children()).register_forward_pre_hook(lambda m, args: calls.append(1)),
             pipe.transformer.register_forward_pre_hook(lambda m, args: forwards.append(1))]
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        with torch.no_grad():
            pipe(**kw, generator=torch.Generator(device).manual_seed(seed))
    finally:
        pipe.transformer.disable_cache()
        for h in hooks:
            h.remove()
    return len(calls) / len(forwards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="the plan whose workload (steps, resolution) the runs make")
    ap.add_argument("folder")
    ap.add_argument("--prompt", default="a red fox in the snow")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thresholds", default="0.1,0.3,0.6,0.8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    plan = load_plan(a.plan)
    spec, w = model_of(plan), plan.workload.to_workload()
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = getattr(diffusers, spec.pipeline.cls).from_pretrained(a.folder, torch_dtype=dtypes).to(a.device)
    pipe.set_progress_bar_config(disable=True)
    kw = call_kwargs(spec, w, a.prompt, None, None, w.steps, None, type(pipe), None)
    kw.pop("generator", None)
    kw["output_type"] = "latent"
    found = {t: computed_share(pipe, t, kw, a.seed, a.device) for t in map(float, a.thresholds.split(","))}
    target = 1 - CACHE_PRIOR_HIT_RATE[0]
    skipping = {t: share for t, share in found.items() if share < 1} or found  # a threshold that skips nothing tells
    chosen = min(skipping, key=lambda t: (abs(skipping[t] - target), t))       # nothing of the cache's streaming
    with open(a.out, "w") as f:
        json.dump({"steps": w.steps, "computed_share": found, "chosen": chosen, "target_computed_share": target,
                   "hit_rate": 1 - found[chosen]}, f, indent=1)
    print(f"first-block threshold {chosen:g}: {100 * found[chosen]:.0f}% of forwards computed ({found})")


if __name__ == "__main__":
    main()
