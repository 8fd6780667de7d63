"""Issue 52's GPU table from the raw files scripts/format_bench.py wrote (docs/data/gpu-formats/raw): per model and
format, each way's median forward, the ratios the issue's goals name, the plan's forward against the measured one
(the plan's step over its guidance passes) and the GPU peak against the plan's; then each phase on its own (the
`phases` way: compute in bf16 with no decode, the decode as the `gpu` way's time less that compute, the link alone
with the plan's bytes a step) against what the plan prices it at, per forward.

    python3 scripts/format_table.py docs/data/gpu-formats/raw > docs/data/gpu-formats/table.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(raw: Path) -> dict[tuple[str, str], dict[str, dict]]:
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for f in sorted(raw.glob("time-*.json")):
        r = json.loads(f.read_text())
        out.setdefault((r["model"], r["format"]), {})[r["way"]] = r
    return out


def passes(raw: Path, model: str, fmt: str) -> int:
    return int(json.loads((raw / f"plan-{model}-{fmt}.json").read_text())["workload"]["cfg_passes"])


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def phase_table(raw: Path, table: dict[tuple[str, str], dict[str, dict]]) -> None:
    """Per model and format with a `phases` file: each phase measured and planned, per forward."""
    print("\n| model | format | compute measured | planned | plan / measured | decode measured | planned | "
          "plan / measured | decode (run report's probe) | link measured | planned | plan / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, fmt), ways in sorted(table.items()):
        ph, gpu = ways.get("phases"), ways.get("gpu")
        if ph is None:
            continue
        n = passes(raw, model, fmt)
        decode = gpu["median_s"] - ph["compute_s"] if gpu else None
        got = [ph["compute_s"], decode, ph["copy_s"] / n]
        want = [ph["plan_compute_s"] / n, (ph["plan_decode_s"] or 0) / n, (ph["plan_copy_s"] or 0) / n]
        cells = [f"{g * 1e3:.0f} ms | {w * 1e3:.0f} ms | {ratio(w, g)}" if g else "- | - | -" for g, w in zip(got, want)]
        probe = (ways.get("forward") or {}).get("decode_probe")
        cells.insert(2, f"{probe['seconds_per_forward'] * 1e3:.0f} ms" if probe else "-")
        print(f"| {model} | {fmt} | " + " | ".join(cells) + " |")


def main(raw: Path) -> None:
    bit = {c["file"]: c["bit_identical"] for c in json.loads((raw / "compare.json").read_text())}
    table = rows(raw)
    print("| model | format | all on GPU | forward (plan's setting) | fastest in budget | ahead | leaf (diffusers) | "
          "forward / GPU | leaf / forward | leaf / fastest | plan / forward | plan / fastest | peak / plan | "
          "bit-identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, fmt), ways in sorted(table.items()):
        ways = {w: r for w, r in ways.items() if w != "phases"}
        t = {w: r["median_s"] for w, r in ways.items()}
        fwd, tight = ways.get("forward", {}), ways.get("tight", {})
        n = passes(raw, model, fmt)
        per_forward = {w: r["predicted_step_s"] / n for w, r in ways.items() if r.get("predicted_step_s")}
        same = all(bit.get(f"out-{w}-{model}-{fmt}.pt", False) for w in ways if w != "gpu")

        def s(w: str) -> str:
            return f"{t[w] * 1e3:.0f} ms" if w in t else "-"

        print(f"| {model} | {fmt} | {s('gpu')} | {s('forward')} | {s('tight')} | {s('chunkflow')} | {s('leaf')} | "
              f"{ratio(t.get('forward'), t.get('gpu'))} | {ratio(t.get('leaf'), t.get('forward'))} | "
              f"{ratio(t.get('leaf'), t.get('tight'))} | {ratio(per_forward.get('forward'), t.get('forward'))} | "
              f"{ratio(per_forward.get('tight'), t.get('tight'))} | "
              f"{ratio(fwd.get('peak_allocated_bytes'), fwd.get('predicted_peak_bytes'))} | {'yes' if same else 'NO'} |")
    phase_table(raw, table)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
