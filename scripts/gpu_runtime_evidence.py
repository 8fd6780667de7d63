#!/usr/bin/env python
"""GPU evidence for the runtime: Wan2.2-TI2V-5B (real diffusers architecture, random bf16 weights) at 704x1280,
41/81/121 frames, one forward per step, in modes none / layerwise / chunkflow (C=16MB, r=0) and diffusers group
offloading (block level, one block per group, streams). Median step time over timed forwards (CUDA events), peak
memory, pinned bytes, and whether outputs are bit-identical to `none`.

    python scripts/gpu_runtime_evidence.py --out DIR        # on one GPU (about 2-4 minutes on an H200)
    python scripts/gpu_runtime_evidence.py --quick          # tiny model on the CPU: a smoke test of the script

Writes DIR/results.jsonl (one line per mode and frame count) and DIR/results.md; prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import chunkflow  # noqa: E402
from chunkflow.models.build import build_transformer  # noqa: E402
from chunkflow.models.inputs import make_inputs  # noqa: E402
from chunkflow_planner.catalog import Workload, get_model  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()  # timing only, outside the runtime's hot path
            return out, a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def measure(model, inputs: dict, device, warmup: int, iters: int):
    timer = Timer(device)
    fwd = lambda: model(**inputs)[0]  # noqa: E731
    with torch.no_grad():
        for _ in range(warmup):
            out = fwd()
        times = []
        for _ in range(iters):
            out, dt = timer.run(fwd)
            times.append(dt)
    return out, times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"))
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--model", default="Wan2.2-TI2V-5B")
    ap.add_argument("--frames", default="41,81,121")
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--chunk", default="16MB")
    ap.add_argument("--residency", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-group", action="store_true", help="skip diffusers group offloading")
    args = ap.parse_args()

    if args.quick:
        args.model, args.frames, args.height, args.width, args.chunk = "tiny-wan", "5,9", 64, 64, "4KB"
        args.warmup, args.iters = 1, 2
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("CUDA is not available; run with --quick for the CPU smoke test", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    frames = [int(f) for f in args.frames.split(",")]
    spec = get_model(args.model)
    dtype = torch.bfloat16
    import diffusers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu, torch=torch.__version__,
                diffusers=diffusers.__version__, command=" ".join([Path(sys.executable).name] + sys.argv),
                model=spec.name, height=args.height, width=args.width)
    log(f"{meta}")

    t0 = time.perf_counter()
    model, h0 = build_transformer(spec, weights="random", dtype=dtype, device=device, mode="none", seed=0)
    h0.remove()  # plain module, every weight on the device: the `none` reference
    if device.type == "cuda":
        torch.cuda.synchronize()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built {spec.name}: {n_params / 1e9:.3f} B parameters, random bf16, in {time.perf_counter() - t0:.1f} s")

    inputs = {n: make_inputs(spec, Workload(batch=1, frames=n, height=args.height, width=args.width, steps=1),
                             dtype, device, seed=0) for n in frames}
    refs: dict[int, torch.Tensor] = {}
    rows: list[dict] = []
    jsonl = (out_dir / "results.jsonl").open("w")

    def record(mode: str, n: int, out, times, stats: dict | None):
        ref = refs.setdefault(n, out) if mode == "none" else refs[n]
        row = dict(meta, mode=mode, frames=n, step_s=statistics.median(times), times_s=times,
                   peak_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
                   peak_reserved=torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
                   host_rss=rss_bytes(), equal_to_none=bool(torch.equal(out, ref)),
                   finite=bool(torch.isfinite(out.float()).all()), stats=stats)
        rows.append(row)
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()
        log(f"{mode:>10} {n:4d} frames: {row['step_s']:.4f} s, peak {row['peak_allocated'] / 1e9:.2f} GB, "
            f"equal={row['equal_to_none']} finite={row['finite']}")

    def reset():
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    for mode in ("none", "layerwise", "chunkflow"):
        handle = None
        if mode != "none":
            t1 = time.perf_counter()
            handle = chunkflow.offload(model, mode=mode, chunk_size=args.chunk, residency=args.residency,
                                       device=device)
            log(f"offload {mode}: {time.perf_counter() - t1:.1f} s, {handle.stats()}")
        for n in frames:
            reset()
            out, times = measure(model, inputs[n], device, args.warmup, args.iters)
            record(mode, n, out, times, handle.stats().as_dict() if handle else None)
        if handle is not None:
            handle.remove()
        reset()

    if not args.no_group and device.type == "cuda":
        from diffusers.hooks import apply_group_offloading

        t1 = time.perf_counter()
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                               record_stream=True)
        log(f"group offloading applied in {time.perf_counter() - t1:.1f} s")
        for n in frames:
            reset()
            out, times = measure(model, inputs[n], device, args.warmup, args.iters)
            record("group", n, out, times, None)
    jsonl.close()

    none_t = {r["frames"]: r["step_s"] for r in rows if r["mode"] == "none"}
    none_m = {r["frames"]: r["peak_allocated"] for r in rows if r["mode"] == "none"}
    lines = [f"# Runtime evidence: {spec.name}, {args.height}x{args.width}, one forward per step", "",
             f"GPU: {gpu}; date: {meta['date']}; torch {meta['torch']}, diffusers {meta['diffusers']}; "
             f"command: `{meta['command']}`; chunkflow C={args.chunk}, r={args.residency}; median of {args.iters} "
             f"timed forwards after {args.warmup} warm-ups (CUDA events).", "",
             "| frames | mode | step (s) | vs none | peak alloc (GB) | vs none | peak reserved (GB) | pinned (GB) "
             "| host RSS (GB) | bit-equal to none |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n in frames:
        for r in [r for r in rows if r["frames"] == n]:
            pinned = (r["stats"] or {}).get("pinned_bytes", 0)
            mem_ratio = r["peak_allocated"] / none_m[n] if none_m[n] else 0.0
            lines.append(f"| {n} | {r['mode']} | {r['step_s']:.4f} | {r['step_s'] / none_t[n]:.3f}x | "
                         f"{r['peak_allocated'] / 1e9:.2f} | {mem_ratio:.2f} | {r['peak_reserved'] / 1e9:.2f} | "
                         f"{pinned / 1e9:.2f} | {r['host_rss'] / 1e9:.1f} | {r['equal_to_none']} |")
    table = "\n".join(lines) + "\n"
    (out_dir / "results.md").write_text(table)
    print(table, flush=True)
    bad = [r for r in rows if r["mode"] in ("layerwise", "chunkflow") and not r["equal_to_none"]]
    if bad:
        print(f"NOT bit-identical: {[(r['mode'], r['frames']) for r in bad]}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
