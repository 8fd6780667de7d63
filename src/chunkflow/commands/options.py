"""The command-line options more than one command takes, declared once (typer.Option in an Annotated type).

A command's own options sit at the top of its module in the same form, so that its signature reads as a list of
names and types and its body does the work."""

from __future__ import annotations

from typing import Annotated, Optional

import typer


class PathArg:
    """A mark on an option (a third item of its Annotated type) that its value is a path, or a name that may be one
    (--model, --hardware): the command's boundary (commands.app._command) checks it before the command runs
    (chunkflow_planner.files.check_path): no NUL, no name over the file system's limit in bytes; an output also no
    control character. One declaration per option, one check for every command."""

    def __init__(self, output: bool) -> None:
        self.output = output

    def __repr__(self) -> str:
        return "OUTPUT" if self.output else "INPUT"


INPUT = PathArg(output=False)  # a file or folder read, or a name that may be one
OUTPUT = PathArg(output=True)  # a file or folder written

Model = Annotated[str, typer.Option("--model", "-m", help="catalog model name or alias (see `chunkflow models`)"),
                  INPUT]
OptionalModel = Annotated[Optional[str], typer.Option("--model", "-m", help="catalog model name or alias (see "
                                                                            "`chunkflow models`)"), INPUT]
Hardware = Annotated[Optional[str], typer.Option(help="catalog GPU (see `chunkflow hardware`) or a calibrated profile "
                                                      "file (default: the profile `chunkflow calibrate` saved, else "
                                                      "h200)"), INPUT]
Device = Annotated[Optional[str], typer.Option(help="cuda (default when available), cuda:1 or cpu; under torchrun "
                                                    "each rank's GPU")]
Variant = Annotated[Optional[str], typer.Option(help="with --weights: the folder's variant files, e.g. fp16 (as "
                                                     "diffusers' from_pretrained(variant=...)); a component without "
                                                     "them reads its default files"), INPUT]
Height = Annotated[Optional[int], typer.Option(help="image/video height in pixels (default: the model's)")]
Width = Annotated[Optional[int], typer.Option(help="image/video width in pixels (default: the model's)")]
