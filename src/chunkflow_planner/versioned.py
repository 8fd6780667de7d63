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
    if not path.exists():
        raise error(f"{what} {str(path)!r} does not exist; {remedy}")
    try:
        data = json.loads(path.read_text())
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
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise error(f"{what} {str(path)!r} is malformed (not one this chunkflow understands): {detail}") from None
