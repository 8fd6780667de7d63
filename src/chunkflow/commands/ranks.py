"""`chunkflow run --prompt` under torchrun: what each rank says, and refusals all ranks make together.

Rank 0 speaks (notes, progress bars, tables, the files it writes); the other ranks print nothing but errors: their
Python warnings and diffusers' and transformers' log lines below errors are silenced (`quiet_rank`).

A refusal must be every rank's: a rank that gave up alone would leave the others waiting in the job's first
collective (torchrun notices a rank that exits non-zero and stops the rest, but a rank that is still checking would
go on). So a step that may refuse (the options checked before anything is built, the build) runs on every rank,
then every rank joins the job and they agree (`together`): nothing failed, and every rank goes on; or the lowest
rank that failed is named and every rank stops, rank 0 saying why (its own error; or the other rank's, prefixed
with its rank, where rank 0 found nothing wrong: another host's files) and exiting 2, the others exiting 2 without
a word. An unexpected error (a bug) is raised where it happened, so that the rank it happened on says it, with its
traceback under `chunkflow --debug`.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import typer

from chunkflow.commands.app import UserError
from chunkflow.launch import torchrun_rank
from chunkflow_planner.errors import ChunkflowError

T = TypeVar("T")


def speaks() -> bool:
    """Whether this process speaks: rank 0 of a torchrun job, or a process outside torchrun."""
    return torchrun_rank() == 0


def quiet_rank() -> None:
    """On a rank other than 0: no warnings, and diffusers' and transformers' loggers at errors only."""
    if speaks():
        return
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("diffusers", "transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:  # diffusers' and transformers' own verbosity setters also reset their handlers' levels
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
    except ImportError:
        pass


def together(step: Callable[[], T]) -> T:
    """`step()` on this rank, then the job joined (init_distributed) and every rank's outcome agreed on (module
    docstring): its result where no rank failed, else every rank stops."""
    from chunkflow.parallel import first_failure, init_distributed

    error: BaseException | None = None
    said: str | None = None
    result = None
    try:
        result = step()
    except ChunkflowError as exc:
        error, said = exc, str(exc)
    except Exception as exc:  # a bug: the others stop, this rank raises it below
        error, said = exc, f"internal error: {type(exc).__name__}: {exc}"
    init_distributed()
    failed = first_failure(said)
    if failed is None:
        return result
    rank, message = failed
    if error is not None and (speaks() or not isinstance(error, ChunkflowError)):
        raise error
    if speaks():
        raise UserError(f"rank {rank}: {message}")
    raise typer.Exit(2)
