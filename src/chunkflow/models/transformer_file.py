"""A pipeline's transformer from a single file (`--transformer FILE`, `--transformer-2 FILE` beside `--weights
DIR`): the file checked against the folder's transformer config before anything is read (chunkflow.formats), the
module loaded as diffusers loads that format after every component of the folder is checked, and the offload
setting its stored bytes allow (a GGUF file's are streamed as stored: no fp8 storage or codec on top)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from chunkflow.models.components import Component
from chunkflow_planner.checkpoint import CheckpointError
from chunkflow_planner.offload import OffloadConfig

__all__ = ["file_component", "check_files", "no_expert", "load_file_component", "file_setting", "FILE_OPTIONS"]

FILE_OPTIONS = {"transformer": "--transformer", "transformer_2": "--transformer-2"}
# the stage a two-expert pipeline runs each expert for (diffusers' WanPipeline: `transformer` the high-noise steps,
# `transformer_2` the low-noise ones), and how the files' own names say it (city96's wan2.2_..._high_noise_14B_Q8_0,
# QuantStack's ...-HighNoise-Q8_0)
EXPERT_STAGES = {"transformer": "high", "transformer_2": "low"}
_STAGE_IN_NAME = {stage: re.compile(rf"(?<![a-z]){stage}[ _.-]?noise", re.I) for stage in ("high", "low")}


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
    if spec.pipeline is not None and spec.pipeline.experts > 1:
        check_expert_stage(name, path)
    check_transformer_config(folder / name, spec)
    try:
        fmt = formats.check(path, _model_class(spec), folder / name)
    except CheckpointError as exc:
        raise type(exc)(_with_option(str(exc), flag, path)) from None
    return Component(name, None, None, formats.read_bytes(path, fmt), None, file=path, fmt=fmt,
                     config_dir=folder / name)


def _with_option(msg: str, flag: str, path: Path) -> str:
    """A format's line about `path` as the line about the option it was given with (`--transformer-2 'B.gguf': ...`:
    with two experts' files, which one is wrong)."""
    shown_path = repr(str(path))
    for head in (f"--transformer {shown_path}", f"fp8-scaled file {shown_path}", shown_path):
        if msg.startswith(head):
            return f"{flag} {shown_path}{msg[len(head):]}"
    return f"{flag} {shown_path}: {msg}"


def no_expert(spec, name: str) -> str:
    """The line for a file given for transformer component `name`, which the plan's pipeline does not have."""
    flag = FILE_OPTIONS.get(name, name)
    n = spec.pipeline.experts if spec.pipeline is not None else 1
    return (f"{flag} was given, but {spec.name} has no {name} ({n} transformer{'s' if n != 1 else ''}: "
            f"transformer{', transformer_2' if n > 1 else ''}); leave {flag} out, or plan the pipeline whose folder "
            f"has a {name}")


def check_files(spec, folder: Path | None, files: dict[str, str]) -> dict[str, str]:
    """Each file checked (file_component) before anything is loaded: component -> its format."""
    names = ["transformer"] + [f"transformer_{k + 1}" for k in range(1, spec.pipeline.experts)]  # as BuiltPipeline
    out = {}
    for name, path in files.items():
        if name not in names:
            raise CheckpointError(no_expert(spec, name))
        out[name] = file_component(name, Path(path).expanduser(), spec, folder).fmt
    return out


def check_expert_stage(name: str, path: Path) -> None:
    """A two-expert pipeline's file whose own name says it is the other stage's expert (`..._low_noise_...` given as
    --transformer, the high-noise one): refused in one line. The experts have the same shape, so nothing else tells
    a swapped pair, which would run each stage with the other's weights."""
    stage = EXPERT_STAGES.get(name)
    named = [s for s, pattern in _STAGE_IN_NAME.items() if pattern.search(path.name)]
    if stage is None or len(named) != 1 or named[0] == stage:
        return
    other = next(n for n, s in EXPERT_STAGES.items() if s == named[0])
    raise CheckpointError(f"{FILE_OPTIONS[name]} {str(path)!r} is named a {named[0]}-noise expert, but {name} runs the "
                          f"{stage}-noise steps ({other} the {named[0]}-noise ones): give it as {FILE_OPTIONS[other]} "
                          "(swap the two files)")


def load_file_component(c: Component, spec, dtype: torch.dtype, reader=None) -> None:
    """The module from its file and the source the runtime reads it by (formats.build): an fp8-scaled file's module
    on the meta device, filled from the file through `reader` (the build's, which counts the bytes) where it is
    placed, its blocks read from the file by the disk tier; a GGUF file's as diffusers loads it."""
    from chunkflow import formats

    module, c.source = formats.build(c.file, _model_class(spec), c.config_dir, dtype, reader)
    c.module = module.requires_grad_(False)


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

    spec = model_of(plan)
    experts = spec.pipeline.experts if spec.pipeline is not None else 1
    lacking = [n for n in ("transformer", *(f"transformer_{k + 1}" for k in range(1, experts))) if n not in files]
    if lacking:  # that expert would run the folder's own weights where the plan priced the format's
        flag = FILE_OPTIONS.get(lacking[0], "--transformer")
        raise CheckpointError(f"the plan streams every expert as {fmt.name}, and {lacking[0]} was given no file: give "
                              f"it with {flag} FILE, or plan without --format to run the folder's own weights")
    for name, path in files.items():  # each expert's file: the plan priced every expert's blocks in its format
        stored = from_file(spec, path).stored
        if stored is not None and stored.format != fmt.name:
            raise CheckpointError(f"{path} stores the {name} as {stored.format}, and the plan was made for "
                                  f"{fmt.name}: plan again with {FILE_OPTIONS.get(name, '--transformer')} {path}")
