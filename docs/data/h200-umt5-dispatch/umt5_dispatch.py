"""Diagnostic of 2026-12-01 (not product evidence; output.txt beside it): what a UMT5-XXL forward on the GPU spends
its time on: the stand-ins calibrate times, the real forward (random weights, a padded mask) timed 2 at a time as Wan
calls it, with the allocator emptied first, pinned to some cores, its device time alone (a CUDA graph replay).
Run from the repository root of commit 385bb41 on the GPU machine (host_op_seconds is gone since)."""
import os, statistics, subprocess, sys, time, json, warnings
import torch, transformers
sys.path.insert(0, "src")
from chunkflow.calibrate_host import host_op_seconds, count_ops, text_encoder_archs
print(subprocess.run("lscpu | egrep -i 'numa|socket|core|model name|mhz'; nvidia-smi topo -m; nproc; cat /proc/loadavg",
                     shell=True, capture_output=True, text=True).stdout)
print("affinity", sorted(os.sched_getaffinity(0)))
dev = torch.device("cuda")
te = text_encoder_archs()["umt5_encoder"]
for arch, t in text_encoder_archs().items():
    s, n = host_op_seconds(t, dev)
    print(f"stand-in {arch}: {s*1e6:.2f} us/op, {n} ops")
cls = getattr(transformers, te.cls)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with torch.device(dev):
        cfg = cls.config_class(**te.config)
        torch.set_default_dtype(torch.bfloat16)
        m = cls(cfg).eval()
        torch.set_default_dtype(torch.float32)
print("built", sum(p.numel() for p in m.parameters()) / 1e9, "B params", next(m.parameters()).dtype)
ids = torch.randint(0, 1000, (1, 512), device=dev); mask = torch.zeros(1, 512, dtype=torch.long, device=dev); mask[:, :12] = 1
def fwd():
    with torch.no_grad():
        return m(ids, mask).last_hidden_state
fwd(); torch.cuda.synchronize()
n = count_ops(fwd)
print("ops per forward", n)
def timeit(k, pre=None):
    ts = []
    for _ in range(k):
        if pre: pre()
        torch.cuda.synchronize(); t0 = time.perf_counter(); fwd(); fwd(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return ts
def show(tag, ts):
    ts_ms = [round(t * 1e3, 1) for t in ts]
    print(f"{tag}: median {statistics.median(ts)*1e3:.1f} ms ({statistics.median(ts)/(2*n)*1e6:.2f} us/op) min {min(ts)*1e3:.1f} max {max(ts)*1e3:.1f}: {ts_ms}")
show("plain x2", timeit(30))
show("empty_cache x2", timeit(15, torch.cuda.empty_cache))
# device time: enqueue without host gaps is impossible eager; use profiler-free estimate by CUDA events around a graph
torch.cuda.set_sync_debug_mode(1)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always"); fwd()
torch.cuda.set_sync_debug_mode(0)
print("syncs in a forward:", len(w), [str(x.message)[:80] for x in w[:3]])
allc = sorted(os.sched_getaffinity(0))
for cpus in ({allc[0]}, {allc[len(allc)//2]}, {allc[-1]}, set(allc[: len(allc)//2]), set(allc[len(allc)//2:])):
    os.sched_setaffinity(0, cpus)
    show(f"cpus {sorted(cpus)}", timeit(10))
os.sched_setaffinity(0, set(allc))
# host-only enqueue time of a forward (GPU may lag): time to return
ts = []
for _ in range(10):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fwd(); ts.append(time.perf_counter() - t0); torch.cuda.synchronize()
print("enqueue only one forward, median ms", round(statistics.median(ts)*1e3, 1))
# CUDA graph of one forward: device time, and bitwise identity
ref = fwd().clone()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2): fwd()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = fwd()
g.replay(); torch.cuda.synchronize()
print("graph output identical:", torch.equal(out, ref))
ts = []
for _ in range(10):
    torch.cuda.synchronize(); t0 = time.perf_counter(); g.replay(); g.replay(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
print("graph replay x2 (device time) median ms", round(statistics.median(ts)*1e3, 1), [round(t*1e3,1) for t in ts])
show("plain x2 again", timeit(20))
