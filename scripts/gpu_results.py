#!/usr/bin/env python
"""The paper's evaluation on two GPUs with Ulysses SP=2 (issue 6): one `chunkflow bench` per model, under torchrun.

    python3 scripts/gpu_results.py --link nvlink --out DIR    # NCCL over NVLink (the machine's default)
    python3 scripts/gpu_results.py --link p2poff --out DIR    # NCCL_P2P_DISABLE=1: collectives through host memory
    python3 scripts/gpu_results.py --quick --out DIR          # CPU dry run: gloo, the tiny model, every sweep shape

Per model (docs/results.md has the figures): scaling over frames / batch with none, layerwise and chunkflow
(16 MB, r=0); residency 0-60% at the smallest workload; for Wan2.2-TI2V-5B also chunk sizes 4-256 MB at 81 frames.
Predictions use profiles/h200-x2-<link>-calibrated.yaml. Every launch has a deadline taken from --budget-s, so
one slow model cannot eat the others' time; a launch cut short leaves bench.partial.csv. Plots are drawn
afterwards on any machine with `chunkflow bench --from-dir`. Everything under DIR is also packed into
DIR/results-<link>.tgz (the device tool returns few files). NVLink multicast settings are left as they are.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESIDENCIES = "0,0.1,0.2,0.3,0.4,0.5,0.6"
SWEEPS = {  # key: chunkflow bench arguments (beyond --hardware, --out)
    "wan": ["--model", "Wan2.2-TI2V-5B", "--frames", "41,81,121,161", "--height", "704", "--width", "1280",
            "--chunk-sizes", "16MB,4MB,8MB,32MB,64MB,128MB,256MB", "--chunk-at", "81",
            "--residency", RESIDENCIES, "--residency-at", "41"],
    "flux": ["--model", "FLUX.1-dev", "--batch", "4,8,12,16", "--height", "1024", "--width", "1024",
             "--residency", RESIDENCIES, "--residency-at", "4"],
    "hunyuan": ["--model", "HunyuanVideo", "--frames", "9,21,33,45", "--height", "720", "--width", "1280",
                "--residency", RESIDENCIES, "--residency-at", "9"],
}
QUICK = {  # the same sweep shapes on the tiny model (CPU): exercises every code path in seconds
    "wan": ["--model", "tiny", "--frames", "5,9,13", "--chunk-sizes", "16KB,4KB,64KB", "--chunk-at", "9",
            "--residency", "0,0.3,0.6", "--residency-at", "5"],
    "flux": ["--model", "tiny", "--frames", "5,9", "--residency", "0,0.5", "--residency-at", "5"],
    "hunyuan": ["--model", "tiny", "--frames", "5,9", "--residency", "0,0.5", "--residency-at", "9"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", choices=("nvlink", "p2poff"), default="nvlink")
    ap.add_argument("--out", default="results")
    ap.add_argument("--models", default="wan,flux,hunyuan", help="which sweeps, in order")
    ap.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget for all launches")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="CPU dry run on the tiny model")
    ap.add_argument("--modes", default="none,layerwise,chunkflow", help="chunkflow bench --modes")
    ap.add_argument("--comm-aware", default="auto", help="chunkflow bench --comm-aware (auto: by the profile's link)")
    ap.add_argument("--no-chunk-sweep", action="store_true", help="leave out the chunk-size sweep")
    ap.add_argument("--no-residency-sweep", action="store_true", help="leave out the residency sweep")
    ap.add_argument("--extra", default="", help="more chunkflow bench arguments; a repeated option overrides, "
                                                "e.g. '--frames 81'")
    ap.add_argument("--tag", default="", help="suffix of the output folder: DIR/<link>[-tag]")
    args = ap.parse_args()

    t_end = time.monotonic() + args.budget_s
    name = args.link + (f"-{args.tag}" if args.tag else "")
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if args.link == "p2poff":
        env["NCCL_P2P_DISABLE"] = "1"
    sweeps = QUICK if args.quick else SWEEPS
    profile = "h200-x2" if args.quick else str(ROOT / "profiles" / f"h200-x2-{args.link}-calibrated.yaml")
    if args.quick:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:  # torchrun's default of 1 thread makes the host-side copies of offload()/remove() single-threaded
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // (2 * args.nproc))))
    keys = args.models.split(",")
    unknown = [k for k in keys if k not in sweeps]
    if unknown:
        print(f"unknown sweep(s) {', '.join(unknown)}; have {', '.join(sweeps)}", file=sys.stderr)
        return 2
    log = (out / "log.txt").open("a")
    rc = 0
    for key in keys:
        left = t_end - time.monotonic()
        if left < 30:
            print(f"[{time.strftime('%H:%M:%S')}] {key}: skipped, {left:.0f} s of the budget left", flush=True)
            rc = 1
            continue
        sweep = list(sweeps[key])
        for skip, flag in ((args.no_chunk_sweep, "--chunk-sizes"), (args.no_residency_sweep, "--residency")):
            if skip and flag in sweep:
                i = sweep.index(flag)
                del sweep[i: i + 4]  # --chunk-sizes LIST --chunk-at N, --residency LIST --residency-at N
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               "-m", "chunkflow", "bench", *sweep, "--hardware", profile, "--steps", "2", "--warmup", "1",
               "--modes", args.modes, "--comm-aware", args.comm_aware, "--no-plots", "--out", str(out / key),
               *args.extra.split()]
        print(f"[{time.strftime('%H:%M:%S')}] {key}: {' '.join(cmd[1:])} (deadline {left:.0f} s)", flush=True)
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=left, cwd=ROOT)
            status = f"exit {p.returncode}"
            rc = rc or p.returncode
        except subprocess.TimeoutExpired:
            status, rc = "cut at the deadline (bench.partial.csv has what was measured)", 1
        print(f"[{time.strftime('%H:%M:%S')}] {key}: {status} after {time.monotonic() - t0:.0f} s", flush=True)
        summary = out / key / "summary.md"
        if summary.exists():
            print(summary.read_text().split("## Planner accuracy")[-1][:600], flush=True)
    log.close()
    with tarfile.open(Path(args.out) / f"results-{name}.tgz", "w:gz") as tar:
        tar.add(out, arcname=name)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
