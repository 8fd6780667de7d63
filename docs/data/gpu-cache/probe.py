"""How often diffusers' first-block cache computes at each threshold, on a saved pipeline all on the GPU.

    python3 docs/data/gpu-cache/probe.py PLAN.json FOLDER --out probe.json [--thresholds 0.1,0.3,0.6,0.8 | record]

The evidence pipelines hold random values, where a threshold skips far more or fewer steps than on trained weights:
the evidence script runs first-block caching at the threshold this probe finds nearest to the planner's prior hit rate
(stepcache.CACHE_PRIOR_HIT_RATE) among those that skip at all (on one H100, 0.1 and 0.3 skipped no step of FLUX's 28
and 0.6 skipped 86% of them: run-1-h100/probe-flux.json), so that the cache skips steps and some compute, and plans
it with the hit rate measured here (`plan --cache-hit-rate`: the calibration of the cache on the user's model the issue names): the share
of the transformer's forwards (each guidance pass of each step) that skipped its blocks, as `run` reports it.
Computed forwards are counted as the calls of the second block's first child module (a skipped block runs none of its
modules); the pipeline is called as `chunkflow run` and scripts/diffusers_load.py call it
(chunkflow.generate.call_kwargs, the plan's workload).

`--thresholds record` costs one generation instead of one a threshold: every forward is computed while the cache's
own measure (the first block's residual against the last computed one's, absmean over absmean) is recorded, and the
threshold is the one whose skips, simulated on those figures, come nearest the prior's rate. Simulated: a skipped
forward's residual is not kept, so the measure after it is taken against an older one; the recorded figures between
two computed forwards are summed as the bound of that drift. The run then measures what the threshold does (Wan2.2-5B
at 704x1280 x81 skipped nothing at 0.4 and 0.6 on random weights, and the two generations of the probe cost 163 s
of an H100: run-3-h100/probe-wan.json).
"""

from __future__ import annotations

import argparse
import json

import diffusers
import torch
from diffusers.hooks import FirstBlockCacheConfig
from diffusers.hooks.first_block_cache import FBCHeadBlockHook

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


def recorded_measures(pipe, kw: dict, seed: int, device: str) -> list[list[float]]:
    """Every forward computed (threshold 0): the cache's measure of each forward after the first, in order, one
    list a cache context (a pipeline that runs guidance as two forwards keeps a state for each)."""
    found: dict[int, list[float]] = {}
    original = FBCHeadBlockHook._should_compute_remaining_blocks

    def measuring(self, residual):
        state = self.state_manager.get_state()
        seen = found.setdefault(id(state), [])
        if state.head_block_residual is not None:
            prev = state.head_block_residual
            seen.append(((residual - prev).abs().mean() / prev.abs().mean()).item())
        return True

    FBCHeadBlockHook._should_compute_remaining_blocks = measuring
    try:
        computed_share(pipe, 0.0, kw, seed, device)
    finally:
        FBCHeadBlockHook._should_compute_remaining_blocks = original
    return list(found.values())


def simulated_share(contexts: list[list[float]], threshold: float) -> float:
    """The share of forwards computed at `threshold`, simulated on measures recorded with every forward computed:
    in each context, a forward is skipped while the summed measures since its last computed one stay at or under
    the threshold (the first forward of a context is computed: it has nothing to compare with)."""
    computed = forwards = 0
    for measures in contexts:
        computed, forwards, drift = computed + 1, forwards + 1 + len(measures), 0.0
        for m in measures:
            drift += m
            if drift > threshold:
                computed, drift = computed + 1, 0.0
    return computed / forwards


def chosen_from_record(contexts: list[list[float]], target: float) -> tuple[float, float]:
    """The threshold among the recorded measures' values (and one over their sum) whose simulated computed share is
    nearest `target`, skipping at least one forward where any can: (threshold, its simulated share)."""
    every = [m for measures in contexts for m in measures]
    candidates = sorted({round(m, 4) for m in every} | {round(sum(every) + 1, 4)})
    shares = {t: simulated_share(contexts, t) for t in candidates}
    skipping = {t: v for t, v in shares.items() if v < 1} or shares
    t = min(skipping, key=lambda t: (abs(skipping[t] - target), t))
    return t, skipping[t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="the plan whose workload (steps, resolution) the runs make")
    ap.add_argument("folder")
    ap.add_argument("--prompt", default="a red fox in the snow")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thresholds", default="0.1,0.3,0.6,0.8", help="comma-separated, or `record` (module docstring)")
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
    target = 1 - CACHE_PRIOR_HIT_RATE[0]
    if a.thresholds == "record":
        measures = recorded_measures(pipe, kw, a.seed, a.device)
        chosen, share = chosen_from_record(measures, target)
        with open(a.out, "w") as f:
            json.dump({"steps": w.steps, "measures": measures, "chosen": chosen, "target_computed_share": target,
                       "simulated_computed_share": share, "hit_rate": 1 - share}, f, indent=1)
        print(f"first-block threshold {chosen:g}: {100 * share:.0f}% of forwards computed, simulated on "
              f"{sum(len(m) + 1 for m in measures)} forwards' measures")
        return
    found = {t: computed_share(pipe, t, kw, a.seed, a.device) for t in map(float, a.thresholds.split(","))}
    skipping = {t: share for t, share in found.items() if share < 1} or found  # a threshold that skips nothing tells
    chosen = min(skipping, key=lambda t: (abs(skipping[t] - target), t))       # nothing of the cache's streaming
    with open(a.out, "w") as f:
        json.dump({"steps": w.steps, "computed_share": found, "chosen": chosen, "target_computed_share": target,
                   "hit_rate": 1 - found[chosen]}, f, indent=1)
    print(f"first-block threshold {chosen:g}: {100 * found[chosen]:.0f}% of forwards computed ({found})")


if __name__ == "__main__":
    main()
