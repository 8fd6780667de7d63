"""Host memory shared by the ranks of one host in a torchrun job: a segment local rank 0 makes and fills, that the
other local ranks of the host map (runtime/tiers/shared.py streams from it and parks in it).

- **No name, no leak.** A segment is a memfd (`os.memfd_create`): it has no path in /dev/shm or anywhere else, so
  nothing is left behind by an exit, a crash or a kill; its pages are freed when the last process holding a map or a
  descriptor of it ends. (It is not bounded by a container's small /dev/shm either: it is charged to the memory of the
  processes that touch it, like any shared memory.)
- **Rendezvous without files or torch.distributed.** Local rank 0 (the owner) listens on an abstract Unix socket
  (Linux; it vanishes with the socket); each other local rank connects, says which local rank it is, receives a
  read-only descriptor of the segment (SCM_RIGHTS) and its manifest, and later the owner's word that it is filled
  and sealed. The owner never waits for them. A rank whose owner is gone (killed, failed) is told so at once (its
  socket closes), not left waiting; every wait of a rank is bounded by CHUNKFLOW_SHARE_TIMEOUT.
- **The same segments in the same order.** Every local rank makes the same offload calls in the same order (the
  pipeline builders do); the manifest (what a segment holds, byte for byte where, and a digest of the values:
  runtime/digest.py) is compared, and a rank whose layout or values differ from the owner's is refused with
  what to do.

**Who can reach a segment (the threat model).** Abstract socket names are visible to every local user in
/proc/net/unix and have no permissions, so the names are not what protects the weights:
- *Credentials, both ways.* The owner reads each connection's SO_PEERCRED (set by the kernel, not forgeable) and
  sends nothing unless the peer runs as this process's uid and is a sibling of it: its parent process is the
  owner's parent (torchrun's agent starts every local rank of a host; a launcher that starts ranks otherwise must
  set CHUNKFLOW_SHARE_HOST=0). A rank checks the owner the same way before it says anything, so a squatter on the
  name (another user's process, or another job's) is a one-line error, never a source of weights or a hang.
- *A hello.* A connection counts as a rank only once it has said which local rank it is: in range, each once; an
  impostor or a duplicate is dropped without counting.
- *Sealed, read-only.* The memfd allows sealing; the owner fills it through a writable map, drops that map, and seals
  it (F_SEAL_WRITE, SHRINK, GROW, SEAL): from then on nobody can write it, grow or shrink it, or map it writable
  (the kernel refuses the seal while any writable shared map, or a pinned page, exists, so a successful seal proves
  none does). Peers get a read-only descriptor (reopened O_RDONLY through /proc/self/fd) and read nothing of the
  segment before the owner's word; a peer checks the seals itself before it reads. Page-locking (cudaHostRegister,
  read-only) comes after the seal, on every rank: a pinned page would make sealing fail.
- *Names not guessable from earlier ones.* Each segment's socket name is a SHA-256 of the job (this uid, torchrun's
  run id, master address and port, group rank, restart count, the launcher's pid and start time) and the segment's
  number: seeing one name in /proc/net/unix tells nothing of the next. Under `torchrun --standalone` the run id is
  random and only the job's own processes (same uid) can read it, so no other user can compute a name; with a
  fixed `--rdzv-id` one can, and can then only deny service (the owner's bind fails, or a rank meets a squatter:
  both one-line errors naming the holder), never read or change weights.

`host_group()` says whether this process shares (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE with more than one local
rank, and CHUNKFLOW_SHARE_HOST not 0/off/false: the opt-out for ranks that must not share).
"""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import itertools
import json
import math
import mmap
import os
import socket
import struct
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from chunkflow.runtime.errors import OffloadError, warn_user

SHARE_ENV = "CHUNKFLOW_SHARE_HOST"
TIMEOUT_ENV = "CHUNKFLOW_SHARE_TIMEOUT"  # seconds a rank waits at most for its host's rank 0, at each step
DEFAULT_TIMEOUT_S = 600.0
PAGE = 4096
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_HELLO = b"H"  # a peer's first word: then its local rank (4 bytes)
_FILLED = b"R"  # the owner's word: filled and sealed
REFUSALS_SHOWN = 8  # refused connections a segment's owner warns of

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
    job: str  # names the job's sockets (a digest: module docstring)
    timeout_s: float = DEFAULT_TIMEOUT_S  # CHUNKFLOW_SHARE_TIMEOUT, checked

    @property
    def owner(self) -> bool:
        return self.local_rank == 0


def share_opted_out() -> bool:
    return os.environ.get(SHARE_ENV, "").strip().lower() in ("0", "off", "false", "no")


def share_timeout(raw: str | None = None) -> float:
    """CHUNKFLOW_SHARE_TIMEOUT in seconds (unset or empty: the default); HostShareError for anything but a finite
    number above 0."""
    raw = os.environ.get(TIMEOUT_ENV, "") if raw is None else raw
    if not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise HostShareError(f"{TIMEOUT_ENV} must be a finite number of seconds above 0 (unset: "
                             f"{DEFAULT_TIMEOUT_S:.0f}); got {shown!r}")
    return value


def host_group() -> HostGroup | None:
    """This process's host group where it shares host memory with other local ranks, else None (not under torchrun,
    one local rank, CHUNKFLOW_SHARE_HOST=0, or not Linux). HostShareError for a bad CHUNKFLOW_SHARE_TIMEOUT."""
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
    if local_world < 2 or share_opted_out() or not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return None
    parts = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                              "TORCHELASTIC_RESTART_COUNT")]
    job = hashlib.sha256("|".join([str(os.getuid()), *parts]).encode()).hexdigest()
    return HostGroup(local_rank, local_world, job, share_timeout())


def _address(group: HostGroup, seq: int) -> str:
    """Segment `seq`'s socket name: a digest of the job and the number, so no name tells the next."""
    return "\0chunkflow-" + hashlib.sha256(f"{group.job}|{seq}".encode()).hexdigest()[:40]


# ---- who is at the other end


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the kernel recorded them at
    connect (a listener's: at listen)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def _parent(pid: int) -> str | None:
    """pid's parent process as "ppid:start time" (a reused pid is another process); None where pid is gone."""
    def stat(p: int) -> list[str] | None:
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rpartition(")")[2].split()
        except OSError:
            return None

    mine = stat(pid)
    if mine is None:
        return None
    ppid = int(mine[1])
    theirs = stat(ppid)
    return f"{ppid}:{theirs[19] if theirs else '?'}"


def untrusted(creds: tuple[int, int, int]) -> str | None:
    """Why the process of these credentials may not share this process's segments, or None where it may: it runs
    as this uid and is a sibling of this process (the same launcher, torchrun's agent, started both)."""
    pid, uid, _ = creds
    if uid != os.getuid():
        return f"pid {pid} runs as uid {uid}, this job as uid {os.getuid()}"
    theirs, mine = _parent(pid), _parent(os.getpid())
    if theirs is None or theirs != mine:
        return (f"pid {pid} was not started by this rank's launcher (pid {os.getppid()}); local ranks started "
                f"otherwise than by one torchrun agent cannot share: set {SHARE_ENV}=0")
    return None


# ---- maps and words


def _mapped(fd: int, nbytes: int, kind: str) -> tuple[mmap.mmap, torch.Tensor]:
    """The segment mapped as a flat uint8 tensor: "write" (the owner fills it; shared), "read" (shared, read-only:
    what the GPU copies from) or "private" (copy-on-write: a write lands in this process's own pages)."""
    flags = mmap.MAP_PRIVATE if kind == "private" else mmap.MAP_SHARED
    prot = mmap.PROT_READ if kind == "read" else mmap.PROT_READ | mmap.PROT_WRITE
    mm = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable": a read-only map is meant to be (a write faults)
        return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _read_only(fd: int) -> int:
    """A read-only descriptor of the memfd `fd` (what peers are given)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _sealed(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:
        return False


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return bytes(out)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


class SharedSegment:
    """One segment of host memory shared by the ranks of a host (module docstring). `shared` is the shared map,
    read-only (what the copy stream reads), `private` a copy-on-write map (what tensors view outside their forward),
    and on the owner until it is sealed `writable` (what it fills). Made with `open`; `mark_filled()` by the owner
    once written (it seals the segment), `wait_filled()` by the others before reading; `close()` lets go of this
    process's share."""

    def __init__(self, group: HostGroup, seq: int, nbytes: int, fd: int, what: str, owner: bool):
        self.group, self.seq, self.nbytes, self.fd, self.what = group, seq, nbytes, fd, what
        self.ro_fd = _read_only(fd) if owner else fd  # what a peer is given (a peer holds only this)
        try:
            self._wmap, self.writable = _mapped(fd, nbytes, "write") if owner else (None, None)
            self._rmap, self.shared = _mapped(self.ro_fd, nbytes, "read")
            self._pmap, self.private = _mapped(self.ro_fd, nbytes, "private")
        except OSError:
            if owner:
                os.close(self.ro_fd)  # (`fd` is the caller's to close)
            raise
        self.filled = False
        self.refused = 0  # connections dropped: untrusted, no hello, a rank out of range or seen before
        self._listener: socket.socket | None = None
        self._peers: list[socket.socket] = []
        self._ranks: set[int] = set()  # the local ranks served
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
        """An empty memfd that can be sealed, for an owner to write before it offers it (`offer_filled`)."""
        fd = os.memfd_create(f"chunkflow-{what}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
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
        try:
            seg.mark_filled()
        except BaseException:
            seg.close()
            raise
        return seg

    @classmethod
    def join_filled(cls, group: HostGroup, manifest: dict, what: str) -> SharedSegment:
        """A peer: the owner's filled segment (its size and `extra` as the owner made them), its manifest checked
        against this rank's, its seals checked."""
        seg = cls._join(group, next(_SEQUENCE), manifest, what)
        try:
            seg.wait_filled()
        except BaseException:
            seg.close()
            raise
        return seg

    @classmethod
    def _create(cls, group: HostGroup, seq: int, nbytes: int, body: bytes, what: str, fd: int | None = None
                ) -> SharedSegment:
        made = fd is None
        try:
            if made:
                fd = cls.new_fd(what, nbytes)
            seg = cls(group, seq, nbytes, fd, what, owner=True)
        except OSError as exc:
            if made and fd is not None:
                os.close(fd)
            raise HostShareError(f"{what}: a shared host segment of {nbytes} bytes could not be made: "
                                 f"{exc.strerror or exc}; free host memory, or set {SHARE_ENV}=0") from None
        seg._manifest = body
        try:
            seg._listener = _listen(group, seq, what)
        except HostShareError:
            seg.close()
            raise
        seg._thread = threading.Thread(target=seg._serve, name="chunkflow-hostshare", daemon=True)
        seg._thread.start()
        return seg

    def _serve(self) -> None:
        """The owner's side: give each rank that connects and proves itself (`_admit`) the read-only descriptor and
        the manifest (and the filled word, once sealed); ends when every other local rank is served and told, or
        the segment is closed."""
        lst = self._listener
        while lst is not None:
            try:
                conn, _ = lst.accept()
            except OSError:
                return  # closed
            rank = self._admit(conn)
            if rank is None:
                conn.close()
                continue
            try:
                socket.send_fds(conn, [len(self._manifest).to_bytes(8, "little")], [self.ro_fd])
                conn.sendall(self._manifest)
                with self._lock:
                    if self.filled:
                        conn.sendall(_FILLED)
                        conn.close()
                    else:
                        self._peers.append(conn)
                    self._ranks.add(rank)
                    done = len(self._ranks) >= self.group.local_world - 1 and self.filled
            except OSError:
                conn.close()
                continue
            if done:
                self._stop_listening()
                return

    def _admit(self, conn: socket.socket) -> int | None:
        """The local rank a connection proves it is, or None (dropped, not counted): its credentials first (nothing
        is read from an untrusted process), then its hello, a rank in range not served yet."""
        try:
            why = untrusted(peer_credentials(conn))
        except OSError as exc:
            why = f"its credentials could not be read ({exc})"
        rank = None
        if why is None:
            try:
                conn.settimeout(self.group.timeout_s)
                hello = _recv_exact(conn, 5)
                rank = int.from_bytes(hello[1:], "little") if hello[:1] == _HELLO else None
            except (OSError, ConnectionError):
                rank = None
            with self._lock:
                if rank is None or not 1 <= rank < self.group.local_world or rank in self._ranks:
                    why = f"it did not say a local rank in 1..{self.group.local_world - 1} not served yet"
        if why is None:
            return rank
        self.refused += 1
        if self.refused <= REFUSALS_SHOWN:  # (a flood of strangers does not flood the job's output)
            warn_user(f"chunkflow: {self.what}: a connection to the shared host copy was refused: {why}")
        return None

    @classmethod
    def _join(cls, group: HostGroup, seq: int, check: dict, what: str) -> SharedSegment:
        deadline = time.monotonic() + group.timeout_s
        conn = _connect(group, seq, what, deadline)
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 8, 2)
            if len(msg) != 8 or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise ConnectionError("no descriptor")
            fd = fds[0]
            try:
                theirs = _recv_exact(conn, int.from_bytes(msg, "little"))
            except BaseException:
                os.close(fd)
                raise
        except TimeoutError:
            conn.close()
            raise HostShareError(_waited(what, group, f"send the shared host copy (segment {seq})")) from None
        except (OSError, ConnectionError):
            conn.close()
            raise HostShareError(_owner_gone(what)) from None
        try:
            offered = _check_offer(fd, theirs, check, what, group)
            seg = cls(group, seq, int(offered["nbytes"]), fd, what, owner=False)
            seg.extra = offered.get("extra")
        except BaseException as exc:
            os.close(fd)
            conn.close()
            if isinstance(exc, OSError):
                raise HostShareError(f"{what}: the shared host copy could not be mapped: {exc.strerror or exc}"
                                     ) from None
            raise
        seg._conn = conn
        return seg

    # ---- filling

    def mark_filled(self) -> None:
        """The owner: every byte is written. The writable map goes, the segment is sealed (nobody can write it from
        now on), and the peers waiting are told they may read."""
        if self.filled:
            return
        self._seal()
        try:  # the pages it wrote, in its read-only map now: counted in its memory as they were in the writable one
            self._rmap.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
        except (OSError, ValueError):
            pass  # (Linux before 5.14: counted once read)
        with self._lock:
            self.filled = True
            peers, self._peers = self._peers, []
            done = len(self._ranks) >= self.group.local_world - 1
        for conn in peers:
            try:
                conn.sendall(_FILLED)
            except OSError:
                pass
            conn.close()
        if done:
            self._stop_listening()

    def _seal(self) -> None:
        """Drop the writable map (only once no tensor views it: closing a map under a live view would leave it
        dangling), then seal the memfd."""
        self.writable = None
        if self._wmap is not None:
            if sys.getrefcount(self._wmap) > 2:  # ours and the call's: more is a tensor's storage still viewing it
                gc.collect()
            if sys.getrefcount(self._wmap) > 2:
                raise HostShareError(f"{self.what}: a view of the shared host copy's writable map is still held, so "
                                     f"it cannot be sealed (a bug in chunkflow); set {SHARE_ENV}=0 to pin one copy "
                                     "per rank")
            self._wmap.close()
            self._wmap = None
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as exc:
            busy = " (a writable map or a page-locked page of it still exists)" if exc.errno == errno.EBUSY else ""
            raise HostShareError(f"{self.what}: the shared host copy could not be sealed: {exc.strerror or exc}"
                                 f"{busy}; set {SHARE_ENV}=0 to pin one copy per rank") from None

    def wait_filled(self) -> None:
        """A peer: return once the owner has written and sealed every byte (at once after the first time);
        HostShareError where the owner went away first, did not seal it, or took longer than the timeout."""
        if self.filled:
            return
        if self._conn is None:
            raise HostShareError(f"{self.what}: the shared host copy was closed")
        try:
            self._conn.settimeout(self.group.timeout_s)
            word = self._conn.recv(1)
        except TimeoutError:
            word = None
        except OSError:
            word = b""
        self._conn.close()
        self._conn = None
        if word is None:
            raise HostShareError(_waited(self.what, self.group, "fill the shared host copy") + "; raise "
                                 f"{TIMEOUT_ENV} where loading takes longer")
        if word != _FILLED:
            raise HostShareError(_owner_gone(self.what))
        if not _sealed(self.fd):
            raise HostShareError(f"{self.what}: local rank 0 offered a shared host copy that is not sealed; refused "
                                 f"(set {SHARE_ENV}=0 to pin one copy per rank)")
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
        """This process lets go of the descriptors, the rendezvous and its maps; a map goes with the last tensor
        viewing it (the pages with the last process)."""
        self._stop_listening()
        with self._lock:
            peers, self._peers = self._peers, []
        for conn in peers:
            conn.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for fd in {self.fd, self.ro_fd}:
            if fd >= 0:
                os.close(fd)
        self.fd = self.ro_fd = -1
        self.writable = self._wmap = None
        self.shared = self.private = None  # this object's maps (tensors viewing them keep them until they go)
        self._rmap = self._pmap = None


def _listen(group: HostGroup, seq: int, what: str) -> socket.socket:
    """The owner's listening socket for segment `seq`; a name held already is a one-line error naming its
    holder."""
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lst.bind(_address(group, seq))
    except OSError as exc:
        lst.close()
        held = ""
        if exc.errno == errno.EADDRINUSE:
            held = f" (held by {_holder(_address(group, seq))})"
        raise HostShareError(f"{what}: the rendezvous of the ranks of this host could not start: {exc.strerror or exc}"
                             f"{held}; another process took this job's socket name. Stop it, or set {SHARE_ENV}=0 "
                             "to pin one host copy per rank") from None
    lst.listen(max(8, 2 * group.local_world))
    return lst


def _holder(address: str) -> str:
    """Who listens on `address`, in words (for an error)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(address)
        pid, uid, _ = peer_credentials(probe)
        return f"pid {pid}, uid {uid}"
    except OSError:
        return "a process that accepts no connection"
    finally:
        probe.close()


def _connect(group: HostGroup, seq: int, what: str, deadline: float) -> socket.socket:
    """A peer's connection to the owner of segment `seq`, whose credentials are checked before the hello is sent;
    HostShareError where none listens by the deadline or a stranger does."""
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(_left(deadline))
        try:
            conn.connect(_address(group, seq))
            break
        except OSError:
            conn.close()
            if time.monotonic() > deadline:
                raise HostShareError(_waited(what, group, f"offer the shared host copy (segment {seq})") + "; every "
                                     "rank of a host must offload the same modules in the same order") from None
            time.sleep(0.02)
    try:
        why = untrusted(peer_credentials(conn))
        if why is None:
            conn.settimeout(_left(deadline))
            conn.sendall(_HELLO + group.local_rank.to_bytes(4, "little"))
    except OSError as exc:
        why = f"the connection failed ({exc.strerror or exc})"
    if why is not None:
        conn.close()
        raise HostShareError(f"{what}: the rendezvous socket of the shared host copy (segment {seq}) is held by a "
                             f"process that is not local rank 0 of this job: {why}. Nothing was taken from it; stop "
                             f"that process, or set {SHARE_ENV}=0 to pin one copy per rank")
    conn.settimeout(_left(deadline))
    return conn


def _check_offer(fd: int, theirs: bytes, check: dict, what: str, group: HostGroup) -> dict:
    """The owner's offer, parsed, once its descriptor is read-only and its manifest is this rank's; HostShareError
    saying what differs otherwise."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
        raise HostShareError(f"{what}: local rank 0 offered a writable descriptor of the shared host copy; refused")
    try:
        offered = json.loads(theirs)
    except ValueError:
        offered = {}
    ours = json.loads(json.dumps(check))  # as JSON carries it (tuples as lists)
    if offered.get("check") == ours:
        return offered
    theirs_check = offered.get("check") or {}
    if theirs_check.get("values") != ours.get("values") and {**theirs_check, "values": None} == {
            **ours, "values": None}:
        raise HostShareError(
            f"{what}: local rank {group.local_rank} holds other weights than local rank 0 at the same offload call "
            f"(another checkpoint, seed or fine-tune: the digests of their values differ), laid out the same way; "
            f"the ranks of a host share host memory only for the same weights. Load the same weights on every rank, "
            f"or set {SHARE_ENV}=0 (one host copy per rank)")
    raise HostShareError(
        f"{what}: local rank {group.local_rank} lays out its weights differently from local rank 0 (another module, "
        f"setting or dtype at the same offload call: {_first_difference(theirs_check, ours)}); the ranks of a host "
        f"share host memory only for the same modules offloaded the same way. Offload the same model with the same "
        f"setting on every rank, or set {SHARE_ENV}=0 (one host copy per rank)")


def _waited(what: str, group: HostGroup, step: str) -> str:
    return (f"{what}: local rank {group.local_rank} waited {group.timeout_s:g} s ({TIMEOUT_ENV}) for local rank 0 to "
            f"{step}; set {SHARE_ENV}=0 to pin one copy per rank")


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
