"""The table of issue 54's GPU evidence, recomputed from the raw files gpu_cache.sh wrote (a folder of them).

    python3 docs/data/gpu-cache/table.py docs/data/gpu-cache/raw/RUN [--json]

One row per way a generation ran (chunkflow's plan with no cache, a cache, the first-block cache at the no-cache
plan's setting; diffusers all on the GPU and with group offloading, each with the same cache): the measured generation
and denoise seconds (the measured generation after the warm-up), chunkflow's prediction and its error, the H2D bytes
chunkflow copied and those copied for skipped blocks, the block runs skipped, the hit rate measured against planned,
and whether the latents were chunkflow's bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def chunkflow_row(report: dict) -> dict:
    """What one `chunkflow run --report` says of its measured generation."""
    g, st = report["generation"], report["stats"]
    den = g["phases"]["denoise"]
    cache = g.get("cache") or {}
    return {
        "setting": report["run"]["offload"], "generation_s": g["generation_time_s"],
        "predicted_generation_s": g.get("predicted_generation_time_s"), "generation_error": g.get("generation_time_error"),
        "denoise_s": den["measured_time_s"], "predicted_denoise_s": den.get("predicted_time_s"),
        "denoise_error": den.get("time_error"),
        "h2d_bytes_issued": st["h2d_bytes_issued"], "skipped_h2d_bytes": st["skipped_h2d_bytes"] or 0,
        "streamed_bytes_per_forward": st["streamed_bytes_per_step"], "forwards": st["forwards"],
        "blocks_skipped": cache.get("blocks_skipped"), "blocks_computed": cache.get("blocks_computed"),
        "hit_rate": cache.get("measured_hit_rate"), "planned_hit_rate": cache.get("planned_hit_rate"),
        "planned_computed_steps": cache.get("planned_computed_steps"),
    }


def rows(folder: Path) -> dict[str, dict]:
    """Every way's row, by its tag (flux-none, flux-first-block, flux-first-block-streamed, ...)."""
    out: dict[str, dict] = {}
    for report in sorted(folder.glob("report-*.json")):
        tag = report.stem.removeprefix("report-")
        out[tag] = {"way": "chunkflow", **chunkflow_row(json.loads(report.read_text()))}
        same = _load(folder / f"compare-{tag}.json")
        if same is not None:
            out[tag]["latents_identical_to_whole_first"] = same["identical"]
    for way in ("gpu", "group"):
        for f in sorted(folder.glob(f"diffusers-{way}-*.json")):
            tag = f.stem.removeprefix(f"diffusers-{way}-")
            d = json.loads(f.read_text())
            out[f"{tag} diffusers-{way}"] = {"way": f"diffusers {way}", "generation_s": d.get("generation_s"),
                                            "latents_identical": d.get("latents_identical"), "cache": d.get("cache"),
                                            "other_shape": d.get("latents_identical") is False
                                            and "latents_max_abs_diff" in d and d["latents_max_abs_diff"] is None}
    return out


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:+.1f}%"


def _plan_without_its_cache(r: dict) -> bool:
    """A run with a cache whose plan priced none (first-block caching at the no-cache plan's setting)."""
    return r["hit_rate"] is not None and r["planned_hit_rate"] is None


def markdown(table: dict[str, dict]) -> str:
    lines = ["| way | generation s | predicted | error | denoise s | predicted | error | H2D GB issued | for skipped GB | "
             "block runs skipped | hit rate (planned) | latents |", "|" + "---|" * 12]
    for tag, r in table.items():
        if r["way"] == "chunkflow":
            planned = "-" if r["planned_hit_rate"] is None else f"{r['planned_hit_rate']:.2f}"
            hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f} ({planned})"
            same = r.get("latents_identical_to_whole_first")
            cacheless = _plan_without_its_cache(r)  # its plan priced no cache: its errors are not the plan's
            lines.append(f"| {tag} | {_s(r['generation_s'])} | {_s(r['predicted_generation_s'])} | "
                         f"{'(no-cache plan)' if cacheless else _pct(r['generation_error'])} | {_s(r['denoise_s'])} | "
                         f"{_s(r['predicted_denoise_s'])} | {'(no-cache plan)' if cacheless else _pct(r['denoise_error'])}"
                         f" | {r['h2d_bytes_issued'] / 1e9:.1f} | "
                         f"{r['skipped_h2d_bytes'] / 1e9:.2f} | {r['blocks_skipped']} | {hit} | "
                         f"{'-' if same is None else ('= whole-first run' if same else 'DIFFER')} |")
        else:
            same = r["latents_identical"]
            verdict = "-" if same is None else "= chunkflow" if same else \
                "other shape: not compared" if r.get("other_shape") else "DIFFER"
            lines.append(f"| {tag} | {_s(r['generation_s'])} | | | | | | | | | | {verdict} |")
    return "\n".join(lines)


def goals(table: dict[str, dict]) -> dict[str, dict]:
    """Per cached chunkflow run: the cache's compute saving (block runs skipped / block runs), its speed-up over the
    no-cache run of the same part (denoise phase and whole generation), and each prediction's error."""
    out = {}
    for tag, r in table.items():
        part = tag.split("-")[0]
        base = table.get(f"{part}-none")
        if r["way"] != "chunkflow" or base is None or tag == f"{part}-none" or not r["blocks_computed"]:
            continue
        runs = r["blocks_computed"] + r["blocks_skipped"]
        cacheless = _plan_without_its_cache(r)
        out[tag] = {"compute_saving": r["blocks_skipped"] / runs,
                    "speedup_of_saving": runs / r["blocks_computed"],  # time falling as the block runs fall
                    "speedup_denoise": base["denoise_s"] / r["denoise_s"],
                    "speedup_generation": base["generation_s"] / r["generation_s"],
                    "time_saving_denoise": 1 - r["denoise_s"] / base["denoise_s"],
                    "denoise_error": None if cacheless else r["denoise_error"],
                    "generation_error": None if cacheless else r["generation_error"]}
    return out


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    table = rows(folder)
    if "--json" in argv:
        print(json.dumps({"rows": table, "goals": goals(table)}, indent=1))
        return 0
    print(markdown(table))
    for tag, g in goals(table).items():
        plan = ("its plan priced no cache" if g["denoise_error"] is None else
                f"plan error denoise {_pct(g['denoise_error'])}, generation {_pct(g['generation_error'])}")
        print(f"\n{tag}: compute saved {100 * g['compute_saving']:.1f}% of block runs "
              f"({g['speedup_of_saving']:.2f}x if the time fell with them); denoise "
              f"{100 * g['time_saving_denoise']:.1f}% shorter ({g['speedup_denoise']:.2f}x), generation "
              f"{g['speedup_generation']:.2f}x; {plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
