"""The `chunkflow` console script: SIGINT and SIGTERM handled before anything heavy is imported (a Ctrl-C while the
command line starts up exits 130 without a traceback), then the command line itself (chunkflow.commands.cli)."""

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
    cli_main()


if __name__ == "__main__":
    main()
