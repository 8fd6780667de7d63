"""The `chunkflow` console script: SIGINT and SIGTERM handled before anything heavy is imported (a Ctrl-C while the
command line starts up exits 130 without a traceback), then the command line itself (chunkflow.commands.cli); the
process ends through signals.leave, so that no signal finds the interpreter's defaults back while it frees a model."""

from __future__ import annotations


def main() -> None:
    from chunkflow.signals import Terminated, exit_code, install, leave

    install()
    try:
        from chunkflow.commands.cli import main as cli_main
    except (KeyboardInterrupt, Terminated) as exc:
        import sys

        sys.stderr.write("interrupted\n" if isinstance(exc, KeyboardInterrupt) else "terminated\n")
        leave(exit_code(15 if isinstance(exc, Terminated) else 2))
    try:
        cli_main()
    except SystemExit as done:  # the process ends here, without the interpreter's finalisation (signals.leave)
        leave(done.code if isinstance(done.code, int) else 0 if done.code is None else 1, finished=True)


if __name__ == "__main__":
    main()
