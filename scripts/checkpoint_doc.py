"""Tables for docs/checkpoint-h200.md from the run reports of docs/data/h200-checkpoint/gpu_h200_checkpoint.sh: per pipeline and page
cache state, the load (measured against the plan) beside diffusers' own from_pretrained + .to("cuda") of the same
folder, the host peak, every phase's peak GPU memory against the budget, denoise and generation time against the
plan, and whether the latents equal diffusers'.

    python3 scripts/checkpoint_doc.py docs/data/h200-checkpoint [docs/data/h200-checkpoint-overlap ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PIPELINES = ("wan22-5b", "wan21-14b")


def _pct(m: float, p: float | None) -> str:
    return "-" if not p else f"{(m - p) / p:+.1%}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def rows(folder: Path) -> list[str]:
    out = []
    for name in PIPELINES:
        ref = folder / f"{name}-diffusers.json"
        diffusers = json.loads(ref.read_text()) if ref.exists() else None
        for state in ("cold", "warm"):
            path = folder / f"{name}-{state}-report.json"
            if not path.exists():
                continue
            r = json.loads(path.read_text())
            g, ld = r["generation"], r["generation"]["load"]
            phases = g["phases"]
            peak = max(p["measured_peak_memory_bytes"] for p in phases.values())
            worst = max(phases, key=lambda k: phases[k]["measured_peak_memory_bytes"])
            den = phases["denoise"]
            same = "-" if diffusers is None or state != "cold" else ("yes" if diffusers["latents_identical"] else "NO")
            ref_load = f"{diffusers['load_s']:.1f} s" if diffusers is not None and state == "cold" else "-"
            out.append(
                f"| {r['plan']['model']['name']} | {state} ({ld['cached_fraction']:.0%} cached) | "
                f"{ld['measured_time_s']:.1f} s ({_pct(ld['measured_time_s'], ld['predicted_time_s'])}), "
                f"read {ld['read_bytes'] / ld['read_seconds'] / 1e9:.2f} GB/s | {ref_load} | "
                f"{_gb(g['host_peak_bytes'])} ({_pct(g['host_peak_bytes'], g['predicted_host_memory_bytes'])}) | "
                f"{_gb(peak)} {worst} / {_gb(g['gpu_budget_bytes'])} | "
                f"{den['measured_time_s']:.2f} s ({_pct(den['measured_time_s'], den['predicted_time_s'])}) | "
                f"{g['generation_time_s']:.2f} s ({_pct(g['generation_time_s'], g['predicted_generation_time_s'])}) | "
                f"{same} |")
    return out


def main() -> None:
    print("| pipeline | page cache | load (vs plan), read rate | diffusers load | host peak (vs plan) | "
          "peak GPU (reserved) / budget | denoise (vs plan) | generation (vs plan) | latents = diffusers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in sys.argv[1:]:
        for row in rows(Path(folder)):
            print(row)


if __name__ == "__main__":
    main()
