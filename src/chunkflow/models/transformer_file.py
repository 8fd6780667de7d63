"""A pipeline's transformer from a single file (`--transformer FILE`, `--transformer-2 FILE` beside `--weights
DIR`): the file checked against the folder's transformer config before anything is read (chunkflow.formats), the
module loaded as diffusers loads that format after every component of the folder is checked, and the offload
setting its stored bytes allow (a GGUF file's are streamed as stored: no fp8 storage or codec on top)."""

from __future__ import annotations

from pathlib import Path

import torch

from chunkflow.models.components import Component
from chunkflow_planner.checkpoint import CheckpointError
from chunkflow_planner.offload import OffloadConfig

__all__ = ["file_component", "check_files", "load_file_component", "file_setting", "FILE_OPTIONS"]

FILE_OPTIONS = {"transformer": "--transformer", "transformer_2": "--transformer-2"}


def _model_class(spec) -> type:
    import diffusers

    return getattr(diffusers, spec.diffusers.cls)


def file_component(name: str, path: Path, spec, folder: Path | None) -> Component:
    """Component `name` read from `path`: checked (format from its first bytes, header against the model the
    folder's `name/config.json` makes), nothing read; its module is made by `load_file_component`."""
    from chunkflow import formats
    from chunkflow.models.build import check_transformer_config

    flag = FILE_OPTIONS.get(name, "--transformer")
    if folder is None:
        raise CheckpointError(f"{flag} {str(path)!r} needs --weights DIR, the pipeline folder whose {name}/config.json "
                              "says the model's shape and which gives every other component")
    if not path.is_file():
        raise CheckpointError(f"{flag} {str(path)!r} is not a file")
    check_transformer_config(folder / name, spec)
    fmt = formats.check(path, _model_class(spec), folder / name)
    return Component(name, None, None, 0, None, file=path, fmt=fmt, config_dir=folder / name)


def check_files(spec, folder: Path | None, files: dict[str, str]) -> dict[str, str]:
    """Each file checked (file_component) before anything is loaded: component -> its format."""
    names = ["transformer"] + [f"transformer_{k + 1}" for k in range(1, spec.pipeline.experts)]  # as BuiltPipeline
    out = {}
    for name, path in files.items():
        if name not in names:
            raise CheckpointError(f"{FILE_OPTIONS.get(name, name)} was given, but {spec.name} has no {name}")
        out[name] = file_component(name, Path(path).expanduser(), spec, folder).fmt
    return out


def load_file_component(c: Component, spec, dtype: torch.dtype) -> None:
    """The module from its file (diffusers' own loading of the format) and the source the disk tier reads by."""
    from chunkflow import formats

    mod = formats.format_module(c.fmt)
    c.module = formats.load(c.file, _model_class(spec), c.config_dir, dtype).requires_grad_(False)
    make_source = getattr(mod, "source", None)
    c.source = make_source(c.file, c.module) if make_source is not None else None


def file_setting(cfg: OffloadConfig, fmt: str, log) -> OffloadConfig:
    """The plan's setting for a transformer stored as `fmt`: a GGUF file's bytes are quantized already, so fp8
    storage and the exponent-pack codec are left off (said once in the log where the plan had them)."""
    if fmt != "gguf" or (cfg.weight_dtype == "bf16" and cfg.codec == "none"):
        return cfg
    log(f"note: the transformer file is GGUF: its quantized bytes are streamed as stored (the plan's "
        f"weight_dtype={cfg.weight_dtype}, codec={cfg.codec} do not apply)")
    return cfg.with_overrides(weight_dtype="bf16", codec="none")


def check_plan_format(plan, files: dict[str, str]) -> None:
    """The plan's stored format against the transformer files given: a plan priced for a format (`plan --format`,
    `plan --transformer FILE`) runs only that format's file; without one, the folder's own weights would run where
    the plan priced others (its memory and time would be of another model). Header only, before anything is read."""
    fmt = getattr(plan, "format", None)
    if fmt is None or fmt.name == "bf16":
        return
    if "transformer" not in files:
        raise CheckpointError(f"the plan streams the transformer as {fmt.name} ({fmt.source}): give the file with "
                              f"--transformer FILE (transformer=FILE in Python), or plan without --format to run "
                              "the folder's own weights")
    from chunkflow_planner.plan import model_of
    from chunkflow_planner.stored_file import from_file

    path = files["transformer"]
    stored = from_file(model_of(plan), path).stored
    if stored is not None and stored.format != fmt.name:
        raise CheckpointError(f"{path} stores the transformer as {stored.format}, and the plan was made for "
                              f"{fmt.name}: plan again with --transformer {path}")
