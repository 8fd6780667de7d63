"""Running the app: the listening socket bound before the pipeline is loaded (a port in use is said at once, not
after a minute's load), and uvicorn serving it from a background thread, so that the main thread keeps
chunkflow's own SIGINT and SIGTERM handling and decides how the server stops."""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time

from chunkflow.serve import require_serve_extras
from chunkflow_planner.errors import ChunkflowError

__all__ = ["ServeError", "bind", "is_loopback", "BackgroundServer"]


class ServeError(ChunkflowError):
    """An address the server cannot listen on, or a server that did not start."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; ServeError says why not (a name that does not
    resolve, a port in use, one that needs privileges)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host!r} is not an address this machine can listen on ({exc.strerror}); give an "
                         "IP address such as 127.0.0.1") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "the port is in use (another server?)",
               errno.EACCES: "permission denied (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's"}.get(exc.errno or 0, exc.strerror)
        raise ServeError(f"cannot listen on {host}:{port}: {why}; give another --port or --host") from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BackgroundServer:
    """uvicorn serving `app` on the bound socket from a daemon thread (uvicorn installs no signal handler off the
    main thread). start() returns once it accepts connections."""

    def __init__(self, app, sock: socket.socket, log_level: str = "info") -> None:
        require_serve_extras()
        import uvicorn

        self.sock = sock
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=True))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="chunkflow-serve-http", daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ServeError("the HTTP server did not start (its log above says why)")
            time.sleep(0.02)

    def wait(self, poll_s: float = 0.25) -> None:
        """Until the server ends (a KeyboardInterrupt or SIGTERM raised in the main thread comes through). Sleeps
        rather than joins: a Thread.join interrupted by an exception can leave the thread looking stopped while it
        still runs (seen on CPython 3.11: uvicorn then found its socket closed), and stop() must really wait."""
        while self.thread.is_alive():
            time.sleep(poll_s)

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Stop accepting, finish the requests in flight, end the thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        try:
            self.sock.close()
        except OSError:  # already closed by uvicorn
            pass
