#!/usr/bin/env python
"""GPU evidence for Ulysses SP + offload with and without communication awareness (issue 4).

Wan2.2-TI2V-5B at 41/81/121 frames (704x1280) and FLUX.1-dev at batch 1/4/8 (1024x1024), random bf16 weights,
SP = world size (diffusers context parallelism), modes: none, layerwise, chunkflow (16MB, comm-aware),
chunkflow (16MB, not comm-aware). 1 warm-up + 3 timed forwards each (CUDA events, median); outputs compared
with `none` on the same rank (bit-identical expected). Per step: collective time (timing events around every
collective), prefetch stall (timing events around the compute stream's waits on the copy stream: ready[l] and
the awareness fences), compute = none's step - none's collective time, overhead = the rest. Contention stall
removed = (layerwise - chunkflow-aware) / (layerwise - none). One extra forward per chunkflow mode with the
event log on counts chunk copies whose GPU start fell inside a collective (time_violations) and the pairs the
stream order allows to overlap (stream_violations).

    torchrun --nproc-per-node 2 scripts/gpu_sp_evidence.py --out DIR                      # NVLink (default env)
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 scripts/gpu_sp_evidence.py --out DIR   # through host memory
    .venv/bin/torchrun --nproc-per-node 2 scripts/gpu_sp_evidence.py --quick --out DIR    # CPU, gloo, tiny models

Rank 0 writes DIR/results-<tag>.jsonl and DIR/results-<tag>.md (tag: nvlink, p2poff or cpu) and prints the
table last. NVLink multicast (NVLS) is left as the machine sets it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import chunkflow  # noqa: E402
from chunkflow.models.build import build_transformer  # noqa: E402
from chunkflow.models.inputs import make_inputs  # noqa: E402
from chunkflow.parallel import enable_sequence_parallel, init_distributed  # noqa: E402
from chunkflow.runtime.comm import CollectiveTap, CollectiveTimer, StallProbe  # noqa: E402
from chunkflow_planner.catalog import Workload, get_model  # noqa: E402

RANK = 0


def log(msg: str) -> None:
    if RANK == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tiny_flux():
    s = get_model("FLUX.1-dev")
    cfg = dict(s.diffusers.config)
    cfg.update(attention_head_dim=16, num_attention_heads=2, num_layers=2, num_single_layers=3,
               joint_attention_dim=32, pooled_projection_dim=16, in_channels=16, axes_dims_rope=(4, 6, 6))
    return s.model_copy(update={"name": "tiny-flux", "diffusers": s.diffusers.model_copy(update={"config": cfg}),
                                "text_len": 8})


def run_mode(model, inputs, handle, cuda, warmup, iters):
    """(median step ms, median collective ms, median ready stall, median fence stall, last output)."""
    timer = CollectiveTimer(cuda)
    tap = CollectiveTap(timer)
    tap.install()
    probe = StallProbe(cuda)
    if handle is not None and handle.streamer is not None:
        handle.streamer.wait_probe = probe
    steps, colls, ready, fence = [], [], [], []
    try:
        for i in range(warmup + iters):
            timer.reset()
            probe.reset()
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(**inputs)[0]
            if cuda:
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                steps.append(ms)
                colls.append(timer.total_ms())
                st = probe.totals()
                ready.append(st["ready"])
                fence.append(st["fence"])
    finally:
        tap.remove()
        if handle is not None and handle.streamer is not None:
            handle.streamer.wait_probe = None
    med = statistics.median
    return med(steps), med(colls), med(ready), med(fence), out, timer.count


def logged_forward(model, inputs, handle):
    """One forward with the event log on: (copies, copies started inside a collective on the GPU, stream pairs)."""
    elog = handle.set_event_log(True)
    with torch.no_grad():
        model(**inputs)
    elog.resolve()
    res = (len(elog.copies()), len({c.seq for c, _ in elog.time_violations()}),
           len({c.seq for c, _ in elog.stream_violations()}))
    handle.set_event_log(False)
    return res


def main() -> int:
    global RANK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sp-evidence")
    ap.add_argument("--models", default="wan,flux")
    ap.add_argument("--frames", default="41,81,121")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--chunk", default="16MB")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-log", action="store_true", help="skip the event-log forward")
    ap.add_argument("--residency", default="0", help="residencies for chunkflow-aware, e.g. 0,0.2 (r > 0: extra rows)")
    ap.add_argument("--modes", default="layerwise,chunkflow", help="offload modes to run besides none")
    ap.add_argument("--tag", default="", help="suffix for the output files (default: nvlink / p2poff)")
    ap.add_argument("--quick", action="store_true", help="CPU, gloo, tiny models (smoke test)")
    args = ap.parse_args()

    rank, world, device = init_distributed()
    RANK = rank
    cuda = device.type == "cuda"
    if args.quick:
        if cuda:
            device, cuda = torch.device("cpu"), False
        d = ap.get_default
        args.frames = "5,9" if args.frames == d("frames") else args.frames
        args.batches = "1,2" if args.batches == d("batches") else args.batches
        args.chunk = "3001" if args.chunk == d("chunk") else args.chunk
    elif not cuda:
        print("CUDA is not available; run with --quick for the CPU smoke test", file=sys.stderr)
        return 2
    p2p_off = os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
    tag = ("cpu" if not cuda else ("p2poff" if p2p_off else "nvlink")) + (f"-{args.tag}" if args.tag else "")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import diffusers

    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                gpu=torch.cuda.get_device_name(device) if cuda else "cpu", world=world, tag=tag,
                NCCL_P2P_DISABLE=os.environ.get("NCCL_P2P_DISABLE"), NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"),
                torch=torch.__version__, diffusers=diffusers.__version__, chunk=args.chunk,
                command=" ".join(["torchrun", f"--nproc-per-node {world}"] + sys.argv))
    log(json.dumps(meta))
    dtype = torch.bfloat16
    rows: list[dict] = []

    workloads = []
    for key in args.models.split(","):
        if key == "wan":
            spec = get_model("tiny-wan") if args.quick else get_model("Wan2.2-TI2V-5B")
            hw = (64, 64) if args.quick else (704, 1280)
            wls = [Workload(batch=1, frames=int(n), height=hw[0], width=hw[1], steps=1) for n in args.frames.split(",")]
            workloads.append((spec, wls, "frames"))
        elif key == "flux":
            spec = tiny_flux() if args.quick else get_model("FLUX.1-dev")
            hw = (64, 64) if args.quick else (1024, 1024)
            wls = [Workload(batch=int(b), frames=1, height=hw[0], width=hw[1], steps=1) for b in args.batches.split(",")]
            workloads.append((spec, wls, "batch"))
        else:
            raise SystemExit(f"unknown model key {key!r}; use wan,flux")

    for spec, wls, axis in workloads:
        t0 = time.perf_counter()
        model, h0 = build_transformer(spec, weights="random", dtype=dtype, device=device, mode="none", seed=0)
        h0.remove()
        enable_sequence_parallel(model, spec, world)
        log(f"built {spec.name} ({sum(p.numel() for p in model.parameters()) / 1e9:.3f} B) with SP={world} "
            f"in {time.perf_counter() - t0:.1f} s")
        inputs = {w: make_inputs(spec, w, dtype, device, seed=0) for w in wls}
        ref = {}
        res: dict = {}
        for w in wls:
            res[("none", w)] = run_mode(model, inputs[w], None, cuda, args.warmup, args.iters)
            ref[w] = res[("none", w)][4].clone()
        runs = [("layerwise", 0.0)] if "layerwise" in args.modes.split(",") else []
        if "chunkflow" in args.modes.split(","):
            runs += [("chunkflow", float(x)) for x in args.residency.split(",")]
        labels = ["none"]
        for mode, residency in runs:
            t1 = time.perf_counter()
            h = chunkflow.offload(model, mode=mode, chunk_size=args.chunk if mode == "chunkflow" else 1,
                                  residency=residency, device=device)
            log(f"{spec.name}: offload {mode} r={residency} in {time.perf_counter() - t1:.1f} s")
            suffix = f"-r{round(100 * residency)}" if residency else ""
            variants = [("layerwise", None)] if mode == "layerwise" else (
                [("chunkflow-aware" + suffix, True)] + ([("chunkflow-not-aware", False)] if not residency else []))
            labels += [v for v, _ in variants]
            for label, aware in variants:
                if aware is not None:
                    h.set_comm_aware(aware)
                for w in wls:
                    r = run_mode(model, inputs[w], h, cuda, args.warmup, args.iters)
                    lg = logged_forward(model, inputs[w], h) if (mode == "chunkflow" and not args.no_log) else None
                    res[(label, w)] = r + (lg, h.stats().pinned_bytes)
            h.remove()
            if cuda:
                torch.cuda.empty_cache()
        for w in wls:
            none_ms, none_coll = res[("none", w)][0], res[("none", w)][1]
            compute = none_ms - none_coll
            lw_ms = res[("layerwise", w)][0] if ("layerwise", w) in res else None
            for label in labels:
                r = res[(label, w)]
                ms, coll, ready, fence, out, ncoll = r[:6]
                lg = r[6] if len(r) > 6 else None
                stall = ready + fence
                row = dict(model=spec.name, axis=axis, value=w.frames if axis == "frames" else w.batch,
                           mode=label, rank=rank, step_ms=round(ms, 3), collective_ms=round(coll, 3),
                           n_collectives=ncoll, prefetch_stall_ms=round(stall, 3), fence_stall_ms=round(fence, 3),
                           compute_ms=round(compute, 3),
                           overhead_ms=round(ms - compute - coll - stall, 3) if label != "none" else 0.0,
                           vs_none=round(ms / none_ms, 4),
                           bit_identical=bool(torch.equal(out, ref[w])),
                           contention_removed=(round((lw_ms - ms) / (lw_ms - none_ms), 3)
                                               if label == "chunkflow-aware" and lw_ms and lw_ms > none_ms else None),
                           log_copies=lg[0] if lg else None, gpu_copies_inside_collectives=lg[1] if lg else None,
                           stream_overlap_pairs=lg[2] if lg else None, **{"tag": tag})
                rows.append(row)
        del model, inputs, ref, res
        if cuda:
            torch.cuda.empty_cache()

    # every rank's rows to rank 0 (bit-identity and timings per rank)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        allrows = [r for g in gathered for r in g]
        jl = out_dir / f"results-{tag}.jsonl"
        with jl.open("w") as f:
            f.write(json.dumps({"meta": meta}) + "\n")
            for r in allrows:
                f.write(json.dumps(r) + "\n")
        hdr = ("| model | n/b | mode | step ms | x none | compute | collective | prefetch stall (fence) | overhead "
               "| contention removed | copies: started in a coll. (GPU) / may overlap (streams) / total "
               "| bit-identical (all ranks) |")
        lines = [f"# SP={world} evidence, {tag}", "", f"`{json.dumps(meta)}`", "", hdr, "|" + "---|" * 12]
        for r in [r for r in allrows if r["rank"] == 0]:
            same = all(x["bit_identical"] for x in allrows if (x["model"], x["value"], x["mode"]) ==
                       (r["model"], r["value"], r["mode"]))
            cr = "" if r["contention_removed"] is None else f"{100 * r['contention_removed']:.0f}%"
            cc = "" if r["log_copies"] is None else (f"{r['gpu_copies_inside_collectives'] if cuda else '-'} / "
                                                      f"{r['stream_overlap_pairs']} / {r['log_copies']}")
            lines.append(f"| {r['model']} | {r['value']} | {r['mode']} | {r['step_ms']:.1f} | {r['vs_none']:.3f} | "
                         f"{r['compute_ms']:.1f} | {r['collective_ms']:.1f} | {r['prefetch_stall_ms']:.1f} "
                         f"({r['fence_stall_ms']:.1f}) | {r['overhead_ms']:.1f} | {cr} | {cc} | {same} |")
        table = "\n".join(lines) + "\n"
        (out_dir / f"results-{tag}.md").write_text(table)
        print(table, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
