"""Reading the project's versioned JSON files (plan.json, bench.json): one set of checks, one set of messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def read_versioned(path: Path, model: type[M], version: int, *, what: str, remedy: str,
                   error: type[Exception], older: tuple[int, ...] = ()) -> M:
    """`model` from the JSON file at `path`, whose `schema_version` must be `version` (or one of the `older` ones
    the model still reads as they are); anything else raises `error` with a message naming the file (`what`) and
    what to do (`remedy`)."""
    from chunkflow_planner.files import FileError, read_text

    from chunkflow_planner.files import not_there

    if not Path(path).expanduser().exists():
        reason = not_there(Path(path).expanduser())
        raise error(f"{what} {str(path)!r} {reason}" + (f"; {remedy}" if reason == "does not exist" else ""))
    try:
        text = read_text(path, what)
    except FileError as exc:
        raise error(str(exc)) from None
    data = parse_json(text, f"{what} {str(path)!r}", error, f"to be one chunkflow writes; {remedy}")
    if not isinstance(data, dict):
        raise error(f"{what} {str(path)!r} must hold a JSON object")
    found = data.get("schema_version")
    if found != version and found not in older:
        raise error(f"{what} {str(path)!r} has schema_version {found!r}; this chunkflow reads version {version}. "
                    f"{remedy[0].upper()}{remedy[1:]}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{what} {str(path)!r} is malformed (not one this chunkflow understands): "
                    f"{field_errors(exc)}") from None
    except (TypeError, ValueError, RecursionError) as exc:  # a section's own check (e.g. an offload setting's)
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        if "unexpected keyword argument" in detail:
            field = detail.rsplit("argument", 1)[-1].strip(" '")
            detail = f"it has a field {field!r} this chunkflow does not know (written by a newer one?)"
        raise error(f"{what} {str(path)!r} is malformed (not one this chunkflow understands): {detail}; "
                    f"{remedy}") from None


def parse_json(text: str, where: str, error: type[Exception], deep: str) -> object:
    """The JSON document `text` of the file named `where`; not JSON, or nested past Python's recursion limit,
    raises `error` (`deep` ends the second message: what the file should have been)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where} is not JSON: {exc}") from None
    except RecursionError:
        raise error(f"{where} is nested too deeply {deep}") from None


def field_errors(exc: ValidationError) -> str:
    """pydantic's errors as `field.path: message; ...` (a value error's own message, without pydantic's prefix)."""
    out = []
    for e in exc.errors():
        msg = str(e.get("ctx", {}).get("error", e["msg"]))
        out.append(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {msg}")
    return "; ".join(out)
