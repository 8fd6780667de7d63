#!/usr/bin/env python
"""GPU evidence for the planner's accuracy (issue 5), on one GPU:

1. `chunkflow calibrate` (the same code path, model wan2.2) -> profile.yaml (+ calibration.json, raw numbers);
2. with that profile, plan and run Wan2.2-TI2V-5B at 41/81/121 frames (704x1280), FLUX.1-dev at batch 1/4/8
   (1024x1024) and HunyuanVideo at 9/21/33 frames (720x1280) in modes none, layerwise and chunkflow (C=16MB,
   r=0) through `chunkflow run`'s code path in-process: each model built ONCE (random bf16 weights), 1 warm-up
   and 3 timed denoising steps per point, cfg_passes = 1 (one forward per step, to save time; the planner
   predicts for the same workload, so the comparison is like for like);
3. reports.jsonl (one `chunkflow run` RunReport per point; `chunkflow calibrate --from-report` reads it),
   accuracy.md (the table of relative errors, GPU/date/command in the header), log.txt; the table is printed last.

    python scripts/gpu_planner_accuracy.py --out DIR      # one H200: about 5-8 minutes
    python scripts/gpu_planner_accuracy.py --quick        # tiny-wan on the CPU: a smoke test of the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

T0 = time.perf_counter()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.perf_counter() - T0:7.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


POINTS = [  # (model, axis, values, height, width)
    ("Wan2.2-TI2V-5B", "frames", [41, 81, 121], 704, 1280),
    ("FLUX.1-dev", "batch", [1, 4, 8], 1024, 1024),
    ("HunyuanVideo", "frames", [9, 21, 33], 720, 1280),
]
QUICK_POINTS = [("tiny-wan", "frames", [5, 9], 64, 64)]
MODES = [("none", None, 1.0), ("layerwise", None, 0.0), ("chunkflow", 16 * 10**6, 0.0)]
QUICK_MODES = [("none", None, 1.0), ("layerwise", None, 0.0), ("chunkflow", 4000, 0.0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"))
    ap.add_argument("--quick", action="store_true", help="tiny-wan on the CPU (smoke test of this script)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    import chunkflow
    from chunkflow.calibrate import calibrate, write_profile
    from chunkflow.models.build import build_transformer
    from chunkflow.models.inputs import make_inputs
    from chunkflow.run import RunConfig, denoise, environment, make_report, measured_of, predict
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.planner import ResolvedHardware, make_plan
    from chunkflow_planner.workload import make_workload

    if not args.quick and not torch.cuda.is_available():
        print("CUDA is not available; run with --quick for the CPU smoke test", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu") if args.quick else torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    env["command"] = " ".join([Path(sys.executable).name] + sys.argv)
    log(f"{env}")

    # 1. calibrate
    cal = calibrate("wan2.2,flux,hunyuan", cpu_smoke=args.quick, log=log)  # a curve per model
    hw = cal.profile
    write_profile(hw, out / "profile.yaml", f"scripts/gpu_planner_accuracy.py, {env['date']}, {env['gpu']}")
    (out / "calibration.json").write_text(json.dumps(cal.raw, indent=2, default=str) + "\n")
    log(f"profile: eta_comp {hw.eta_comp:.3f} curve {hw.eta_comp_curve}, H2D {hw.h2d_link_gbps:.2f} GB/s, "
        f"t0 {hw.dma_startup_us:.2f} us")
    resolved = ResolvedHardware(hw, f"profile:{out / 'profile.yaml'}")

    # 2. plan and run every point
    rows = []
    jsonl = (out / "reports.jsonl").open("w")
    for name, axis, values, height, width in (QUICK_POINTS if args.quick else POINTS):
        spec = get_model(name)
        t1 = time.perf_counter()
        model, h0 = build_transformer(spec, weights=None, dtype=torch.bfloat16, device=device, mode="none")
        h0.remove()
        log(f"built {name} in {time.perf_counter() - t1:.1f} s")
        works = []
        for v in values:
            kw = dict(frames=v) if axis == "frames" else dict(batch=v)
            w = make_workload(spec, height=height, width=width, steps=args.warmup + args.steps, cfg_passes=1, **kw)
            plan, _, _ = make_plan(spec, w, resolved)
            works.append((v, w, plan))
        for mode, chunk, res in (QUICK_MODES if args.quick else MODES):
            t1 = time.perf_counter()
            handle = chunkflow.offload(model, mode=mode, chunk_size=chunk or "16MB", residency=res, device=device)
            log(f"{name}: offload {mode} in {time.perf_counter() - t1:.1f} s")
            try:
                for v, w, plan in works:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    inputs = make_inputs(spec, w, torch.bfloat16, device, seed=0)
                    timing = denoise(model, spec, w, inputs, device, args.warmup, args.steps)
                    del inputs
                    stats = handle.stats().as_dict()
                    cfg = RunConfig(mode=mode, chunk_bytes=chunk, residency=res, device=str(device),
                                    dtype="torch.bfloat16", warmup=args.warmup, steps=args.steps)
                    rep = make_report(env, plan, cfg, hw, measured_of(timing, stats),
                                      predict(spec, w, hw, mode, chunk, res), stats)
                    jsonl.write(rep.model_dump_json() + "\n")
                    jsonl.flush()
                    rows.append((name, axis, v, rep))
                    e = rep.rel_error
                    log(f"{name} {axis}={v} {mode}: {rep.measured.median_step_s:.4f} s vs {rep.predicted.step_time_s:.4f} s "
                        f"({e.step_time:+.1%}); peak {(rep.measured.peak_allocated_bytes or 0) / 1e9:.2f} GB vs "
                        f"{rep.predicted.peak_memory_bytes / 1e9:.2f} GB"
                        + (f" ({e.peak_memory:+.1%})" if e.peak_memory is not None else ""))
            finally:
                handle.remove()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    jsonl.close()

    # 3. the table
    def pct(x):
        return "-" if x is None else f"{x:+.1%}"

    lines = [
        "# Planner accuracy: measured vs predicted step time and peak memory", "",
        f"GPU: {env['gpu']}; date: {env['date']}; torch {env['torch']}, diffusers {env['diffusers']}; "
        f"command: `{env['command']}`.", "",
        f"Profile: calibrated in the same run (profile.yaml): eta_comp {hw.eta_comp:.3f} (curve of "
        f"{len(hw.eta_comp_curve or [])} points), H2D {hw.h2d_link_gbps:.2f} GB/s + {hw.dma_startup_us:.2f} us per copy, "
        f"eta_pref {hw.eta_pref:g}. Random bf16 weights, one forward per step (cfg_passes = 1, to save time), "
        f"{args.warmup} warm-up + {args.steps} timed denoising steps (FlowMatchEulerDiscreteScheduler), median, "
        f"{'CUDA events' if device.type == 'cuda' else 'perf_counter'}; peak = torch max_memory_allocated over the "
        f"timed steps; chunkflow C = {(QUICK_MODES if args.quick else MODES)[2][1] / 1e6:g} MB, r = 0.", "",
        "| model | workload | mode | step measured (s) | predicted (s) | error | peak measured (GB) | predicted (GB) | error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst_t, worst_m = 0.0, 0.0
    for name, axis, v, r in rows:
        pm = r.measured.peak_allocated_bytes
        lines.append(f"| {name} | {axis} {v} | {r.run.mode} | {r.measured.median_step_s:.4f} | "
                     f"{r.predicted.step_time_s:.4f} | {pct(r.rel_error.step_time)} | "
                     f"{'-' if pm is None else f'{pm / 1e9:.2f}'} | {r.predicted.peak_memory_bytes / 1e9:.2f} | "
                     f"{pct(r.rel_error.peak_memory)} |")
        worst_t = max(worst_t, abs(r.rel_error.step_time))
        worst_m = max(worst_m, abs(r.rel_error.peak_memory or 0.0))
    lines += ["", f"Largest |error|: step time {worst_t:.1%}, peak memory {worst_m:.1%} (goal: 10% each).",
              f"Total wall time {time.perf_counter() - T0:.0f} s."]
    table = "\n".join(lines) + "\n"
    (out / "accuracy.md").write_text(table)
    (out / "log.txt").write_text("\n".join(LOG) + "\n")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
