"""Every figure README.md and docs/ quote from a measurement is a row of docs/claims.yaml, and each is recomputed
here from its raw files under docs/data/ by the function the row names (chunkflow_planner/claims_compute.py),
formatted as the text quotes it, and checked where it is quoted: the snippet is still in its file (once) and shows
that figure. A changed number in the text, a snippet gone, or raw data that no longer gives the figure fails.

New figures cannot slip into the README or docs/*.md unbacked: in every paragraph that reports a measurement (one
naming an H100 or H200, docs/data/ or a date), every figure-like number (a number or range followed by "x", " ms", " s",
" GB/s" or "%") must lie inside a snippet of a claims row or of a `not_measured` entry (a setting, an example, a
plan's own figure, each with why). GB figures are rows too where they are measurements, but the rule does not look
for them (budgets are quoted in GB everywhere).
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import pytest

from chunkflow_planner.claims import (ROOT, Claim, load_claims, normalized, recompute, shows,
                                      unclaimed_figures)

CLAIMS = load_claims()
ROWS = CLAIMS.claims
IDS = [c.id for c in ROWS]


@cache
def _doc(file: str) -> str:
    return normalized((ROOT / file).read_text())


def _quote_problems(claim: Claim, doc: Callable[[str], str] = _doc) -> list[str]:
    """What is wrong with a row's quotes: a snippet not in its file exactly once, or one that shows another figure."""
    out = []
    for place in claim.quoted:
        snippet = " ".join(place.snippet.split())
        found = doc(place.file).count(snippet)
        if found != 1:
            out.append(f"{claim.id}: {place.file} holds {snippet!r} {found} times (want once)")
        elif not shows(snippet, claim.figure):
            out.append(f"{claim.id}: {place.file}'s {snippet!r} does not show {claim.figure!r}")
    return out


def test_the_claims_file_reads_and_its_ids_are_unique():
    assert CLAIMS.schema_version == 1 and len(ROWS) > 50
    assert len(set(IDS)) == len(IDS), sorted(i for i in IDS if IDS.count(i) > 1)


@pytest.mark.parametrize("claim", [c for c in ROWS if c.compute], ids=[c.id for c in ROWS if c.compute])
def test_each_figure_recomputes_from_its_raw_files(claim):
    for path in claim.raw:
        assert path.startswith("docs/data/") and (ROOT / path).is_file(), path
    assert recompute(claim) == claim.figure


@pytest.mark.parametrize("claim", ROWS, ids=IDS)
def test_each_quote_still_shows_its_figure(claim):
    assert _quote_problems(claim) == []


def test_a_changed_figure_in_the_text_fails():
    """The check above on a README with one figure edited: the snippet is gone, and the row says so."""
    claim = next(c for c in ROWS if c.id == "formats-q8-vs-gpu")
    edited = _doc("README.md").replace("1.156x all on the GPU", "1.149x all on the GPU")
    problems = _quote_problems(claim, doc=lambda f: edited if f == "README.md" else _doc(f))
    assert len(problems) == 1 and "README.md holds" in problems[0]


def test_a_figure_without_raw_data_says_so_where_it_is_quoted():
    unbacked = [c for c in ROWS if c.no_raw_data]
    assert unbacked
    for claim in unbacked:
        for place in claim.quoted:
            para = next(p for p in _doc(place.file).split("\n\n") if " ".join(place.snippet.split()) in p)
            assert "no raw file" in para, (claim.id, para)


def test_superseded_and_repeated_runs_name_rows_that_exist():
    """A run superseded or repeated stays a row; every link names one, and a row quoted nowhere is such a run."""
    ids = set(IDS)
    linked = {c.superseded_by for c in ROWS} | {r for c in ROWS for r in c.repeats}
    assert linked - {None} <= ids, (linked - {None}) - ids
    for claim in ROWS:
        assert claim.quoted or claim.superseded_by or claim.id in linked, claim.id


def _snippets(file: str) -> list[str]:
    """Every claims row's and not_measured entry's snippet quoted in `file`."""
    return [p.snippet for c in ROWS for p in c.quoted if p.file == file] + \
        [n.snippet for n in CLAIMS.not_measured if n.file == file]


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("file", DOCS)
def test_every_measured_figure_in_the_readme_and_docs_has_a_claims_row(file):
    assert unclaimed_figures((ROOT / file).read_text(), _snippets(file)) == []


def test_a_new_measured_figure_without_a_row_fails():
    snippets = _snippets("README.md")
    readme = (ROOT / "README.md").read_text()
    added = readme.replace("Ctrl-C stops it cleanly.", "Ctrl-C stops it cleanly in 0.4 s on an H200.")
    found = unclaimed_figures(added, snippets)
    assert len(found) == 1 and found[0].startswith("'0.4 s' in: It listens on 127.0.0.1"), found


def test_not_measured_entries_are_in_their_files():
    for entry in CLAIMS.not_measured:
        assert _doc(entry.file).count(" ".join(entry.snippet.split())) == 1, entry.snippet
        assert entry.why
