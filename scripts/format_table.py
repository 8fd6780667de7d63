"""Issue 52's GPU table from the raw files scripts/format_bench.py wrote (docs/data/gpu-formats/raw): per model and
format, each way's median forward, the ratios the issue's goals name, the plan's forward against the measured one
(the plan's step over its guidance passes) and the GPU peak against the plan's.

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


def main(raw: Path) -> None:
    bit = {c["file"]: c["bit_identical"] for c in json.loads((raw / "compare.json").read_text())}
    print("| model | format | all on GPU | forward (plan's setting) | ahead | leaf (diffusers) | forward / GPU | "
          "leaf / forward | plan / forward | peak / plan | bit-identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, fmt), ways in sorted(rows(raw).items()):
        t = {w: r["median_s"] for w, r in ways.items()}
        fwd = ways.get("forward", {})
        pred = fwd.get("predicted_step_s")
        per_forward = pred / passes(raw, model, fmt) if pred else None
        same = all(bit.get(f"out-{w}-{model}-{fmt}.pt", False) for w in ways if w != "gpu")

        def s(w: str) -> str:
            return f"{t[w] * 1e3:.0f} ms" if w in t else "-"

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.3f}" if a and b else "-"

        print(f"| {model} | {fmt} | {s('gpu')} | {s('forward')} | {s('chunkflow')} | {s('leaf')} | "
              f"{ratio(t.get('forward'), t.get('gpu'))} | {ratio(t.get('leaf'), t.get('forward'))} | "
              f"{ratio(per_forward, t.get('forward'))} | "
              f"{ratio(fwd.get('peak_allocated_bytes'), fwd.get('predicted_peak_bytes'))} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
