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
from collections.abc import Callable
from typing import Any
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
    err_console.print(f"[bold red]error:[/] {escape(shown(_cut(message), one_line=True))}", highlight=False)
    raise typer.Exit(code)


def _say(message: str) -> None:
    """A line on stderr, printed as it is (file names and prompts may hold [brackets] rich would take as markup)."""
    err_console.print(message, highlight=False, markup=False)


def _path_params(fn) -> dict[str, tuple[str, bool]]:
    """The parameters of command `fn` marked as paths (commands.options.PathArg): name -> (flag, output)."""
    import typing

    from typer.models import ParameterInfo

    from chunkflow.commands.options import PathArg

    out = {}
    for name, hint in typing.get_type_hints(fn, include_extras=True).items():
        meta = getattr(hint, "__metadata__", ())
        mark = next((m for m in meta if isinstance(m, PathArg)), None)
        if mark is None:
            continue
        info = next((m for m in meta if isinstance(m, ParameterInfo)), None)
        decls = [d for d in (getattr(info, "param_decls", None) or ()) if d.startswith("--")]
        flag = decls[0] if decls else ("--" + name.replace("_", "-") if info is not None and
                                       type(info).__name__ == "OptionInfo" else name.upper())
        out[name] = (flag, mark.output)
    return out


def _check_paths(marked: dict[str, tuple[str, bool]], kwargs: dict) -> None:
    """Every path argument checked before the command runs (files.check_path): one line for a path no file system
    takes (a NUL, a name over NAME_MAX bytes, a path over PATH_MAX) or an output holding control characters."""
    from chunkflow_planner.files import check_path

    for name, (flag, output) in marked.items():
        value = kwargs.get(name)
        for one in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(one, str):
                check_path(one, flag, output=output)


def _os_error(exc: BaseException) -> str | None:
    """The one line for an OSError or ValueError a path given on the command line causes where a check missed it
    (a name too long for the file system, a NUL byte); None for any other exception."""
    import errno

    from chunkflow.commands.terminal import shown as _escaped
    from chunkflow_planner.checkpoint import shown as cut

    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        name = f" {cut(str(exc.filename))}" if exc.filename is not None else ""
        return f"a path{name} cannot be looked up: File name too long; give a shorter one"
    if isinstance(exc, ValueError) and "embedded null" in str(exc):
        return f"a path given holds a NUL byte ({_escaped(str(exc), one_line=True)}); give it without one"
    return None


def _command(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Register a command behind the one error boundary (see the module docstring). The planner is imported when a
    command runs, not when it registers: `chunkflow --help` imports none of it."""

    def decorate(fn: Callable[..., Any]) -> Any:
        doc = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        return app.command(name, short_help=doc)(_guarded(fn))

    return decorate


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Command `fn` behind the one error boundary: its paths checked first, every failure one line and its exit
    code (see the module docstring)."""
    marked = _path_params(fn)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        from rich.markup import escape

        from chunkflow.signals import Terminated, exit_code, interrupted
        from chunkflow_planner.files import note_interrupt
        from chunkflow_planner.policy import Infeasible

        note_interrupt(None)  # a command of its own (several may run in one process: tests, notebooks)
        try:
            with escaped_output():  # warnings and library log lines: escaped like every other string
                _check_paths(marked, kwargs)
                result = fn(*args, **kwargs)
            if interrupted() is not None:  # a library swallowed the signal: still no success
                raise KeyboardInterrupt
            return result
        except Infeasible as exc:
            err_console.print(f"[bold red]infeasible:[/] {escape(_cut(str(exc)))}", highlight=False)
            raise typer.Exit(2) from None
        except ChunkflowError as exc:
            _exit_if_interrupted()  # an error while stopping for a signal: the signal's code
            _fail(str(exc))
        except (KeyboardInterrupt, Terminated) as exc:
            _say("interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated")
            raise typer.Exit(exit_code(15 if isinstance(exc, Terminated) else interrupted() or 2)) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:  # a bug: say so briefly, keep the traceback for --debug
            _exit_if_interrupted()  # what stopping for a signal broke (an encoder's pipe): the signal's code
            _exit_on_broken_pipe(exc)
            if _debug["on"]:
                raise
            _fail_unexpected(exc)

    return guarded


def _exit_if_interrupted() -> None:
    """Where a signal is being handled, say so and exit with its code (what failed was the stopping)."""
    from chunkflow.signals import exit_code, interrupted

    if interrupted() is not None:
        _say("interrupted")
        raise typer.Exit(exit_code()) from None


def _exit_on_broken_pipe(exc: Exception) -> None:
    """Stdout closed by its reader (`plan --json | head`): exit 1 quietly, with later writes going nowhere."""
    if isinstance(exc, BrokenPipeError):
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None


def _fail_unexpected(exc: Exception) -> None:
    """An exception no check foresaw, as one line: a full disk, a path no file system takes, a folder of the wrong
    type; else an internal error, where to report it and how to see its traceback (exit 1)."""
    from rich.markup import escape

    if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: stdout or an output on a full disk
        _fail(f"no space left on the device to write to ({exc.filename or 'the output'}); free some "
              "and run it again", code=1)
    from chunkflow.loading.folder_errors import wrong_type

    said = _os_error(exc) or wrong_type(exc)
    if said is not None:
        _fail(said)
    what = shown(_cut(f"{type(exc).__name__}: {exc}"), one_line=True)
    err_console.print(f"[bold red]internal error:[/] {escape(what)}\nThis is a bug in "
                      f"chunkflow {__version__}; please report it at {ISSUES_URL} with the command. "
                      "Run `chunkflow --debug ...` for the traceback.", highlight=False)
    raise typer.Exit(1) from None


def _cut(text: str, limit: int = 2000) -> str:
    """`text` cut to `limit` characters, its length said (an exception's message may hold a whole argument)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


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
    from chunkflow.notices import quiet_known_notices

    _debug["on"] = debug
    quiet_known_notices()  # before any command imports diffusers or transformers
    if ctx.invoked_subcommand is None:
        console.print(ctx.get_help(), highlight=False)
        raise typer.Exit(0)


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)
