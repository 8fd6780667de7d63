"""The `chunkflow` command line. Commands import torch only where they need it: `plan` never does.

The app and its error boundary are in commands.app; each command registers itself from its own module, imported
here in the order `--help` lists them."""

from __future__ import annotations

from chunkflow.commands.app import _say, app

# each registers its commands, in the order `--help` lists them
from chunkflow.commands import plan as _plan  # noqa: E402,F401  models, hardware, plan
from chunkflow.commands import run as _run  # noqa: E402,F401
from chunkflow.commands import serve as _serve  # noqa: E402,F401
from chunkflow.commands.calibrate import command as _calibrate  # noqa: E402,F401
from chunkflow.commands.bench import command as _bench  # noqa: E402,F401

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point: SIGINT and SIGTERM routed through chunkflow.signals first; one that comes after
    the command's work still makes the exit code the signal's (never 0 after an interrupt). Ends with SystemExit
    (chunkflow.entry, the process's entry point, turns it into signals.leave)."""
    from chunkflow.signals import Terminated, exit_code, install, interrupted, leave, quiet

    install()
    code: int | str | None = 0
    try:
        app()
    except SystemExit as done:
        code = done.code
    except (KeyboardInterrupt, Terminated) as exc:  # outside a command (parsing the arguments, starting up)
        _say("interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated")
        code = exit_code(15 if isinstance(exc, Terminated) else 2)
    finally:
        quiet()  # from here on a signal is only noted: the process is ending
    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        _say(code)
        code = 1
    if interrupted() is not None:
        leave(exit_code() if code in (0, None) else code)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
