"""The operator model's price of one block, operator by operator, for each plan-*.json of a run folder, beside the
measured median step of its report-*.json files: which term of the step-time model a miss sits in.

    PYTHONPATH=src python docs/data/gpu-firstgen/step_breakdown.py docs/data/gpu-firstgen/run-3
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

from chunkflow_planner.catalog import ModelSpec, load_profile
from chunkflow_planner.flops import F_kind
from chunkflow_planner.ops import block_ops, split
from chunkflow_planner.workload import Workload, per_forward


def main(run: Path) -> None:
    hw = load_profile(run / "profile.yaml")
    P = hw.peak_tflops * 1e12
    for plan_path in sorted(run.glob("plan-*.json")):
        name = plan_path.stem[len("plan-"):]
        plan = json.loads(plan_path.read_text())
        spec = ModelSpec.model_validate(plan["model"]["spec"])
        w = plan["workload"]
        work = Workload.model_validate({k: v for k, v in w.items() if k != "tokens"})
        B = per_forward(work, bool(plan["offload"].get("cfg_batched")))[0].batch
        medians = [json.loads(Path(p).read_text())["measured"]["median_step_s"]
                   for p in sorted(glob.glob(str(run / f"report-*-{name}.json")))]
        F_step = t_flops = t_mem = 0.0
        for g in spec.blocks:
            flops_t, mem_t = split(block_ops(spec, g, B, w["tokens"], spec.text_len), hw)
            t_flops, t_mem = t_flops + g.count * flops_t, t_mem + g.count * hw.mem_ops_scale * mem_t
            F_step += g.count * F_kind(g.kind, B, w["tokens"], spec.text_len, spec.d, spec.f)
        planned = plan["prediction"]["step_time_s"]
        print(f"{name}: archs {sorted({g.arch for g in spec.blocks})}, {F_step:.4g} FLOP a step (batch {B})")
        print(f"  planned {planned * 1e3:.1f} ms (eta {F_step / planned / P:.3f}); operators: GEMM+attention "
              f"{t_flops * 1e3:.1f} ms, memory passes {t_mem * 1e3:.1f} ms (mem_ops_scale {hw.mem_ops_scale:.2f})")
        if medians:
            m = statistics.median(medians)
            print(f"  measured {m * 1e3:.1f} ms ({len(medians)} runs, eta {F_step / m / P:.3f}, "
                  f"{(m - planned) / planned:+.1%}); left for memory passes {(m - t_flops) * 1e3:.1f} ms = "
                  f"{(m - t_flops) / t_mem:.2f} of their price")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
