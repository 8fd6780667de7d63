"""SIGINT and SIGTERM in a command: the work stops where it is, every temporary file goes with the exception
(files.atomic_path removes its own), and the command exits 130 or 143, never 0 after an interrupt: a signal a
library swallowed (an encoder's subprocess getting the terminal's Ctrl-C) is remembered and reported at the end."""

from __future__ import annotations

import signal
import threading

from chunkflow_planner.files import interrupted, note_interrupt

__all__ = ["Terminated", "install", "quiet", "exit_code", "interrupted"]


class Terminated(BaseException):
    """SIGTERM: raised in the main thread as KeyboardInterrupt is for SIGINT."""


def _handler(signum: int, frame) -> None:
    note_interrupt(signum)
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
