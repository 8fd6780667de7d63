"""One host copy per host (runtime/tiers/shared.py, runtime/hostshare.py): the ranks of a torchrun job on one host
stream from one shared segment, park in one, and nothing is left behind by an exit or a kill.

The torchrun test launches this file with `torchrun --nproc-per-node 2` (gloo on the CPU); both ranks run `_worker`
and rank 0 writes what both saw to a JSON file. The kill tests start the two local ranks themselves (torchrun's
environment, no process group: the rendezvous needs none) so that one can be killed while the other goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SRC = HERE.parent / "src"


def memfd_memory() -> dict[str, int]:
    """Rss and Pss (bytes) of this process's maps of chunkflow's shared segments (/proc/self/smaps)."""
    out = {"Rss": 0, "Pss": 0, "maps": 0}
    cur = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                cur = line
                out["maps"] += "memfd:chunkflow" in cur
            elif "memfd:chunkflow" in cur and head in ("Rss:", "Pss:"):
                out[head[:-1]] += int(line.split()[1]) * 1024
    return out


def dev_shm() -> list[str]:
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


def _blocks_module():
    from tiny import wan

    return wan(mixed=True)  # a real diffusers WanTransformer3DModel, bf16 with its fp32 modules


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from chunkflow.runtime.handle import offload
    from chunkflow.runtime.tiers.shared import SharedTierWarning
    from chunkflow_planner.offload import OffloadConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    m, blocks, kw = _blocks_module()
    with torch.no_grad():
        ref = m(**kw)[0]
    h = offload(m, OffloadConfig("chunkflow", "64KB", 0.3), device="cpu", blocks=blocks)
    with torch.no_grad():
        out = m(**kw)[0]
    st = h.stats()
    dist.barrier()  # both ranks hold their maps and have streamed from them
    mem = memfd_memory()
    res["stream"] = dict(equal=torch.equal(out, ref), shared_blocks=st.shared_blocks, shared_bytes=st.shared_bytes,
                         shared_tail=st.shared_tail_bytes, owner=st.shared_owner, host_bytes=st.host_bytes,
                         resident=st.resident_bytes, streamed=st.streamed_bytes_per_step, mem=mem)
    dist.barrier()
    # a write on rank 1 lands in its own pages: rank 0's weights and outputs are the loaded ones
    ref2 = None
    if rank == 1:
        import copy

        twin = copy.deepcopy(_blocks_module()[0])
        with torch.no_grad():
            twin.blocks[2].ffn.net[2].weight.mul_(0.5)
            ref2 = twin(**kw)[0]
            m.blocks[2].ffn.net[2].weight.mul_(0.5)
    dist.barrier()
    import warnings

    with warnings.catch_warnings(record=True) as said, torch.no_grad():
        warnings.simplefilter("always")
        out2 = m(**kw)[0]
    res["write"] = dict(equal_loaded=torch.equal(out2, ref), equal_written=ref2 is not None and torch.equal(out2, ref2),
                        shared_blocks=h.stats().shared_blocks,
                        warned=any(issubclass(w.category, SharedTierWarning) for w in said))
    dist.barrier()
    h.remove()
    with torch.no_grad():
        res["removed_equal"] = torch.equal(m(**kw)[0], ref if rank == 0 else ref2)
    # opting out: one copy per rank, no segment
    m3, blocks3, _ = _blocks_module()
    h3 = offload(m3, OffloadConfig("chunkflow", "64KB", 0.3, share_host=False), device="cpu", blocks=blocks3)
    res["unshared"] = dict(shared_blocks=h3.stats().shared_blocks, host_bytes=h3.stats().host_bytes,
                           maps=memfd_memory()["maps"])
    h3.remove()
    # blocks given out of order: laid out again in the order they ran, each still streaming its own bytes
    m5, blocks5, _ = _blocks_module()
    h5 = offload(m5, OffloadConfig("chunkflow", "64KB", 0.3), device="cpu", blocks=list(reversed(list(m5.blocks))))
    with torch.no_grad():
        outs5 = [m5(**kw)[0] for _ in range(3)]
    res["reordered"] = dict(equal=all(torch.equal(o, ref) for o in outs5), reorders=h5.stats().reorders,
                            shared_blocks=h5.stats().shared_blocks)
    h5.remove()
    # a component parked between its phases (mode none): one parked copy per host
    m4, _, _ = _blocks_module()
    with torch.no_grad():
        ref4 = m4(**kw)[0]
    h4 = offload(m4, "none", device="cpu")
    h4.park()
    dist.barrier()
    parked = memfd_memory()
    with torch.no_grad():
        out4 = m4(**kw)[0]  # unparks
    h4.park()
    with torch.no_grad():
        out4b = m4(**kw)[0]
    res["park"] = dict(equal=torch.equal(out4, ref4) and torch.equal(out4b, ref4), mem=parked,
                       shared_park_bytes=h4.stats().shared_park_bytes)
    h4.remove()
    dist.barrier()
    gathered = [None, None]
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def shared_result(tmp_path_factory, workers):
    before = dev_shm()
    got = workers(__file__, 2, tmp_path_factory.mktemp("shared") / "result.json", timeout=240)
    return got, before


@pytest.mark.slow
def test_two_ranks_stream_bit_identically_from_one_segment(shared_result):
    (r0, r1), _ = shared_result
    for r in (r0, r1):
        s = r["stream"]
        assert s["equal"], "offload with a shared host copy changed the output"
        assert s["shared_blocks"] == 3 and s["shared_bytes"] >= s["shared_tail"] > 0
        # the rank's own store holds the heads only: the streamed tails are not in it
        assert s["host_bytes"] < s["shared_tail"] and s["host_bytes"] >= s["resident"]
    assert r0["stream"]["owner"] and not r1["stream"]["owner"]
    assert r0["stream"]["shared_bytes"] == r1["stream"]["shared_bytes"]


@pytest.mark.slow
def test_the_segment_is_counted_once_in_the_two_processes_memory(shared_result):
    (r0, r1), _ = shared_result
    seg = r0["stream"]["shared_bytes"]
    m0, m1 = r0["stream"]["mem"], r1["stream"]["mem"]
    # each process maps it shared (and copy-on-write for its tensors' views): every page it touched is in its Rss,
    # but proportional memory splits each shared page between the two
    assert m0["maps"] >= 1 and m1["maps"] >= 1
    assert m0["Rss"] >= r0["stream"]["shared_tail"] and m1["Rss"] >= r1["stream"]["shared_tail"]
    total_pss = m0["Pss"] + m1["Pss"]
    assert abs(total_pss - seg) <= 0.02 * seg + 8 * 4096, (total_pss, seg)


@pytest.mark.slow
def test_a_write_stays_on_its_rank(shared_result):
    (r0, r1), _ = shared_result
    assert r0["write"]["equal_loaded"] and r0["write"]["shared_blocks"] == 3 and not r0["write"]["warned"]
    assert r1["write"]["equal_written"] and not r1["write"]["equal_loaded"]
    assert r1["write"]["shared_blocks"] == 2 and r1["write"]["warned"]  # the written block left the segment
    assert r0["removed_equal"] and r1["removed_equal"]  # remove() gives back each rank's own values


@pytest.mark.slow
def test_blocks_laid_out_again_in_the_order_they_ran_stream_their_own_bytes(shared_result):
    (r0, r1), _ = shared_result
    for r in (r0, r1):
        assert r["reordered"]["reorders"] == 1 and r["reordered"]["shared_blocks"] == 3
        assert r["reordered"]["equal"]


@pytest.mark.slow
def test_opting_out_keeps_one_copy_per_rank(shared_result):
    (r0, r1), _ = shared_result
    for r in (r0, r1):
        assert r["unshared"]["shared_blocks"] == 0 and r["unshared"]["maps"] == 0
        assert r["unshared"]["host_bytes"] > r["stream"]["host_bytes"] + r["stream"]["shared_tail"] * 0.9


@pytest.mark.slow
def test_a_parked_component_is_one_copy_per_host(shared_result):
    (r0, r1), _ = shared_result
    for r in (r0, r1):
        assert r["park"]["equal"]
        assert r["park"]["shared_park_bytes"] > 0 and r["park"]["mem"]["maps"] >= 1
    seg = r0["park"]["shared_park_bytes"]
    assert abs(r0["park"]["mem"]["Pss"] + r1["park"]["mem"]["Pss"] - seg) <= 0.02 * seg + 8 * 4096


@pytest.mark.slow
def test_nothing_left_in_dev_shm_after_a_normal_exit(shared_result):
    _, before = shared_result
    assert [f for f in dev_shm() if f not in before and "chunkflow" in f] == []


# ------------------------------------------------------------------------------------------------- kills

KILL_WORKER = r'''
import os, signal, sys, time, json
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
from test_shared_host import _blocks_module, memfd_memory
from chunkflow.runtime import hostshare
from chunkflow.runtime.handle import offload

scenario, flags = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["LOCAL_RANK"])
if scenario == "owner-dies-filling" and rank == 0:  # dies once rank 1 holds the segment, before saying it is filled
    def die(self):
        while len(self._ranks) < 1:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    hostshare.SharedSegment.mark_filled = die
m, blocks, kw = _blocks_module()
if scenario == "other-weights" and rank == 1:  # the same layout, one weight of it changed (a fine-tune's)
    with torch.no_grad():
        m.blocks[1].attn1.to_q.weight.mul_(1.01)
with torch.no_grad():
    ref = m(**kw)[0]
residency = 0.5 if scenario == "mismatch" and rank == 1 else 0.3  # rank 1 lays its blocks out otherwise
try:
    h = offload(m, "chunkflow", chunk_size="64KB", residency=residency, device="cpu", blocks=blocks)
except hostshare.HostShareError as exc:
    (flags / f"error{{rank}}").write_text(str(exc))
    sys.exit(3)
(flags / f"offloaded{{rank}}").write_text("1")
while not (flags / "go").exists():
    time.sleep(0.05)
with torch.no_grad():
    out = m(**kw)[0]
from chunkflow.hostmem import shared_segments
(flags / f"result{{rank}}").write_text(json.dumps(dict(equal=torch.equal(out, ref), maps=memfd_memory()["maps"],
                                                       inodes=sorted(shared_segments()[1]))))
h.remove()
'''


def _launch(tmp_path: Path, scenario: str) -> list[subprocess.Popen]:
    script = tmp_path / "kill_worker.py"
    script.write_text(KILL_WORKER.format(tests=str(HERE)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", LOCAL_WORLD_SIZE="2",
               TORCHELASTIC_RUN_ID=f"kill-{os.getpid()}-{scenario}-{time.time_ns()}")
    return [subprocess.Popen([sys.executable, str(script), scenario, str(tmp_path)],
                             env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for r in (0, 1)]


def _wait_for(path: Path, procs, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, [p.communicate(timeout=5) for p in procs if p.poll() is not None]
        time.sleep(0.05)


def _holders(inodes: list[int]) -> int:
    """Processes still mapping one of these chunkflow segments (by inode: other tests' processes may hold their own)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        n += any("memfd:chunkflow" in line and len(line.split()) > 4 and int(line.split()[4]) in inodes
                 for line in lines)
    return n


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_leaves_the_other_streaming_and_nothing_behind(tmp_path, victim):
    pytest.importorskip("diffusers")
    before = dev_shm()
    procs = _launch(tmp_path, "kill")
    for r in (0, 1):
        _wait_for(tmp_path / f"offloaded{r}", procs)
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].wait(timeout=30)
    (tmp_path / "go").write_text("1")
    survivor = procs[1 - victim]
    out, err = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, err[-3000:]
    got = json.loads((tmp_path / f"result{1 - victim}").read_text())
    assert got["equal"] and got["maps"] >= 1  # the segment outlives its owner while a rank maps it
    assert [f for f in dev_shm() if f not in before and "chunkflow" in f] == []
    assert got["inodes"]
    assert all(p.poll() is not None for p in procs) and _holders(got["inodes"]) == 0  # its pages went with the last
    # process that mapped it


@pytest.mark.slow
def test_an_owner_killed_while_filling_is_an_error_on_the_other_rank_not_a_hang(tmp_path):
    pytest.importorskip("diffusers")
    procs = _launch(tmp_path, "owner-dies-filling")
    out0, _ = procs[0].communicate(timeout=120)
    assert procs[0].returncode == -signal.SIGKILL
    out1, err1 = procs[1].communicate(timeout=60)
    assert procs[1].returncode == 3, err1[-3000:]
    said = (tmp_path / "error1").read_text()
    assert "local rank 0 stopped before the shared host copy was ready" in said


CODEC_WORKER = r'''
import os, sys, time, json
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
from test_shared_host import memfd_memory
from test_disk_tier import _build, _forward

folder, flags = Path(sys.argv[1]), Path(sys.argv[2])
rank = int(os.environ["LOCAL_RANK"])
ref_m, ref_h = _build(folder, "demo-wan", torch.bfloat16, mode="none")
ref = _forward(ref_m, "demo-wan", torch.bfloat16)
ref_h.remove()
m, h = _build(folder, "demo-wan", torch.bfloat16, mode="chunkflow", chunk_bytes=16000, residency=0.0,
              codec="exponent-pack")
out = _forward(m, "demo-wan", torch.bfloat16)
(flags / f"held{{rank}}").write_text("1")
while not all((flags / f"held{{r}}").exists() for r in (0, 1)):
    time.sleep(0.05)
time.sleep(0.3)
st = h.stats()
res = dict(equal=torch.equal(out, ref), shared=st.codec_shared_bytes, host=st.codec_host_bytes,
           stored=st.codec_stored_bytes, mem=memfd_memory())
(flags / f"seen{{rank}}").write_text("1")
while not all((flags / f"seen{{r}}").exists() for r in (0, 1)):
    time.sleep(0.05)
h.remove()
(flags / f"result{{rank}}").write_text(json.dumps(res))
'''


@pytest.mark.slow
def test_encoded_blocks_are_one_copy_per_host_too(tmp_path):
    """With the codec, local rank 0 encodes the blocks once into a segment the other rank maps with their chunk
    tables: both stream bit-identically to no offload, and the encoded bytes count once in the two processes."""
    pytest.importorskip("safetensors")
    from test_disk_tier import _saved

    import torch

    folder = _saved(tmp_path, "demo-wan", torch.bfloat16)
    script = tmp_path / "codec_worker.py"
    script.write_text(CODEC_WORKER.format(tests=str(HERE)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", LOCAL_WORLD_SIZE="2",
               TORCHELASTIC_RUN_ID=f"codec-{os.getpid()}-{time.time_ns()}")
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(tmp_path)],
                              env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"result{r}").read_text()) for r in (0, 1))
    assert r0["equal"] and r1["equal"]
    assert r0["shared"] == r1["shared"] > 0 and r0["stored"] == r1["stored"] > 0
    assert r0["shared"] >= r0["stored"]  # every encoded block is in the one segment
    total_pss = r0["mem"]["Pss"] + r1["mem"]["Pss"]
    assert abs(total_pss - r0["shared"]) <= 0.02 * r0["shared"] + 8 * 4096, (total_pss, r0["shared"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario,said", [("mismatch", "lays out its weights differently from local rank 0"),
                                           ("other-weights", "holds other weights than local rank 0")])
def test_a_rank_laid_out_otherwise_or_with_other_weights_is_refused(tmp_path, scenario, said):
    """Rank 1 offloads with another residency, or other weights in the same layout, at the same call: its offload is
    refused, saying why and how to run (the same weights and setting everywhere, or CHUNKFLOW_SHARE_HOST=0), never
    streaming rank 0's weights as its own; rank 0 goes on."""
    pytest.importorskip("diffusers")
    procs = _launch(tmp_path, scenario)
    _wait_for(tmp_path / "offloaded0", procs)
    _, err1 = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 3, err1[-3000:]
    text = (tmp_path / "error1").read_text()
    assert said in text and "CHUNKFLOW_SHARE_HOST=0" in text
    (tmp_path / "go").write_text("1")
    _, err0 = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 0, err0[-3000:]
    assert json.loads((tmp_path / "result0").read_text())["equal"]


# ------------------------------------------------------------------------ a generation under SP against its plan


def _small_gpus(path: Path) -> Path:
    """Two GPUs as h200-x2 lists them, without the context's and margin's memory and with a CPU too slow to run a
    text encoder: a budget just over the medium text encoder places it for its phase (parked outside it)."""
    import yaml

    from chunkflow_planner.catalog import get_hardware

    hw = get_hardware("h200-x2").model_dump(mode="json")
    hw.update(name="small-x2", context_bytes=0, reserve_fraction=0.0, mem_margin=0.0, cpu_tflops=1e-5)
    path.write_text(yaml.safe_dump(hw))
    return path


@pytest.mark.slow
def test_sp_generation_holds_the_plans_shared_copy_once_per_host(cli, workdir, torchrun):
    """`torchrun --nproc-per-node 2 -m chunkflow run --plan P --prompt ...` with a plan whose text encoder is parked
    outside its phase: the report's shared bytes are the plan's shared host memory, the host's memory is its ranks'
    own plus the shared copy once, and without sharing (--no-share-host) the host holds one more copy of it, as the
    plan says."""
    from pipelines import save_catalog_pipeline

    folder = save_catalog_pipeline("medium", workdir / "medium")
    hw = _small_gpus(workdir / "small-x2.yaml")
    from chunkflow_planner.catalog import get_model

    te_bytes = get_model("medium").pipeline.text_encoders[0].nbytes
    budget = f"{te_bytes + 500_000}B"
    got = {}
    for share in (True, False):
        name = "shared" if share else "private"
        args = ["plan", "--model", "medium", "--hardware", str(hw), "--sp", "2", "--mem-budget", budget, "--out",
                f"{name}.json"] + ([] if share else ["--no-share-host"])
        result = cli(*args)
        assert result.exit_code == 0, result.output
        plan = json.loads(Path(f"{name}.json").read_text())
        places = {c["name"]: c["placement"] for c in plan["pipeline"]["components"]}
        assert places["text_encoder"] == "phase", places  # the case this test is about
        torchrun(2, ["-m", "chunkflow", "run", "--plan", f"{name}.json", "--weights", str(folder), "--prompt",
                     "a red fox", "--report", f"{name}-r.json", "--warmup", "0"], timeout=240)
        g = json.loads(Path(f"{name}-r.json").read_text())["generation"]
        got[name] = (plan["prediction"], g)
    (p_s, g_s), (p_p, g_p) = got["shared"], got["private"]
    shared = p_s["host_memory_shared_bytes"]
    assert shared >= te_bytes and p_p["host_memory_shared_bytes"] in (0, None)
    # what the ranks share is what the plan shares (a segment is whole pages and 256-byte aligned tensors)
    assert shared <= g_s["host_shared_bytes"] <= shared * 1.01 + 64 * 4096, (g_s["host_shared_bytes"], shared)
    assert g_p["host_shared_bytes"] == 0
    for g in (g_s, g_p):
        assert len(g["host_peak_per_rank_bytes"]) == 2
        assert g["host_peak_per_host_bytes"] == sum(g["host_peak_per_rank_bytes"]) + g["host_shared_bytes"]
    # one more copy of the text encoder on the host without sharing: the plans' difference, measured
    planned = p_p["host_memory_bytes"] - p_s["host_memory_bytes"]
    measured = g_p["host_peak_per_host_bytes"] - g_s["host_peak_per_host_bytes"]
    assert planned == pytest.approx(shared, rel=0.01)
    # (peaks of two processes each run: their own parts vary by tens of MB from run to run on a busy CPU)
    assert 0.5 * planned <= measured <= 1.5 * planned, (measured, planned)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _worker(sys.argv[1])
    # the ranks end here, their results written: without Python's finalization, where gloo's teardown has aborted
    # a rank after its work ("terminate called without an active exception", twice in CI on 2026-12-06)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
