"""Who can reach the host copy the ranks of a host share (runtime/hostshare.py, issue 51): only this job's ranks.

A second local uid (a child that drops to `nobody`) gets no descriptor and does not count as a rank; a forged or
mismatching peer credential is refused; the memfd a peer gets is read-only and sealed; a squatter on a socket name
is a one-line error, not a hang; CHUNKFLOW_SHARE_TIMEOUT is parsed strictly; ranks whose values differ in one byte
(one the old sampled fingerprint never read) are refused, with and without the codec; and after remove() (or a
refusal) a rank holds its own values. The in-process cases run the owner and the peer in one process (a process is
its own sibling: the same launcher started it); the others start sibling processes, as torchrun does.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkflow.runtime import hostshare as hs

HERE = Path(__file__).parent
SRC = HERE.parent / "src"
NOBODY = 65534


def _group(rank: int, job: str, timeout: float = 5.0) -> hs.HostGroup:
    return hs.HostGroup(rank, 2, job, timeout)


def _owner_and_peer(manifest: dict | None = None, fill: bytes = b"\x07" * 100):
    """An owner's filled segment and a peer's (in this process), the job's name fresh."""
    job = uuid.uuid4().hex
    seq = next(hs._SEQUENCE)
    man = dict(manifest or {"module": "m", "values": "v"}, nbytes=hs._pages(len(fill)))
    owner = hs.SharedSegment._create(_group(0, job), seq, hs._pages(len(fill)), hs._body(man, man["nbytes"], None), "m")
    owner.writable[: len(fill)].copy_(torch.frombuffer(bytearray(fill), dtype=torch.uint8))
    peer = hs.SharedSegment._join(_group(1, job), seq, man, "m")
    owner.mark_filled()
    peer.wait_filled()
    return owner, peer


def _until(cond, limit: float = 10.0) -> None:
    """Wait for the owner's thread to have done what a client saw it do (it counts a rank after sending)."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.01)


def _raw_client(address: str, hello: bytes | None, timeout: float = 2.0) -> tuple[bytes, list[int]]:
    """What a bare client gets from a rendezvous socket: the first message and any descriptors (b"" if dropped)."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(timeout)
    try:
        c.connect(address)
        if hello is not None:
            c.sendall(hello)
        msg, fds, _, _ = socket.recv_fds(c, 8, 2)
        if len(msg) == 8:
            hs._recv_exact(c, int.from_bytes(msg, "little"))  # the manifest: read, as a rank does
        return msg, fds
    except (ConnectionError, TimeoutError, OSError):
        return b"", []
    finally:
        c.close()


# ------------------------------------------------------------------------------------------- the timeout


@pytest.mark.parametrize("raw", ["nan", "abc", "-1", "0", "inf", "-inf", "1e999", "NaN", " 0.0 "])
def test_a_bad_share_timeout_is_a_one_line_error_naming_it(raw):
    with pytest.raises(hs.HostShareError) as info:
        hs.share_timeout(raw)
    said = str(info.value)
    assert "\n" not in said and hs.TIMEOUT_ENV in said and repr(raw) in said


def test_a_good_share_timeout_is_taken_and_none_is_the_default():
    assert hs.share_timeout("2.5") == 2.5 and hs.share_timeout(" 60 ") == 60.0
    assert hs.share_timeout("") == hs.DEFAULT_TIMEOUT_S


def test_host_group_refuses_a_bad_timeout_under_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(hs.TIMEOUT_ENV, "nan")
    with pytest.raises(hs.HostShareError, match=hs.TIMEOUT_ENV):
        hs.host_group()
    monkeypatch.setenv(hs.TIMEOUT_ENV, "7")
    assert hs.host_group().timeout_s == 7.0


# ------------------------------------------------------------------------------------------- names


def test_socket_names_tell_nothing_of_the_next():
    g = _group(0, "job")
    names = [hs._address(g, s) for s in range(3)]
    assert len(set(names)) == 3  # a digest each: neither the job nor the number shows
    assert all("job" not in n and not n.endswith(f"-{s}") for s, n in enumerate(names))
    assert hs._address(g, 1) != hs._address(_group(0, "other-job"), 1)


# ------------------------------------------------------------------------------------------- sealed, read-only


def test_a_peer_gets_a_read_only_descriptor_of_a_sealed_segment():
    owner, peer = _owner_and_peer()
    try:
        assert bytes(peer.shared[:100].numpy()) == b"\x07" * 100
        assert os.O_RDONLY == hs.fcntl.fcntl(peer.fd, hs.fcntl.F_GETFL) & os.O_ACCMODE
        assert hs._sealed(peer.fd) and hs._sealed(owner.fd) and owner.writable is None
        with pytest.raises(OSError):
            os.write(peer.fd, b"x")
        with pytest.raises(OSError):  # a writable shared map: not from the read-only descriptor...
            mmap.mmap(peer.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        rw = os.open(f"/proc/self/fd/{peer.fd}", os.O_RDWR)  # ... nor from one reopened read-write (the seal)
        try:
            for attempt in (lambda: os.write(rw, b"x"), lambda: os.ftruncate(rw, 0), lambda: os.ftruncate(rw, 1 << 20),
                            lambda: mmap.mmap(rw, 4096, flags=mmap.MAP_SHARED,
                                              prot=mmap.PROT_READ | mmap.PROT_WRITE)):
                with pytest.raises(OSError) as info:
                    attempt()
                assert info.value.errno == errno.EPERM
            with pytest.raises(OSError):  # nor the seals undone
                hs.fcntl.fcntl(rw, hs.fcntl.F_ADD_SEALS, 0)
        finally:
            os.close(rw)
        cow = peer.private[:4]  # copy-on-write views stay possible: a write lands in this process's own pages
        cow.fill_(9)
        assert bytes(peer.shared[:4].numpy()) == b"\x07" * 4 and bytes(owner.shared[:4].numpy()) == b"\x07" * 4
    finally:
        owner.close()
        peer.close()


def test_a_peer_refuses_an_unsealed_segment(monkeypatch):
    monkeypatch.setattr(hs, "SEALS", hs.fcntl.F_SEAL_SHRINK)  # an owner that seals less than it should
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    man = {"module": "m", "nbytes": 4096}
    owner = hs.SharedSegment._create(_group(0, job), seq, 4096, hs._body(man, 4096, None), "m")
    peer = hs.SharedSegment._join(_group(1, job), seq, man, "m")
    owner.mark_filled()
    monkeypatch.setattr(hs, "SEALS", hs.fcntl.F_SEAL_WRITE | hs.fcntl.F_SEAL_SHRINK | hs.fcntl.F_SEAL_GROW
                        | hs.fcntl.F_SEAL_SEAL)
    with pytest.raises(hs.HostShareError, match="not sealed"):
        peer.wait_filled()
    owner.close()
    peer.close()


# ------------------------------------------------------------------------------------------- hello and credentials


def test_impostors_and_duplicates_are_dropped_without_counting():
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    man = {"module": "m", "nbytes": 4096}
    owner = hs.SharedSegment._create(_group(0, job), seq, 4096, hs._body(man, 4096, None), "m")
    address = hs._address(owner.group, seq)
    try:
        with pytest.warns(UserWarning, match="refused"):
            for hello in (None, b"X\x01\x00\x00\x00", hs._HELLO + (0).to_bytes(4, "little"),
                          hs._HELLO + (2).to_bytes(4, "little")):
                assert _raw_client(address, hello, timeout=0.5 if hello is None else 2.0) == (b"", [])
        got = _raw_client(address, hs._HELLO + (1).to_bytes(4, "little"))  # rank 1: served
        assert len(got[1]) == 1
        [os.close(fd) for fd in got[1]]
        _until(lambda: owner._ranks == {1})
        with pytest.warns(UserWarning, match="not served yet"):
            assert _raw_client(address, hs._HELLO + (1).to_bytes(4, "little")) == (b"", [])  # rank 1 again
        assert owner._ranks == {1} and owner.refused == 5
    finally:
        owner.close()


def test_a_forged_peer_credential_gets_nothing(monkeypatch):
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    man = {"module": "m", "nbytes": 4096}
    owner = hs.SharedSegment._create(_group(0, job), seq, 4096, hs._body(man, 4096, None), "m")
    try:
        for forged in ((os.getpid(), os.getuid() + 1, 0), (1, os.getuid(), 0)):  # another uid; not a sibling
            monkeypatch.setattr(hs, "peer_credentials", lambda sock, f=forged: f)
            with pytest.warns(UserWarning, match="refused"):
                got = _raw_client(hs._address(owner.group, seq), hs._HELLO + (1).to_bytes(4, "little"))
            assert got == (b"", []) and owner._ranks == set()
        assert "uid" in hs.untrusted((os.getpid(), os.getuid() + 1, 0))
        assert "launcher" in hs.untrusted((1, os.getuid(), 0))
        assert hs.untrusted((os.getpid(), os.getuid(), os.getgid())) is None
    finally:
        owner.close()


def test_a_rank_refuses_an_owner_with_another_credential(monkeypatch):
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    man = {"module": "m", "nbytes": 4096}
    owner = hs.SharedSegment._create(_group(0, job), seq, 4096, hs._body(man, 4096, None), "m")
    monkeypatch.setattr(hs, "peer_credentials", lambda sock: (4242, os.getuid() + 1, 0))
    try:
        with pytest.raises(hs.HostShareError, match="not local rank 0 of this job") as info:
            hs.SharedSegment._join(_group(1, job), seq, man, "m")
        assert "\n" not in str(info.value)
    finally:
        owner.close()


# ------------------------------------------------------------------------------------------- bounded waits


def test_no_owner_is_an_error_within_the_timeout():
    with pytest.raises(hs.HostShareError, match="waited 0.3 s"):
        hs.SharedSegment._join(_group(1, uuid.uuid4().hex, 0.3), next(hs._SEQUENCE), {"nbytes": 4096}, "m")


def test_an_owner_that_never_fills_is_an_error_within_the_timeout():
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    man = {"module": "m", "nbytes": 4096}
    owner = hs.SharedSegment._create(_group(0, job), seq, 4096, hs._body(man, 4096, None), "m")
    try:
        peer = hs.SharedSegment._join(_group(1, job, 0.3), seq, man, "m")
        with pytest.raises(hs.HostShareError, match=f"waited 0.3 s .{hs.TIMEOUT_ENV}. for local rank 0 to fill"):
            peer.wait_filled()
        peer.close()
    finally:
        owner.close()


def test_a_name_taken_first_makes_the_owner_fail_in_one_line_naming_the_holder():
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squat.bind(hs._address(_group(0, job), seq))
    squat.listen(1)
    try:
        with pytest.raises(hs.HostShareError) as info:
            hs.SharedSegment._create(_group(0, job), seq, 4096, b"{}", "m")
        said = str(info.value)
        assert "\n" not in said and f"pid {os.getpid()}" in said and hs.SHARE_ENV in said
    finally:
        squat.close()


# ------------------------------------------------------------------------------------------- a second uid

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="a second local uid needs root (setuid to nobody)")


def _as_nobody(fn) -> dict:
    """Run fn() in a child that dropped to uid/gid nobody; its JSON result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no return
        os.close(r)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            out = {"error": repr(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    os.waitpid(pid, 0)
    return json.loads(got)


@ROOT
def test_a_second_uid_gets_no_descriptor_and_does_not_count():
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    man = {"module": "m", "values": "v", "nbytes": 4096}
    owner = hs.SharedSegment._create(_group(0, job), seq, 4096, hs._body(man, 4096, None), "m")
    address = hs._address(owner.group, seq)

    def attack() -> dict:
        msg, fds = _raw_client(address, hs._HELLO + (1).to_bytes(4, "little"))
        return {"uid": os.getuid(), "msg": msg.hex(), "fds": len(fds)}

    try:
        with pytest.warns(UserWarning, match=f"uid {NOBODY}"):
            got = _as_nobody(attack)
            time.sleep(0.2)
        assert got == {"uid": NOBODY, "msg": "", "fds": 0} and owner._ranks == set() and owner.refused == 1
        owner.writable[:3].fill_(5)
        peer = hs.SharedSegment._join(_group(1, job), seq, man, "m")  # the real rank 1 still shares
        owner.mark_filled()
        peer.wait_filled()
        assert bytes(peer.shared[:3].numpy()) == b"\x05" * 3
        _until(lambda: owner._ranks == {1})
        peer.close()
    finally:
        owner.close()


@ROOT
def test_a_squatter_of_another_uid_is_a_clear_error_not_a_hang():
    """Another user binds the job's next name first and accepts, sending nothing: the rank says so at once, within
    the timeout, taking nothing."""
    job, seq = uuid.uuid4().hex, next(hs._SEQUENCE)
    address = hs._address(_group(0, job), seq)
    ready, stop = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(4)
        os.write(ready[1], b"1")
        os.read(stop[0], 1)  # holds the name (never answering) until told
        os._exit(0)
    try:
        os.read(ready[0], 1)
        t0 = time.monotonic()
        with pytest.raises(hs.HostShareError) as info:
            hs.SharedSegment._join(_group(1, job, 30.0), seq, {"nbytes": 4096}, "m")
        assert time.monotonic() - t0 < 30.0
        said = str(info.value)
        assert "\n" not in said and f"uid {NOBODY}" in said and "not local rank 0" in said
        with pytest.raises(hs.HostShareError, match=f"uid {NOBODY}"):  # and the owner, for the same name
            hs.SharedSegment._create(_group(0, job), seq, 4096, b"{}", "m")
    finally:
        os.write(stop[1], b"1")
        os.waitpid(pid, 0)


# ------------------------------------------------------------------------------------------- values, one byte apart


def _old_sampler_positions(nbytes: int) -> np.ndarray:
    """The byte positions the sampled fingerprint (before issue 51) read: 16, plus one a MB, evenly spread."""
    k = min(nbytes, 16 + nbytes // (1 << 20))
    return np.linspace(0, nbytes - 1, k).astype(np.int64)


WORKER = r'''
import os, sys, time, json, warnings
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
from chunkflow.runtime import hostshare

scenario, flags, folder = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
rank = int(os.environ["LOCAL_RANK"])
warnings.simplefilter("ignore")
warnings.filterwarnings("always", message="chunkflow: .*refused")  # shown on stderr: the test reads it

def flip(t):  # one byte the old sampler never read: byte 1 of the tensor
    with torch.no_grad():
        t.view(-1).view(torch.uint8)[1] ^= 1

def state(m):
    return {{k: v.detach().clone() for k, v in m.state_dict().items()}}

def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

def wait_both():  # both ranks hold their handles (or rank 1 was refused) before either lets go
    (flags / f"done{{rank}}").write_text("1")
    while not all((flags / f"done{{r}}").exists() for r in (0, 1)) and not (flags / "error1").exists():
        time.sleep(0.05)

res = {{}}
if scenario == "codec":
    from test_disk_tier import _build, _forward
    ref_m, ref_h = _build(Path(folder), "demo-wan", torch.bfloat16, mode="none")
    ref, own = _forward(ref_m, "demo-wan", torch.bfloat16), state(ref_m)
    ref_h.remove()
    try:
        m, h = _build(Path(folder), "demo-wan", torch.bfloat16, mode="chunkflow", chunk_bytes=16000, residency=0.0,
                      codec="exponent-pack")
    except hostshare.HostShareError as exc:
        res["error"] = str(exc)
    else:
        res["equal"] = torch.equal(_forward(m, "demo-wan", torch.bfloat16), ref)
        res["shared"] = h.stats().codec_shared_bytes
        wait_both()
        h.remove()
        res["own_after_remove"] = same(state(m), own)
else:
    from test_shared_host import _blocks_module
    from chunkflow.runtime.handle import offload
    m, blocks, kw = _blocks_module()
    target = m.blocks[1].attn1.to_q.weight if scenario == "stream" else m.patch_embedding.weight
    if rank == 1 and folder == "differ":
        flip(target)
    res["nbytes"] = target.numel() * target.element_size()
    with torch.no_grad():
        ref = m(**kw)[0]
    own = state(m)
    try:
        if scenario == "stream":
            h = offload(m, "chunkflow", chunk_size="64KB", residency=0.3, device="cpu", blocks=blocks)
        else:
            h = offload(m, "none", device="cpu")
            h.park()
    except hostshare.HostShareError as exc:
        res["error"] = str(exc)
        res["own_after_refusal"] = same(state(m), own)
        h = None
    if h is not None:
        with torch.no_grad():
            res["equal"] = torch.equal(m(**kw)[0], ref)
        res["shared"] = h.stats().shared_blocks if scenario == "stream" else h.stats().shared_park_bytes
        if scenario == "park":
            h.park()
        wait_both()
        h.remove()
        res["own_after_remove"] = same(state(m), own)
(flags / f"result{{rank}}").write_text(json.dumps(res))
if "error" in res:
    (flags / f"error{{rank}}").write_text(res["error"])
'''


def _rank_env(run_id: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", LOCAL_WORLD_SIZE="2", CHUNKFLOW_SHARE_TIMEOUT="120",
                TORCHELASTIC_RUN_ID=run_id)


def _run_ranks(tmp_path: Path, scenario: str, folders: tuple[str, str], run_id: str = "",
               errs: list | None = None) -> list[dict]:
    """Two sibling local ranks (as torchrun's agent starts them) running WORKER; their results (and their stderr
    into `errs`)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(HERE)))
    env = _rank_env(run_id or f"trust-{uuid.uuid4().hex}")
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(tmp_path), folders[r]],
                              env=dict(env, LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        if errs is not None:
            errs.append(err)
    return [json.loads((tmp_path / f"result{r}").read_text()) for r in (0, 1)]


@ROOT
@pytest.mark.slow
def test_a_second_uid_probing_every_name_during_a_job_gets_nothing(tmp_path, monkeypatch):
    """A user `nobody` who knows the job's names (the worst case: a fixed run id) connects to each of them, over and
    over, saying it is local rank 1, while two ranks offload, stream and park: it never gets a descriptor, the owner
    refuses it (and says so), and the real ranks share and compute bit-identically."""
    pytest.importorskip("diffusers")
    run_id = f"trust-{uuid.uuid4().hex}"
    for k, v in _rank_env(run_id).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LOCAL_RANK", "1")
    group = hs.host_group()
    names = [hs._address(group, seq) for seq in range(4)]
    stop_r, stop_w = os.pipe()  # (not a file: nobody cannot see into the test's folder)

    def probe() -> dict:
        got = tries = 0
        while not select.select([stop_r], [], [], 0)[0]:
            for name in names:
                msg, fds = _raw_client(name, hs._HELLO + (1).to_bytes(4, "little"), timeout=0.2)
                got, tries = got + len(fds), tries + 1
            time.sleep(0.005)
        return {"fds": got, "tries": tries}

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        os.write(w, json.dumps(probe()).encode())
        os._exit(0)
    os.close(w)
    errs: list[str] = []
    try:
        r0, r1 = _run_ranks(tmp_path, "stream", ("same", "same"), run_id, errs)
    finally:
        os.write(stop_w, b"1")
        with os.fdopen(r) as f:
            attacker = json.loads(f.read())
        os.waitpid(pid, 0)
    assert attacker["fds"] == 0 and attacker["tries"] > 0
    assert f"runs as uid {NOBODY}" in errs[0]  # it reached the owner, which refused it
    for res in (r0, r1):
        assert res["equal"] and res["shared"] > 0 and res["own_after_remove"], res


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["stream", "park"])
def test_ranks_one_byte_apart_are_refused_and_keep_their_own_values(tmp_path, scenario):
    """Rank 1's weights differ from rank 0's in byte 1 of one tensor (of a streamed block, or of a parked module's):
    a byte the old sampled fingerprint never read. Rank 1 is refused before anything of rank 0's is bound, and holds
    its own values; rank 0 goes on, bit-identical."""
    pytest.importorskip("diffusers")
    r0, r1 = _run_ranks(tmp_path, scenario, ("same", "differ"))
    assert 1 not in _old_sampler_positions(r1["nbytes"]) and r1["nbytes"] > 64
    assert "holds other weights than local rank 0" in r1["error"] and hs.SHARE_ENV in r1["error"]
    assert r1["own_after_refusal"]
    assert r0["equal"] and r0["own_after_remove"] and "error" not in r0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["stream", "park"])
def test_ranks_with_the_same_values_share_and_hold_their_own_after_remove(tmp_path, scenario):
    pytest.importorskip("diffusers")
    r0, r1 = _run_ranks(tmp_path, scenario, ("same", "same"))
    for r in (r0, r1):
        assert r["equal"] and r["shared"] > 0 and r["own_after_remove"], r


def _flip_byte_in_file(folder: Path, tensor: str) -> int:
    """Flip byte 1 of `tensor`'s bytes in its safetensors file; the tensor's size in bytes."""
    for path in sorted(folder.glob("*.safetensors")):
        raw = bytearray(path.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        if tensor in header:
            a, b = header[tensor]["data_offsets"]
            raw[8 + n + a + 1] ^= 1
            path.write_bytes(bytes(raw))
            return b - a
    raise AssertionError(f"{tensor} not saved")


@pytest.mark.slow
def test_codec_ranks_one_byte_apart_in_their_files_are_refused(tmp_path):
    """With the codec the values are proven from the checkpoint's files: rank 1's copy differs in one byte the old
    sampler never read, and it is refused; with the same files both share and hold their own values after
    remove()."""
    pytest.importorskip("safetensors")
    from test_disk_tier import _saved

    folder = _saved(tmp_path / "a", "demo-wan", torch.bfloat16)
    other = tmp_path / "b"
    shutil.copytree(folder, other)
    nbytes = _flip_byte_in_file(other, "blocks.0.attn1.to_q.weight")
    assert 1 not in _old_sampler_positions(nbytes)
    r0, r1 = _run_ranks(tmp_path, "codec", (str(folder), str(other)))
    assert "holds other weights than local rank 0" in r1["error"]
    assert r0["equal"] and r0["own_after_remove"]
    for f in tmp_path.glob("done*"):
        f.unlink()
    (tmp_path / "error1").unlink()
    r0, r1 = _run_ranks(tmp_path, "codec", (str(folder), str(folder)))
    for r in (r0, r1):
        assert r["equal"] and r["shared"] > 0 and r["own_after_remove"], r
