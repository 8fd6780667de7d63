"""One transformer block of a saved pipeline, timed on the GPU and split by kernel class (GEMM, attention, the rest:
the memory-bound passes), beside the operator model's split of the same block from the pipeline's plan: which term
a step-time miss sits in (step_breakdown.py says the model's side alone). The block's inputs are the ones the
pipeline gives it: one step of the pipeline, all on the GPU, with the plan's workload (its size and guidance).

    python docs/data/gpu-firstgen/block_profile.py PLAN.json FOLDER PROFILE.yaml --out block-NAME.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from chunkflow_planner.catalog import ModelSpec, load_profile
from chunkflow_planner.ops import Attention, Gemm, block_ops, op_time, split
from chunkflow_planner.workload import Workload, per_forward

GEMM_NAMES = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "addmm", "aten::mm", "aten::bmm", "linear")
ATTENTION_NAMES = ("flash", "fmha", "attention", "attn", "cudnn")


def kernel_class(name: str) -> str:
    """'attention', 'gemm' or 'other' (elementwise, norms, reductions, copies) by the kernel's name."""
    low = name.lower()
    if any(k in low for k in ATTENTION_NAMES):
        return "attention"
    return "gemm" if any(k in low for k in GEMM_NAMES) else "other"


def block_inputs(folder: Path, plan: dict, device: str):
    """The first block and the (args, kwargs) the pipeline gives it in its first step."""
    from diffusers import DiffusionPipeline

    from chunkflow.models.adapters import find_blocks

    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device)
    block = find_blocks(pipe.transformer)[0]
    seen: list = []

    def grab(module, args, kwargs):
        if not seen:
            seen.append((args, kwargs))

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    w = plan["workload"]
    with torch.no_grad():
        pipe(prompt="a red fox in the snow", height=w["height"], width=w["width"], num_inference_steps=1,
             output_type="latent")
    handle.remove()
    return block, seen[0]


def _timed(block, args, kwargs, device: str) -> float:
    """Seconds of one call of the block (CUDA events on the GPU; the wall clock on the CPU, a dry run's)."""
    if device != "cuda":
        t0 = time.perf_counter()
        block(*args, **kwargs)
        return time.perf_counter() - t0
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    block(*args, **kwargs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def profile_block(block, args, kwargs, device: str, repeats: int = 10) -> dict:
    """Kernel time by class over `repeats` calls, and the calls' median wall time (CUDA events)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            block(*args, **kwargs)
        times = [_timed(block, args, kwargs, device) for _ in range(repeats)]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(repeats):
                block(*args, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
    by_class: dict[str, float] = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        s = evt.device_time_total / 1e6 / repeats  # a kernel: its own span, in microseconds
        by_class[kernel_class(evt.name)] += s
        kernels[evt.name] = kernels.get(evt.name, 0.0) + s
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"block_s": statistics.median(times), "kernel_s": by_class,
            "top_kernels": [{"name": n[:160], "s": s, "class": kernel_class(n)} for n, s in top]}


def seen_shape(args, kwargs) -> tuple[int, int] | None:
    """(batch, tokens) of the image stream the block was given (its `hidden_states`), None where not found."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    return (int(x.shape[0]), int(x.shape[1])) if getattr(x, "ndim", 0) == 3 else None


def model_split(plan: dict, profile: Path, seen: tuple[int, int] | None = None) -> dict:
    """The operator model's price of the plan's first block, by the same classes (`ops.split` for the memory passes
    at mem_ops_scale 1), at the batch and tokens the block was given where known (`seen`: a pipeline may round the
    size, PixArt's resolution bins), else the plan's forward's (workload.per_forward)."""
    hw = load_profile(profile)
    spec = ModelSpec.model_validate(plan["model"]["spec"])
    work = Workload.model_validate({k: v for k, v in plan["workload"].items() if k != "tokens"})
    forward, _ = per_forward(work, bool(plan["offload"].get("cfg_batched")))
    batch, tokens = seen or (forward.batch, plan["workload"]["tokens"])
    ops = block_ops(spec, spec.blocks[0], batch, tokens, spec.text_len)
    _, mem_at_scale_1 = split(ops, hw)
    return {"gemm": sum(op_time(op, hw) for op in ops if isinstance(op, Gemm)),
            "attention": sum(op_time(op, hw) for op in ops if isinstance(op, Attention)),
            "other": hw.mem_ops_scale * mem_at_scale_1, "mem_at_scale_1": mem_at_scale_1,
            "mem_ops_scale": hw.mem_ops_scale, "arch": spec.blocks[0].arch, "batch": batch, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", type=Path)
    ap.add_argument("folder", type=Path)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    plan = json.loads(a.plan.read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run (no kernels to split)
    block, (args, kwargs) = block_inputs(a.folder, plan, device)
    measured = profile_block(block, args, kwargs, device)
    modelled = model_split(plan, a.profile, seen_shape(args, kwargs))
    other = measured["kernel_s"]["other"]
    shapes = {"args": [list(getattr(x, "shape", [])) for x in args],
              "kwargs": {k: list(v.shape) for k, v in kwargs.items() if hasattr(v, "shape")}}
    result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__, "block_input_shapes": shapes,
              "block_class": type(block).__name__, "measured": measured,
              "model": modelled, "workload": plan["workload"],
              "mem_ops_scale_this_block": other / modelled["mem_at_scale_1"] if modelled["mem_at_scale_1"] else None}
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("mem_ops_scale_this_block",)} | {"measured": measured["kernel_s"],
          "block_s": measured["block_s"], "model": {k: modelled[k] for k in ("gemm", "attention", "other")}}))


if __name__ == "__main__":
    main()
