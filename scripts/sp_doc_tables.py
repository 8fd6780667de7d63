#!/usr/bin/env python
"""Markdown tables for docs/sp-h200x2.md: each SP=2 result row beside the planner's prediction.

    python scripts/sp_doc_tables.py docs/data/sp-h200x2/results-p2poff.jsonl h200-x2-pcie

Reads the rank-0 rows that scripts/gpu_sp_evidence.py wrote; predicts each mode with the catalog hardware
given (steptime.py at SP=2, one forward per step, C = 16 MB) and the regime with the block-averaged F* test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from chunkflow_planner.catalog import get_hardware, get_model  # noqa: E402
from chunkflow_planner.offload import OffloadConfig  # noqa: E402
from chunkflow_planner.overlap import analyse  # noqa: E402
from chunkflow_planner.steptime import step_time  # noqa: E402
from chunkflow_planner.workload import make_workload  # noqa: E402

MB = 10**6


def offload_config(mode: str) -> OffloadConfig:
    """The planner's configuration for one of the script's mode labels."""
    if mode in ("none", "layerwise"):
        return OffloadConfig(mode)
    if mode == "chunkflow-not-aware":
        return OffloadConfig("chunkflow", 16 * MB, comm_aware=False)
    residency = int(mode.split("-r")[-1]) / 100 if "-r" in mode else 0.0
    return OffloadConfig("chunkflow", 16 * MB, residency)


def table(path: str, hardware: str) -> str:
    hw = get_hardware(hardware)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    rows = [r for r in rows if "meta" not in r]
    bit_ok: dict[tuple, bool] = {}
    for r in rows:
        key = (r["model"], r["value"], r["mode"])
        bit_ok[key] = bit_ok.get(key, True) and r["bit_identical"]
    out = ["| model | frames / batch | planner regime | mode | step (ms) | vs none | predicted (ms) | error | compute | "
           "collective | prefetch stall (fence) | overhead | copies started inside a collective (GPU-timed / "
           "stream-allowed / all) | bit-identical, both ranks |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in (r for r in rows if r["rank"] == 0):
        spec = get_model(r["model"])
        w = make_workload(spec, cfg_passes=1, **({"frames": r["value"]} if r["axis"] == "frames" else {"batch": r["value"]}))
        regime = analyse(spec, w, hw, sp=2).regime
        pred = step_time(spec, w, hw, offload_config(r["mode"]), sp=2).total * 1e3
        copies = "" if r["log_copies"] is None else (
            f"{r['gpu_copies_inside_collectives']} / {r['stream_overlap_pairs']} / {r['log_copies']}")
        out.append(
            f"| {spec.name} | {r['value']} | {regime} | {r['mode']} | {r['step_ms']:.1f} | {r['vs_none']:.3f}x | "
            f"{pred:.0f} | {(pred - r['step_ms']) / r['step_ms']:+.0%} | {r['compute_ms']:.0f} | {r['collective_ms']:.0f} | "
            f"{r['prefetch_stall_ms']:.1f} ({r['fence_stall_ms']:.1f}) | {r['overhead_ms']:.1f} | {copies} | "
            f"{'yes' if bit_ok[(r['model'], r['value'], r['mode'])] else 'NO'} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2]))
