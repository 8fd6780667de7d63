"""Diagnostic of 2026-12-01 (not product evidence; output.txt and records.json beside it): where the slow spells of
a UMT5-XXL text encoder's forwards on an H200 come from (Wan's encode ran 63 ms or 112 ms in one process, machine F).
Per iteration, back to back: a fixed pure-Python loop (the host CPU's speed, no torch, no GPU), two eager forwards
as Wan calls them (random weights, 512 tokens, a padded mask), two replays of a CUDA graph of the same forward (the
device time alone at the GPU's clocks of the moment), with the hypervisor's steal time and the GPU's SM clock and
power (nvidia-smi every 20 ms) over each. Then forwards right after 4 s of large GEMMs against right after 4 s idle
(does a heavy phase before encode, a decode, slow it?). Run from the repository root on the GPU machine:
  python3 docs/data/h200-encode-jitter/encode_jitter.py OUT_DIR   (it writes records.json and nvidia-smi.csv there)"""
import json, os, statistics, subprocess, sys, time, warnings
from datetime import datetime

import torch
import transformers

sys.path.insert(0, "src")
from chunkflow.commands.calibrate.host import text_encoder_archs


def count_ops(fn):
    """Operators fn() dispatches (aten calls, views included); calibrate_host's until issue 28's host model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(out_dir, exist_ok=True)
smi_log = os.path.join(out_dir, "nvidia-smi.csv")
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu,temperature.gpu",
                        "--format=csv,noheader,nounits", "-lms", "20"], stdout=open(smi_log, "w"))
print(subprocess.run("lscpu | egrep -i 'model name|mhz|hypervisor|numa node0'; cat /proc/loadavg; "
                     "ls /sys/devices/system/cpu/cpu0/cpufreq 2>&1 | head -3", shell=True, capture_output=True,
                     text=True).stdout)
dev = torch.device("cuda")
te = text_encoder_archs()["umt5_encoder"]
cls = getattr(transformers, te.cls)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with torch.device(dev):
        torch.set_default_dtype(torch.bfloat16)
        m = cls(cls.config_class(**te.config)).eval()
        torch.set_default_dtype(torch.float32)
ids = torch.randint(0, 1000, (1, 512), device=dev)
mask = torch.zeros(1, 512, dtype=torch.long, device=dev)
mask[:, :12] = 1


def fwd():
    with torch.no_grad():
        return m(ids, mask).last_hidden_state


for _ in range(3):
    fwd()
torch.cuda.synchronize()
n_ops = count_ops(fwd)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    fwd()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    fwd()
torch.cuda.synchronize()
print(f"UMT5-XXL built; {n_ops} operators a forward; graph captured")


def steal() -> tuple[int, int]:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return v[7], sum(v)


def pyloop() -> float:
    t0 = time.perf_counter()
    acc = 0
    for i in range(200_000):
        acc += i
    return time.perf_counter() - t0


def timed(fn) -> tuple[float, float, float, float]:
    """(wall s, this thread's CPU s, wall start, wall end) of fn() then a device synchronize."""
    torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.thread_time()
    a = time.time()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - w0, time.thread_time() - c0, a, time.time()


def eager2():
    fwd(), fwd()


def graph2():
    g.replay(), g.replay()


records = []


def iteration(tag: str) -> None:
    st0, tot0 = steal()
    py = pyloop()
    e_wall, e_cpu, e_a, e_b = timed(eager2)
    gr_wall, _, _, _ = timed(graph2)
    st1, tot1 = steal()
    records.append(dict(tag=tag, py_ms=py * 1e3, eager_ms=e_wall * 1e3, eager_cpu_ms=e_cpu * 1e3,
                        graph_ms=gr_wall * 1e3, steal_pct=100 * (st1 - st0) / max(1, tot1 - tot0),
                        t0=e_a, t1=e_b))


for _ in range(150):
    iteration("loop")
big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
for r in range(6):
    t_end = time.time() + 4
    while time.time() < t_end:
        for _ in range(20):
            big @ big
        torch.cuda.synchronize()
    for k in range(3):
        iteration(f"after-gemm-{k}")
    time.sleep(4)
    for k in range(3):
        iteration(f"after-idle-{k}")
time.sleep(0.2)
smi.terminate()
smi.wait()

clock = []  # (epoch s, sm MHz, W)
for line in open(smi_log):
    p = [x.strip() for x in line.split(",")]
    try:
        clock.append((datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(p[1]), float(p[2])))
    except (ValueError, IndexError):
        pass
for r in records:
    inside = [c for c in clock if r["t0"] - 0.02 <= c[0] <= r["t1"] + 0.02]
    r["sm_mhz"] = statistics.mean(c[1] for c in inside) if inside else None
    r["power_w"] = statistics.mean(c[2] for c in inside) if inside else None
json.dump(dict(n_ops=n_ops, records=records), open(os.path.join(out_dir, "records.json"), "w"), indent=1)


def summary(tag: str, rs: list[dict]) -> None:
    def col(k):
        vals = [r[k] for r in rs if r[k] is not None]
        return f"{statistics.median(vals):7.1f} [{min(vals):6.1f}-{max(vals):6.1f}]" if vals else "   -"
    print(f"{tag:28s} n={len(rs):3d} eager x2 {col('eager_ms')} cpu {col('eager_cpu_ms')} graph x2 {col('graph_ms')} "
          f"py {col('py_ms')} steal% {col('steal_pct')} SM MHz {col('sm_mhz')} W {col('power_w')}")


loop = [r for r in records if r["tag"] == "loop"]
cut = 1.2 * min(r["eager_ms"] for r in loop)
summary("loop, all", loop)
summary(f"loop, eager x2 > {cut:.0f} ms (slow)", [r for r in loop if r["eager_ms"] > cut])
summary("loop, fast", [r for r in loop if r["eager_ms"] <= cut])
for k in range(3):
    summary(f"after 4 s GEMM, pair {k}", [r for r in records if r["tag"] == f"after-gemm-{k}"])
    summary(f"after 4 s idle, pair {k}", [r for r in records if r["tag"] == f"after-idle-{k}"])
print("loop, eager x2 ms in order:", [round(r["eager_ms"], 1) for r in loop])
print("loop, graph x2 ms in order:", [round(r["graph_ms"], 1) for r in loop])
print("loop, py loop ms in order:", [round(r["py_ms"], 1) for r in loop])
print("loop, SM MHz in order:", [round(r["sm_mhz"]) if r["sm_mhz"] else None for r in loop])
