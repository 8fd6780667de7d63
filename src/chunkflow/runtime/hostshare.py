"""Host memory shared by the ranks of one host in a torchrun job: a segment local rank 0 makes and fills, that the
other local ranks of the host map (runtime/tiers/shared.py streams from it and parks in it).

- **No name, no leak.** A segment is a memfd (`os.memfd_create`): it has no path in /dev/shm or anywhere else, so
  nothing is left behind by an exit, a crash or a kill; its pages are freed when the last process holding a map or a
  descriptor of it ends. (It is not bounded by a container's small /dev/shm either: it is charged to the memory of the
  processes that touch it, like any shared memory.)
- **Rendezvous without files or torch.distributed.** Local rank 0 (the owner) listens on an abstract Unix socket
  (Linux; it vanishes with the socket) named after the job (torchrun's run id, master address and port, the node's
  group rank and restart count) and the segment's number in this process; each other local rank connects, receives
  the segment's descriptor (SCM_RIGHTS) and its manifest, and later waits for the owner's word that it is filled. The
  owner never waits for them. A rank whose owner is gone (killed, failed) is told so at once (its socket closes), not
  left waiting.
- **The same segments in the same order.** Every local rank makes the same offload calls in the same order (the
  pipeline builders do); the manifest (what a segment holds, byte for byte where, and a digest of its values: runtime/digest.py) is compared, and a rank whose
  layout differs from the owner's is refused with what to do.

`host_group()` says whether this process shares (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE with more than one local
rank, and CHUNKFLOW_SHARE_HOST not 0/off/false: the opt-out for ranks that must not share).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch

from chunkflow.runtime.errors import OffloadError

SHARE_ENV = "CHUNKFLOW_SHARE_HOST"
TIMEOUT_ENV = "CHUNKFLOW_SHARE_TIMEOUT"  # seconds a rank waits for its host's rank 0 to offer a segment
DEFAULT_TIMEOUT_S = 600.0
PAGE = 4096

# The one process-wide state of the runtime outside a handle: the number of segments this process made so far, which
# names the next (every local rank counts the same offload calls, as torch.distributed numbers its groups).
_SEQUENCE = itertools.count()


class HostShareError(OffloadError):
    """The ranks of one host could not share a segment; the message says why and what to do."""


@dataclass(frozen=True)
class HostGroup:
    """This process's place among the ranks of its host (torchrun's environment)."""

    local_rank: int
    local_world: int
    job: str  # names the job's sockets

    @property
    def owner(self) -> bool:
        return self.local_rank == 0


def share_opted_out() -> bool:
    return os.environ.get(SHARE_ENV, "").strip().lower() in ("0", "off", "false", "no")


def host_group() -> HostGroup | None:
    """This process's host group where it shares host memory with other local ranks, else None (not under torchrun,
    one local rank, CHUNKFLOW_SHARE_HOST=0, or not Linux)."""
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
    if local_world < 2 or share_opted_out() or not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return None
    parts = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                              "TORCHELASTIC_RESTART_COUNT")]
    job = hashlib.sha1("|".join([str(os.getuid()), *parts]).encode()).hexdigest()[:20]
    return HostGroup(local_rank, local_world, job)


def _timeout_s() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _address(group: HostGroup, seq: int) -> str:
    return f"\0chunkflow-{group.job}-{seq}"


def _mapped(fd: int, nbytes: int, private: bool) -> torch.Tensor:
    """The segment mapped as a flat uint8 tensor: shared (what the owner writes, what the GPU copies from) or private
    copy-on-write (a write lands in this process's own pages; the segment never changes)."""
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return bytes(out)


class SharedSegment:
    """One segment of host memory shared by the ranks of a host (module docstring). `shared` is the shared map (the
    owner writes into it; the copy stream reads it), `private` a copy-on-write map (what tensors view outside their
    forward). Made with `open`; `mark_filled()` by the owner once written, `wait_filled()` by the others before
    reading; `close()` lets go of this process's share."""

    def __init__(self, group: HostGroup, seq: int, nbytes: int, fd: int, what: str):
        self.group, self.seq, self.nbytes, self.fd, self.what = group, seq, nbytes, fd, what
        self.shared = _mapped(fd, nbytes, private=False)
        self.private = _mapped(fd, nbytes, private=True)
        self.filled = False
        self._listener: socket.socket | None = None
        self._peers: list[socket.socket] = []
        self._served = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._conn: socket.socket | None = None  # a peer's connection to the owner
        self._manifest = b""
        self.extra = None  # what the owner made and the peers take as it is (offer_filled / join_filled)

    # ---- making or joining

    @classmethod
    def open(cls, group: HostGroup, manifest: dict, nbytes: int, what: str) -> SharedSegment:
        """The owner makes the segment (nbytes, zero-filled) and offers it; another local rank joins the owner's,
        checking its manifest against its own. `what`: the module, for messages."""
        seq = next(_SEQUENCE)
        nbytes = _pages(nbytes)
        check = dict(manifest, nbytes=nbytes)
        if group.owner:
            return cls._create(group, seq, nbytes, _body(check, nbytes, None), what)
        return cls._join(group, seq, check, what)

    @classmethod
    def new_fd(cls, what: str, nbytes: int = 0) -> int:
        """An empty memfd for an owner to write before it offers it (`offer_filled`)."""
        fd = os.memfd_create(f"chunkflow-{what}"[:200], os.MFD_CLOEXEC)
        if nbytes:
            try:
                os.ftruncate(fd, _pages(nbytes))
            except OSError:
                os.close(fd)
                raise
        return fd

    @classmethod
    def offer_filled(cls, group: HostGroup, fd: int, nbytes: int, manifest: dict, extra, what: str
                     ) -> SharedSegment:
        """The owner offers a segment it has written already (`fd`, `nbytes` of it), with `extra` (JSON) the peers
        take as it is; the peers call `join_filled` with their own `manifest` at the same point."""
        seq = next(_SEQUENCE)
        nbytes = _pages(nbytes)
        os.ftruncate(fd, nbytes)
        seg = cls._create(group, seq, nbytes, _body(manifest, nbytes, extra), what, fd=fd)
        seg.extra = extra
        seg.mark_filled()
        return seg

    @classmethod
    def join_filled(cls, group: HostGroup, manifest: dict, what: str) -> SharedSegment:
        """A peer: the owner's filled segment (its size and `extra` as the owner made them), its manifest checked
        against this rank's."""
        return cls._join(group, next(_SEQUENCE), manifest, what)

    @classmethod
    def _create(cls, group: HostGroup, seq: int, nbytes: int, body: bytes, what: str, fd: int | None = None
                ) -> SharedSegment:
        made = fd is None
        try:
            if made:
                fd = cls.new_fd(what, nbytes)
            seg = cls(group, seq, nbytes, fd, what)
        except OSError as exc:
            if made and fd is not None:
                os.close(fd)
            raise HostShareError(f"{what}: a shared host segment of {nbytes} bytes could not be made: "
                                 f"{exc.strerror or exc}; free host memory, or set {SHARE_ENV}=0") from None
        seg._manifest = body
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lst.bind(_address(group, seq))
        except OSError as exc:
            lst.close()
            seg.close()
            raise HostShareError(f"{what}: the rendezvous of the ranks of this host could not start ({exc}); another "
                                 f"job with the same torchrun address runs here? Set {SHARE_ENV}=0 to pin one host "
                                 "copy per rank") from None
        lst.listen(group.local_world)
        seg._listener = lst
        seg._thread = threading.Thread(target=seg._serve, name="chunkflow-hostshare", daemon=True)
        seg._thread.start()
        return seg

    def _serve(self) -> None:
        """The owner's side: give each peer that connects the descriptor and manifest (and the filled word, once
        filled); ends when every other local rank is served and told, or the segment is closed."""
        lst = self._listener
        while lst is not None:
            try:
                conn, _ = lst.accept()
            except OSError:
                return  # closed
            try:
                socket.send_fds(conn, [len(self._manifest).to_bytes(8, "little")], [self.fd])
                conn.sendall(self._manifest)
                with self._lock:
                    if self.filled:
                        conn.sendall(b"R")
                        conn.close()
                    else:
                        self._peers.append(conn)
                    self._served += 1
                    done = self._served >= self.group.local_world - 1 and self.filled
            except OSError:
                conn.close()
                continue
            if done:
                self._stop_listening()
                return

    @classmethod
    def _join(cls, group: HostGroup, seq: int, check: dict, what: str) -> SharedSegment:
        deadline = time.monotonic() + _timeout_s()
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(_address(group, seq))
                break
            except OSError:
                conn.close()
                if time.monotonic() > deadline:
                    raise HostShareError(
                        f"{what}: local rank {group.local_rank} waited {_timeout_s():.0f} s for local rank 0 to offer "
                        f"the shared host copy (segment {seq}); every rank of a host must offload the same modules in "
                        f"the same order. Set {SHARE_ENV}=0 to pin one copy per rank") from None
                time.sleep(0.02)
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 8, 1)
            if len(msg) != 8 or not fds:
                raise ConnectionError("no descriptor")
            theirs = _recv_exact(conn, int.from_bytes(msg, "little"))
        except (OSError, ConnectionError):
            conn.close()
            raise HostShareError(_owner_gone(what)) from None
        fd = fds[0]
        try:
            offered = json.loads(theirs)
        except ValueError:
            offered = {}
        ours = json.loads(json.dumps(check))  # as JSON carries it (tuples as lists)
        if offered.get("check") != ours:
            os.close(fd)
            conn.close()
            theirs_check = offered.get("check") or {}
            if theirs_check.get("values") != ours.get("values") and {**theirs_check, "values": None} == {
                    **ours, "values": None}:
                raise HostShareError(
                    f"{what}: local rank {group.local_rank} holds other weights than local rank 0 at the same offload "
                    f"call (another checkpoint, seed or fine-tune: the digests of their values differ), laid out the same way; "
                    f"the ranks of a host share host memory only for the same weights. Load the same weights on "
                    f"every rank, or set {SHARE_ENV}=0 (one host copy per rank)")
            raise HostShareError(
                f"{what}: local rank {group.local_rank} lays out its weights differently from local rank 0 (another "
                f"module, setting or dtype at the same offload call: "
                f"{_first_difference(offered.get('check') or {}, ours)}); the ranks of "
                f"a host share host memory only for the same modules offloaded the same way. Offload the same model "
                f"with the same setting on every rank, or set {SHARE_ENV}=0 (one host copy per rank)")
        try:
            seg = cls(group, seq, int(offered["nbytes"]), fd, what)
            seg.extra = offered.get("extra")
        except OSError as exc:
            os.close(fd)
            conn.close()
            raise HostShareError(f"{what}: the shared host copy could not be mapped: {exc.strerror or exc}") from None
        seg._conn = conn
        return seg

    # ---- filling

    def mark_filled(self) -> None:
        """The owner: every byte is written; the peers waiting may read."""
        with self._lock:
            self.filled = True
            peers, self._peers = self._peers, []
            done = self._served >= self.group.local_world - 1
        for conn in peers:
            try:
                conn.sendall(b"R")
            except OSError:
                pass
            conn.close()
        if done:
            self._stop_listening()

    def wait_filled(self) -> None:
        """A peer: return once the owner has written every byte (at once after the first time); HostShareError where
        the owner went away first."""
        if self.filled:
            return
        if self._conn is None:
            raise HostShareError(f"{self.what}: the shared host copy was closed")
        try:
            word = self._conn.recv(1)
        except OSError:
            word = b""
        self._conn.close()
        self._conn = None
        if word != b"R":
            raise HostShareError(_owner_gone(self.what))
        self.filled = True

    # ---- letting go

    def _stop_listening(self) -> None:
        lst, self._listener = self._listener, None
        if lst is not None:
            try:
                lst.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lst.close()

    def close(self) -> None:
        """This process lets go of the descriptor, the rendezvous and its maps; a map goes with the last tensor
        viewing it (the pages with the last process)."""
        self._stop_listening()
        with self._lock:
            peers, self._peers = self._peers, []
        for conn in peers:
            conn.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.shared = self.private = None  # this object's maps (tensors viewing them keep them until they go)


def _owner_gone(what: str) -> str:
    return (f"{what}: local rank 0 stopped before the shared host copy was ready (it failed or was killed: see its own "
            f"error); this rank cannot go on without it. To run ranks that do not depend on each other's host memory, "
            f"set {SHARE_ENV}=0")


def _pages(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def _body(check: dict, nbytes: int, extra) -> bytes:
    """What the owner sends each peer: the manifest it checks, the segment's size, the owner's `extra`."""
    return json.dumps({"check": check, "nbytes": nbytes, "extra": extra}, sort_keys=True).encode()


def _first_difference(a: dict, b: dict) -> str:
    """A short account of where two manifests differ."""
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"{k}: rank 0 has {str(a.get(k))[:80]}, this rank {str(b.get(k))[:80]}"
    return "none found"
