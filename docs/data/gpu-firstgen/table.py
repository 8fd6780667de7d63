"""Issue 55's evidence table, recomputed from the raw files: every band verdict of each run's report (a process's
first generation: the phases' times and peaks, the generation, host memory, the load) against its plan's band, the
first generation's start-up band one-sided (Band.rel_low/rel_high: the report's `below` and `above`).

    python3 docs/data/gpu-firstgen/table.py RAW_DIR     (reads RAW_DIR/report-{fresh,after}N-NAME.json)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPORT = re.compile(r"report-(fresh|after)(\d+)-(.+)\.json$")


def verdicts(raw: Path) -> list[dict]:
    """One row per (report, band): which run, the key, the error, the band's edges and whether it is inside."""
    rows = []
    for path in sorted(raw.glob("report-*.json")):
        m = REPORT.search(path.name)
        if not m:
            continue
        rep = json.loads(path.read_text())
        warm = (rep.get("generation") or {}).get("warmup_generations") or 0
        for key, v in (rep.get("bands") or {}).items():
            rows.append(dict(kind=m[1], round=int(m[2]), pipeline=m[3], key=key, error=v["error"],
                             below=v.get("below", v["band"]), above=v.get("above", v["band"]), inside=v["inside"],
                             first=warm == 0))
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: a line per band verdict, then the count inside per kind of run and in all."""
    lines = ["| run | pipeline | figure | error | band | inside |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} {r['round']} | {r['pipeline']} | {r['key']} | {r['error']:+.1%} | "
                     f"-{r['below']:.1%} / +{r['above']:.1%} | {'yes' if r['inside'] else 'NO'} |")
    lines.append("")
    for kind in ("fresh", "after"):
        got = [r for r in rows if r["kind"] == kind]
        if got:
            lines.append(f"- {kind}: {sum(r['inside'] for r in got)} of {len(got)} inside "
                         f"({len({(r['round'], r['pipeline']) for r in got})} first generations)")
    lines.append(f"- all: {sum(r['inside'] for r in rows)} of {len(rows)} inside")
    if any(not r["first"] for r in rows):
        lines.append("- note: some reports had a warm-up generation (not a process's first)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(verdicts(Path(sys.argv[1]))))
