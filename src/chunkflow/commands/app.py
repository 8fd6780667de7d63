"""The command line's frame: the Typer app, its consoles, and the one boundary every command runs behind.

One boundary for errors (`_command`): a ChunkflowError (bad input, an impossible request) is one line and exit
code 2; an infeasible plan says which constraint binds, exit 2; anything else is a bug: a short message saying
where to report it, exit 1, and the traceback only with `chunkflow --debug ...`. Whatever a command prints has its
control characters escaped (commands.terminal): a file's or an argument's text cannot drive the terminal. Every
input is checked before any expensive work (output paths included), and every file is written atomically
(chunkflow_planner.files).
"""

from __future__ import annotations
import functools
import sys
import typer
from chunkflow_planner import __version__
from chunkflow_planner.errors import ChunkflowError

from chunkflow.commands.terminal import SafeConsole, escaped_output, shown

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Run large diffusion transformers with weights streamed from host memory in chunks.",
)
# every string either prints has its control characters escaped (commands.terminal)
console = SafeConsole()
err_console = SafeConsole(stderr=True, soft_wrap=True)


ISSUES_URL = "https://github.com/chunkflow/chunkflow/issues"
_debug = {"on": False}  # set by `chunkflow --debug`: unexpected errors keep their traceback


class UserError(ChunkflowError):
    """Bad input: printed as one clear message, exit code 2, no traceback."""


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # the user's words, verbatim but for markup and control characters; one line whatever a file put in them
    err_console.print(f"[bold red]error:[/] {escape(shown(message, one_line=True))}", highlight=False)
    raise typer.Exit(code)


def _say(message: str) -> None:
    """A line on stderr, printed as it is (file names and prompts may hold [brackets] rich would take as markup)."""
    err_console.print(message, highlight=False, markup=False)


def _command(name: str):
    """Register a command behind the one error boundary (see the module docstring)."""
    from chunkflow_planner.policy import Infeasible

    def decorate(fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            from rich.markup import escape

            from chunkflow.signals import Terminated, exit_code, interrupted
            from chunkflow_planner.files import note_interrupt

            note_interrupt(None)  # a command of its own (several may run in one process: tests, notebooks)
            try:
                with escaped_output():  # warnings and library log lines: escaped like every other string
                    result = fn(*args, **kwargs)
                if interrupted() is not None:  # a library swallowed the signal: still no success
                    raise KeyboardInterrupt
                return result
            except Infeasible as exc:
                err_console.print(f"[bold red]infeasible:[/] {escape(str(exc))}", highlight=False)
                raise typer.Exit(2) from None
            except ChunkflowError as exc:
                if interrupted() is not None:  # an error while stopping for a signal: the signal's code
                    _say("interrupted")
                    raise typer.Exit(exit_code()) from None
                _fail(str(exc))
            except (KeyboardInterrupt, Terminated) as exc:
                _say("interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated")
                raise typer.Exit(exit_code(15 if isinstance(exc, Terminated) else interrupted() or 2)) from None
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except Exception as exc:  # a bug: say so briefly, keep the traceback for --debug
                if interrupted() is not None:  # what stopping for a signal broke (an encoder's pipe): the signal's
                    _say("interrupted")
                    raise typer.Exit(exit_code()) from None
                if isinstance(exc, BrokenPipeError):  # stdout closed by its reader (`plan --json | head`): quietly
                    import os

                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                    raise typer.Exit(1) from None
                if _debug["on"]:
                    raise
                if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: stdout or an output on a full disk
                    _fail(f"no space left on the device to write to ({exc.filename or 'the output'}); free some "
                          "and run it again", code=1)
                what = shown(f"{type(exc).__name__}: {exc}", one_line=True)
                err_console.print(f"[bold red]internal error:[/] {escape(what)}\nThis is a bug in "
                                  f"chunkflow {__version__}; please report it at {ISSUES_URL} with the command. "
                                  "Run `chunkflow --debug ...` for the traceback.", highlight=False)
                raise typer.Exit(1) from None

        doc = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        return app.command(name, short_help=doc)(guarded)

    return decorate


def _version(value: bool) -> None:
    if value:
        console.print(f"chunkflow {__version__} (the chunkflow-dit package)", highlight=False)
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def main_callback(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="print chunkflow's version and exit"),
    debug: bool = typer.Option(False, "--debug", help="show the Python traceback of an unexpected error"),
) -> None:
    """Run large diffusion transformers with weights streamed from host memory in chunks."""
    _debug["on"] = debug
    if ctx.invoked_subcommand is None:
        console.print(ctx.get_help(), highlight=False)
        raise typer.Exit(0)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)
