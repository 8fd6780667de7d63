"""Two local ranks streaming one model from one host copy (issue 40's one-GPU evidence), through the product.

`python scripts/shared_host_bench.py OUT.json [--model flux] [--height 512 --width 512]` starts two processes with
torchrun's local environment (LOCAL_RANK 0/1, LOCAL_WORLD_SIZE 2; no process group: the shared tier's rendezvous needs
none), both on cuda:0 (one GPU: the kind lent for this issue). Each builds the catalog model (random weights, real
architecture) with `build_transformer(config=chunkflow C=16MB r=0)`: every block streamed from host memory. Rounds:

- `shared` (the default) and `private` (CHUNKFLOW_SHARE_HOST=0): each process's offload time, pinned bytes, its
  proportional and resident host memory (/proc/self/smaps_rollup) and the host's used memory and Shmem
  (/proc/meminfo) while both hold the model; the time of a forward (copy-bound at a small workload) with each rank
  alone and with both at once, and its H2D rate; the outputs of the two ranks compared bit for bit (same weights,
  same inputs) and against the other round's.
- `raw copy`: 4 GiB copied in 16 MB chunks from the shared segment's page-locked map against a private page-locked
  store of the same size, on one copy stream (cuda events).
- clean-up: Shmem and the host's used memory after both exit, /dev/shm before and after, processes still mapping a
  segment; and `kill`: the owner killed (SIGKILL) once both hold the model, the other rank's forward after it, and the
  same checks once it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return out


def used() -> dict[str, int]:
    m = meminfo()
    return {"used": m["MemTotal"] - m["MemAvailable"], "shmem": m.get("Shmem", 0)}


def holders() -> int:
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += "memfd:chunkflow" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            pass
    return n


def dev_shm() -> list[str]:
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------- one rank


def rollup() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return {"rss": out.get("Rss", 0), "pss": out.get("Pss", 0)}


def wait_file(p: Path, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while not p.exists():
        if time.monotonic() > end:
            raise TimeoutError(str(p))
        time.sleep(0.02)


def child(args) -> None:
    import torch

    from chunkflow.models.build import build_transformer
    from chunkflow.models.inputs import make_inputs
    from chunkflow_planner.catalog import Workload, get_model
    from chunkflow_planner.offload import OffloadConfig

    rank = int(os.environ["LOCAL_RANK"])
    flags = Path(args.flags)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    spec = get_model(args.model)
    w = Workload(batch=1, frames=1, height=args.height, width=args.width, steps=1)
    t0 = time.perf_counter()
    model, h = build_transformer(spec, dtype=torch.bfloat16, device=dev, seed=0,
                                 config=OffloadConfig("chunkflow", "16MB", 0.0))
    torch.cuda.synchronize()
    res = {"rank": rank, "offload_s": time.perf_counter() - t0}
    st = h.stats()
    res.update(host_store_bytes=st.host_bytes, pinned_bytes=st.pinned_bytes, shared_bytes=st.shared_bytes,
               shared_pinned_bytes=st.shared_pinned_bytes, shared_blocks=st.shared_blocks,
               streamed_bytes=st.streamed_bytes_per_step)
    inputs = make_inputs(spec, w, torch.bfloat16, dev, seed=1)

    def forward():
        with torch.no_grad():
            return model(**inputs)[0]

    out = forward()  # warm-up
    torch.cuda.synchronize()
    (flags / f"held{rank}").write_text("1")
    wait_file(flags / "both")
    res["mem_holding"] = rollup()

    def timed(n: int = 3) -> float:
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            forward()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    if args.kill:
        wait_file(flags / "go")
        res["after_kill_s"] = timed(2)
        res["after_kill_equal"] = bool(torch.equal(forward(), out))
    else:
        for turn in (0, 1):  # each rank alone, the other waiting
            wait_file(flags / f"turn{turn}")
            if turn == rank:
                res["alone_s"] = timed()
                (flags / f"done{turn}").write_text("1")
        wait_file(flags / "together")
        res["together_s"] = timed()
        if args.raw:
            res["raw"] = raw_copy(h, dev)
    torch.save(out.float().cpu(), flags / f"out{rank}.pt")
    h.remove()
    (flags / f"result{rank}").write_text(json.dumps(res))


def raw_copy(h, dev) -> dict:
    """16 MB chunks of 4 GiB copied to the device from the shared tier's page-locked map, then from a private
    page-locked store of the same size (GB/s, median of 3)."""
    import torch

    from chunkflow.runtime.store import HostStore

    tier = next((t for t in h.tiers if t.name == "shared"), None)
    n = 4 << 30
    chunk = 16 * 10**6
    dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
    s = torch.cuda.Stream(dev)

    def rate(src: torch.Tensor, spans: list[tuple[int, int]]) -> float:
        starts = [o + i * chunk for o, m in spans for i in range(m // chunk)][: n // chunk]  # no chunk crosses a span
        out = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record()
                for at in starts:
                    dst.copy_(src[at:at + chunk], non_blocking=True)
                b.record()
            b.synchronize()
            out.append(len(starts) * chunk / (a.elapsed_time(b) / 1e3) / 1e9)
        return sorted(out)[1]

    got = {}
    if tier is not None and tier.store is not None:
        spans = list(tier.spans.values())
        got["shared_gbps"] = rate(tier.store.data, spans)
        got["shared_copied_bytes"] = min(n, sum(m // chunk * chunk for _, m in spans))
    t = time.perf_counter()
    own = HostStore(n, pin=True)
    got["private_register_s"] = time.perf_counter() - t
    got["private_register_gbps"] = n / got["private_register_s"] / 1e9
    own.data.fill_(1)
    got["private_gbps"] = rate(own.data, [(0, n)])
    own.release()
    return got


# ---------------------------------------------------------------------------------------------- the rounds


def round_(name: str, args, share: bool, kill: bool = False) -> dict:
    flags = Path(tempfile.mkdtemp(prefix=f"shb-{name}-"))
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID=f"shb-{name}-{time.time_ns()}",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    if not share:
        env["CHUNKFLOW_SHARE_HOST"] = "0"
    base = used()
    shm0 = dev_shm()
    cmd = [sys.executable, __file__, "--child", "--flags", str(flags), "--model", args.model, "--height",
           str(args.height), "--width", str(args.width)] + (["--kill"] if kill else []) + (
        ["--raw"] if share and not kill else [])
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    res: dict = {"round": name, "share": share, "base": base}
    try:
        for r in (0, 1):
            wait_file(flags / f"held{r}")
        res["both_held_s"] = time.perf_counter() - t0
        time.sleep(1.0)
        res["holding"] = used()
        (flags / "both").write_text("1")
        if kill:
            time.sleep(2.0)
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(60)
            res["owner_killed"] = procs[0].returncode
            (flags / "go").write_text("1")
        else:
            for turn in (0, 1):
                (flags / f"turn{turn}").write_text("1")
                wait_file(flags / f"done{turn}")
            (flags / "together").write_text("1")
        logs = [p.communicate(timeout=900)[0] for p in procs]
    except BaseException:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        res["error"] = [l[-3000:] for l in logs]
        return res
    res["exit"] = [p.returncode for p in procs]
    res["logs_tail"] = [l[-1500:] for l in logs]
    res["ranks"] = [json.loads((flags / f"result{r}").read_text()) for r in (0, 1)
                    if (flags / f"result{r}").exists()]
    import torch

    outs = {r: torch.load(flags / f"out{r}.pt") for r in (0, 1) if (flags / f"out{r}.pt").exists()}
    if len(outs) == 2:
        res["ranks_equal"] = bool(torch.equal(outs[0], outs[1]))
    res["out_path"] = str(flags / "out1.pt")
    time.sleep(1.0)
    res["after"] = used()
    res["dev_shm_new"] = [f for f in dev_shm() if f not in shm0]
    res["holders_after"] = holders()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--model", default="flux")
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--flags")
    ap.add_argument("--kill", action="store_true")
    ap.add_argument("--raw", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import torch

    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "host_mem_total": meminfo()["MemTotal"]}
    rounds = []
    for name, share, kill in (("shared", True, False), ("private", False, False), ("kill", True, True)):
        rounds.append(round_(name, args, share, kill))
        print(json.dumps({k: v for k, v in rounds[-1].items() if k != "logs_tail"})[:3000], flush=True)
        Path(args.out).write_text(json.dumps({"env": env, "rounds": rounds}, indent=1))
    a, b = (torch.load(r["out_path"]) if Path(r["out_path"]).exists() else None for r in rounds[:2])
    env["shared_equals_private"] = a is not None and b is not None and bool(torch.equal(a, b))
    Path(args.out).write_text(json.dumps({"env": env, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
