"""Reading the project's versioned JSON files (plan.json, bench.json): one set of checks, one set of messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def read_versioned(path: Path, model: type[M], version: int, *, what: str, remedy: str,
                   error: type[Exception]) -> M:
    """`model` from the JSON file at `path`, whose `schema_version` must be `version`; anything else raises
    `error` with a message naming the file (`what`) and what to do (`remedy`)."""
    from chunkflow_planner.files import FileError, read_text

    if not Path(path).expanduser().exists():
        raise error(f"{what} {str(path)!r} does not exist; {remedy}")
    try:
        text = read_text(path, what)
    except FileError as exc:
        raise error(str(exc)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {str(path)!r} must hold a JSON object")
    found = data.get("schema_version")
    if found != version:
        raise error(f"{what} {str(path)!r} has schema_version {found!r}; this chunkflow reads version {version}. "
                    f"{remedy[0].upper()}{remedy[1:]}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{what} {str(path)!r} is malformed (not one this chunkflow understands): "
                    f"{field_errors(exc)}") from None


def field_errors(exc: ValidationError) -> str:
    """pydantic's errors as `field.path: message; ...` (a value error's own message, without pydantic's prefix)."""
    out = []
    for e in exc.errors():
        msg = str(e.get("ctx", {}).get("error", e["msg"]))
        out.append(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {msg}")
    return "; ".join(out)
