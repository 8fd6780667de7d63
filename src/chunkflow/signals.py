"""SIGINT and SIGTERM in a command: the work stops where it is, every temporary file goes with the exception
(files.atomic_path removes its own), and the command exits 130 or 143, never 0 after an interrupt: a signal a
library swallowed (an encoder's subprocess getting the terminal's Ctrl-C) is remembered and reported at the end.

A signal that comes while a module is being imported is not raised there: an exception inside an extension module's
initialisation can abort the interpreter (pybind11 terminates) or mark the process as killed by SIGINT whatever it
exits with. It is delivered again every 50 ms until the import is over, then raised as usual."""

from __future__ import annotations

import os
import signal
import threading

from chunkflow_planner.files import interrupted, note_interrupt

__all__ = ["Terminated", "install", "quiet", "exit_code", "interrupted", "leave"]


class Terminated(BaseException):
    """SIGTERM: raised in the main thread as KeyboardInterrupt is for SIGINT."""


RETRY_S = 0.05
_retry = {"pending": False}  # one re-delivery at a time


def _inside_import(frame) -> bool:
    """Whether `frame` (the one the signal interrupted) runs under importlib, i.e. inside some module's import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _deliver_again(signum: int) -> None:
    _retry["pending"] = False
    os.kill(os.getpid(), signum)


def _handler(signum: int, frame) -> None:
    note_interrupt(signum)
    if _inside_import(frame):
        if not _retry["pending"]:
            _retry["pending"] = True
            timer = threading.Timer(RETRY_S, _deliver_again, (signum,))
            timer.daemon = True
            timer.start()
        return
    if signum == signal.SIGTERM:
        raise Terminated
    raise KeyboardInterrupt


def install() -> None:
    """Route SIGINT and SIGTERM through `_handler` (the main thread only can: elsewhere, nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _handler)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _handler)


def quiet() -> None:
    """From now on SIGINT and SIGTERM are only noted (a process finishing, whose exit code says it was interrupted)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if sig is not None:
            signal.signal(sig, lambda signum, frame: note_interrupt(signum))


def exit_code(signum: int | None = None) -> int:
    """The shell's code for a command ended by `signum` (default: the one that interrupted it): 128 + the signal."""
    signum = interrupted() if signum is None else signum
    return 128 + int(signum or signal.SIGINT)


def leave(code: int, *, finished: bool = False) -> None:
    """End the process with `code` now, stdout and stderr flushed, without the interpreter's finalisation: that
    first puts SIGINT and SIGTERM back to their defaults, so a signal in the seconds it spends freeing a model
    would kill the process (-15, -2) after the command had finished and printed its success. A `finished` command
    first waits for its non-daemon threads and runs the atexit functions, as finalisation would, with its signals
    still only noted; an interrupted one skips both (a thread join could wait, and an earlier KeyboardInterrupt
    inside a library's own code turns a normal shutdown into a SIGINT death whatever the code). Everything of the
    command's was cleaned already, on the way up."""
    import atexit
    import sys

    if finished:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
        if run_exitfuncs is not None:
            run_exitfuncs()
        if code == 0 and interrupted() is not None:  # noted while the process was ending: still no success
            code = exit_code()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to say on it
            pass
    os._exit(code)
