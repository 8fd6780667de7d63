"""The published figures as data: docs/claims.yaml, one row per figure that README.md and docs/*.md quote from a
measurement, read into typed rows, and each row's figure recomputed from its raw files under docs/data/ by the
function it names in `chunkflow_planner.claims_compute` (tests/test_claims.py does it for every row in CI).

A row says where the figure is quoted (a file and a short snippet around it, unique in that file), which raw files
it comes from, the command that made them, the date and the machine, and the conditions a reader needs (random or
trained weights, steps measured or scaled, transformer only or a whole generation). A run superseded by another, or
repeated, stays a row (`superseded_by`, `repeats`). A figure no raw file backs says why (`no_raw_data`) and the text
quoting it says so too.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parents[2]
CLAIMS_FILE = ROOT / "docs" / "claims.yaml"


class Place(BaseModel):
    """Where a figure is quoted: a file (relative to the repository) and a snippet around the figure, unique there."""

    model_config = ConfigDict(extra="forbid")
    file: str
    snippet: str


class Claim(BaseModel):
    """One published figure and how to recompute it."""

    model_config = ConfigDict(extra="forbid")
    id: str
    figure: str
    quoted: list[Place] = Field(default_factory=list)
    raw: list[str] = Field(default_factory=list)
    compute: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    format: str | None = None
    command: str
    date: str
    machine: str
    conditions: str
    superseded_by: str | None = None
    repeats: list[str] = Field(default_factory=list)
    no_raw_data: str | None = None

    @field_validator("date", mode="before")
    @classmethod
    def _date_text(cls, v: Any) -> Any:
        """YAML reads 2026-12-05 as a date: keep it as the text it is."""
        return v.isoformat() if isinstance(v, datetime.date) else v

    @model_validator(mode="after")
    def _backed(self) -> "Claim":
        """A row either recomputes its figure (raw files, a function, a format) or says why it cannot."""
        if self.no_raw_data is None and not (self.raw and self.compute and self.format):
            raise ValueError(f"claim {self.id!r}: give raw, compute and format, or no_raw_data")
        if self.no_raw_data is not None and (self.raw or self.compute):
            raise ValueError(f"claim {self.id!r}: no_raw_data with raw files or a function")
        return self


class NotMeasured(BaseModel):
    """A figure-like number in a measurement paragraph (README.md, docs/*.md) that is not a measurement (a setting, a
    plan's figure, an example), with why."""

    model_config = ConfigDict(extra="forbid")
    file: str = "README.md"
    snippet: str
    why: str


class Claims(BaseModel):
    """docs/claims.yaml."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[1]
    runs: dict[str, Any] = Field(default_factory=dict)  # fields rows share, merged in with YAML's `<<: *run`
    claims: list[Claim]
    not_measured: list[NotMeasured] = Field(default_factory=list)


def load_claims(path: Path = CLAIMS_FILE) -> Claims:
    """The claims file at `path`, validated."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        found = data.get("schema_version") if isinstance(data, dict) else None
        raise ValueError(f"{path} has schema_version {found!r}; this chunkflow reads {SCHEMA_VERSION}")
    return Claims.model_validate(data)


def recompute(claim: Claim, root: Path = ROOT) -> str:
    """The claim's figure as its function computes it from its raw files, formatted as the text quotes it."""
    from chunkflow_planner import claims_compute

    if claim.compute is None or claim.format is None:
        raise ValueError(f"claim {claim.id!r} has no raw data to recompute from: {claim.no_raw_data}")
    fn = getattr(claims_compute, claim.compute, None)
    if fn is None or claim.compute.startswith("_"):
        raise ValueError(f"claim {claim.id!r}: claims_compute has no function {claim.compute!r}")
    value = fn([root / p for p in claim.raw], **claim.args)
    values = value if isinstance(value, tuple) else (value,)
    return claim.format.format(*values)


# ---- the text side: where figures are quoted ----------------------------------------------------------------------

# A figure-like number: a number or a range, with a unit the docs quote measurements in ("1.156x", "24.70 s",
# "434.4 ms", "54.5 GB/s", "+6.2%", "+-7.35%", "16-26%"); "x" only attached ("2 x 2.63 GB" is a product, not a figure).
FIGURE = re.compile(r"(?<![\w.+-])(?:\+-|[+-])?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x|\s?(?:ms|s|GB/s)|%)(?![\w/])")
# A paragraph (README.md, docs/*.md) reports a measurement when it names a GPU, the raw data or a date.
MEASUREMENT = re.compile(r"\bH100\b|\bH200\b|docs/data/|\b20\d\d-\d\d-\d\d\b")


def paragraphs(text: str) -> list[str]:
    """A Markdown file's paragraphs outside code fences, each with its whitespace runs as single spaces."""
    out: list[str] = []
    cur: list[str] = []
    fenced = False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.strip():
            cur.append(line)
        elif cur:
            out.append(" ".join(" ".join(cur).split()))
            cur = []
    return out


def normalized(text: str) -> str:
    """A Markdown file as its paragraphs (see `paragraphs`), one blank line between them: snippets are found in this
    form, so re-wrapping a paragraph moves no quote."""
    return "\n\n".join(paragraphs(text))


def unclaimed_figures(text: str, snippets: list[str]) -> list[str]:
    """The figure-like numbers of `text`'s measurement paragraphs that lie in none of `snippets` (each a claims row's
    or a not_measured entry's), with their paragraph's opening words."""
    out = []
    for para in paragraphs(text):
        if not MEASUREMENT.search(para):
            continue
        covered = [(m.start(), m.start() + len(snip)) for snip in snippets
                   for m in re.finditer(re.escape(" ".join(snip.split())), para)]
        for m in FIGURE.finditer(para):
            if not any(a <= m.start() and m.end() <= b for a, b in covered):
                out.append(f"{m.group(0)!r} in: {para[:70]}...")
    return out


NUMBER = re.compile(r"(?:\+-|[+-])?\d+(?:\.\d+)?")


def shows(snippet: str, figure: str) -> bool:
    """Whether a quoted snippet shows the figure: the figure's text itself, or (a figure of several numbers joined
    by other words) its numbers in order among the snippet's."""
    snippet, figure = " ".join(snippet.split()), " ".join(figure.split())
    if figure in snippet:
        return True
    want, have = NUMBER.findall(figure), iter(NUMBER.findall(snippet))
    return bool(want) and all(any(w == h for h in have) for w in want)
