#!/usr/bin/env python
"""Regenerate the tables of docs/results.md from the committed bench runs (docs/data/results-h200x2).

    python scripts/results_doc.py           # rewrite every <!-- table:NAME --> ... <!-- /table:NAME --> block
    python scripts/results_doc.py --check   # exit 1 if docs/results.md is not what the data gives

Each bench directory holds bench.csv and bench.json as `chunkflow bench` wrote them on the GPU
(scripts/gpu_results.py); the planner's picks come from chunkflow.commands.bench.choices, the same code the bench's
summary.md uses.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import pandas as pd  # noqa: E402

from chunkflow.commands.bench import load, planner_choice  # noqa: E402
from chunkflow.commands.bench.summary import chunk_verdict, error_stats  # noqa: E402
from chunkflow_planner.catalog import HardwareSpec, get_model  # noqa: E402

DATA = ROOT / "docs" / "data" / "results-h200x2"
DOC = ROOT / "docs" / "results.md"
LINKS = {"p2poff": "NCCL_P2P_DISABLE=1 (PCIe path)", "nvlink": "NVLink"}
MODELS = {"wan": "Wan2.2-TI2V-5B", "flux": "FLUX.1-dev", "hunyuan": "HunyuanVideo"}
TOL = 1.05


@functools.lru_cache(maxsize=None)
def runs(link: str, key: str):
    """(bench.csv, bench.json) of one run directory, read once; the tables only read them."""
    return load(DATA / link / key)


def _x(a: float, b: float) -> str:
    return f"{a / b:.3f}x"


def _ms(s: float) -> str:
    return f"{1e3 * s:.0f}" if s < 10 else f"{s:.1f}"


def _row(df, mode, value, chunk=None, residency=None):
    d = df[(df["mode"] == mode) & (df["value"] == value)]
    if chunk is not None:
        d = d[d["chunk_bytes"] == chunk]
    if residency is not None:
        d = d[(d["residency"] - residency).abs() < 1e-9]
    return d.iloc[0] if len(d) else None


def table_scaling() -> str:
    out = ["| model | link | n / b | none ms | layerwise | chunkflow | chunkflow speed-up over layerwise "
           "| contention removed | peak GB none / layerwise / chunkflow | predicted regime |",
           "|" + "---|" * 10]
    for key, name in MODELS.items():
        for link in LINKS:
            df, meta = runs(link, key)
            b = meta.spec
            for v in b.values:
                n = _row(df, "none", v)
                lw = _row(df, "layerwise", v)
                cf = _row(df, "chunkflow", v, b.chunk, b.residency)
                sn, sl, sc = n["measured_step_s"], lw["measured_step_s"], cf["measured_step_s"]
                removed = f"{(sl - sc) / (sl - sn):.0%}" if sl - sn > 0.01 * sn else "(none to remove)"
                out.append(f"| {name} | {link} | {v} | {_ms(sn)} | {_x(sl, sn)} | {_x(sc, sn)} | {sl / sc:.3f}x | "
                           f"{removed} | {n['measured_peak_bytes'] / 1e9:.1f} / {lw['measured_peak_bytes'] / 1e9:.2f} / "
                           f"{cf['measured_peak_bytes'] / 1e9:.2f} | {cf['regime']} |")
    return "\n".join(out)


def table_critical() -> str:
    out = ["| model | link | predicted critical point (F_block = F*) | first measured point with chunkflow "
           "<= 1.02x none |", "|---|---|---|---|"]
    for key, name in MODELS.items():
        for link in LINKS:
            df, meta = runs(link, key)
            b = meta.spec
            first = next((v for v in b.values if (cf := _row(df, "chunkflow", v, b.chunk, b.residency)) is not None
                          and cf["measured_step_s"] <= 1.02 * _row(df, "none", v)["measured_step_s"]), None)
            crit = float(df["critical"].dropna().iloc[0])
            out.append(f"| {name} | {link} | {crit:.1f} {b.axis} | {first if first is not None else '-'} {b.axis} |")
    return "\n".join(out)


def table_breakdown() -> str:
    out = ["| model | link | n / b | mode | step ms | compute | collective | prefetch stall | overhead |",
           "|" + "---|" * 9]
    for key, name in MODELS.items():
        for link in LINKS:
            df, meta = runs(link, key)
            b = meta.spec
            for v in b.values:
                for mode in ("layerwise", "chunkflow"):
                    r = _row(df, mode, v, b.chunk if mode == "chunkflow" else None,
                             b.residency if mode == "chunkflow" else None)
                    out.append(f"| {name} | {link} | {v} | {mode} | {1e3 * r['measured_step_s']:.1f} | "
                               f"{1e3 * r['compute_s']:.1f} | {1e3 * r['collective_s']:.1f} | "
                               f"{1e3 * r['prefetch_stall_s']:.1f} | {1e3 * r['overhead_s']:.1f} |")
    return "\n".join(out)


CHUNK_RUNS = {  # column label: run directory (all at Wan2.2-TI2V-5B, 81 frames)
    "p2poff, paced": "p2poff", "nvlink, paced": "nvlink", "nvlink, unpaced (default)": "nvlink-noaware-chunk"}


def table_chunk() -> str:
    cols = {}
    verdicts = []
    for label, run in CHUNK_RUNS.items():
        df, meta = runs(run, "wan")
        b = meta.spec
        spec, hw = get_model(b.model), HardwareSpec.model_validate(meta.hardware)
        choice = planner_choice(spec, b, hw, meta.sp)
        v = chunk_verdict(df, meta, choice)
        n = _row(df, "none", b.chunk_value)["measured_step_s"]
        lw = _row(df, "layerwise", b.chunk_value)["measured_step_s"]
        cols[label] = (df, b, n, lw)
        verdicts.append(f"{label}: the planner picks {choice.chunk_bytes // 10**6} MB, the best measured is "
                        f"{v.best_bytes // 10**6} MB; the pick is {v.gap:+.1%} from the best "
                        f"({'within' if v.within else 'NOT within'} 5%)")
    out = ["| chunk C | " + " | ".join(f"{label}: ms (x none) | predicted ms" for label in cols) + " |",
           "|---|" + "---|---|" * len(cols)]
    b0 = next(iter(cols.values()))[1]
    for c in sorted(b0.chunk_sizes):
        cells = []
        for df, b, n, lw in cols.values():
            r = _row(df, "chunkflow", b.chunk_value, c, b.residency)
            cells.append(f"{1e3 * r['measured_step_s']:.1f} ({r['measured_step_s'] / n:.3f}x) | "
                         f"{1e3 * r['predicted_step_s']:.1f}")
        out.append(f"| {c // 10**6} MB | " + " | ".join(cells) + " |")
    cells = [f"{1e3 * lw:.1f} ({lw / n:.3f}x) | -" for _, _, n, lw in cols.values()]
    out.append("| layerwise | " + " | ".join(cells) + " |")
    cells = [f"{1e3 * n:.1f} | -" for _, _, n, _ in cols.values()]
    out.append("| none | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + "\n".join(f"- {v}" for v in verdicts)


@functools.lru_cache(maxsize=None)
def table_residency() -> str:
    out = ["| model | link | n / b | r | achieved r | step x none | predicted x none | peak GB | vs none peak |",
           "|" + "---|" * 9]
    picks = []
    for key, name in MODELS.items():
        for link in (*LINKS, "nvlink-noaware"):
            df, meta = runs(link, key)
            b = meta.spec
            v = b.residency_value
            n = _row(df, "none", v)
            for r in b.residencies:
                x = _row(df, "chunkflow", v, b.chunk, r)
                out.append(f"| {name} | {link} | {v} | {r:.1f} | {x['achieved_residency']:.2f} | "
                           f"{x['measured_step_s'] / n['measured_step_s']:.3f} | "
                           f"{x['predicted_step_s'] / n['predicted_step_s']:.3f} | "
                           f"{x['measured_peak_bytes'] / 1e9:.2f} | "
                           f"{x['measured_peak_bytes'] / n['measured_peak_bytes'] - 1:+.0%} |")
            choice = planner_choice(get_model(b.model), b, HardwareSpec.model_validate(meta.hardware), meta.sp)
            ok = [r for r in b.residencies
                  if _row(df, "chunkflow", v, b.chunk, r)["measured_step_s"] <= TOL * n["measured_step_s"]]
            picks.append(f"| {name} | {link} | {v} | {choice.residency:.2f} | "
                         f"{min(ok) if ok else 'none of 0-0.6'} |")
    return ("\n".join(out) + "\n\n| model | link | n / b | planner's residency for <= 1.05x none | smallest swept "
            "r measured <= 1.05x none |\n|---|---|---|---|---|\n" + "\n".join(picks))


def table_residency_picks() -> str:
    return table_residency().split("\n\n")[1]


def table_residency_rows() -> str:
    return table_residency().split("\n\n")[0]


def table_accuracy() -> str:
    out = ["| model | link | points | step time: median abs error | worst | peak memory: median abs error | worst |",
           "|" + "---|" * 7]
    all_df = []
    for key, name in MODELS.items():
        for link in (*LINKS, "nvlink-noaware", "nvlink-noaware-chunk"):
            if not (DATA / link / key).exists():
                continue
            df, meta = runs(link, key)
            all_df.append(df)
            s, m = error_stats(df["err_step"]), error_stats(df["err_peak"])
            out.append(f"| {name} | {link} | {s.n} | {s.median_abs:.1%} | {s.worst:+.1%} | {m.median_abs:.1%} | "
                       f"{m.worst:+.1%} |")
    d = pd.concat(all_df)
    s, m = error_stats(d["err_step"]), error_stats(d["err_peak"])
    out.append(f"| **all** | | {s.n} | **{s.median_abs:.1%}** | **{s.worst:+.1%}** | **{m.median_abs:.1%}** | "
               f"**{m.worst:+.1%}** |")
    return "\n".join(out)


def table_aware() -> str:
    out = ["| model | n / b | none ms | layerwise | chunkflow, paced (awareness on) | chunkflow, not paced (off) |",
           "|" + "---|" * 6]
    for key, name in MODELS.items():
        on, meta = runs("nvlink", key)
        off, meta_off = runs("nvlink-noaware", key)
        b = meta.spec
        for v in b.values:
            n = _row(on, "none", v)["measured_step_s"]
            n_off = _row(off, "none", v)["measured_step_s"]
            lw = _row(on, "layerwise", v)["measured_step_s"]
            a = _row(on, "chunkflow", v, b.chunk, b.residency)["measured_step_s"]
            na = _row(off, "chunkflow", v, b.chunk, b.residency)["measured_step_s"]
            out.append(f"| {name} | {v} | {1e3 * n:.1f} | {_x(lw, n)} | {_x(a, n)} | {_x(na, n_off)} |")
    return "\n".join(out)


TABLES = {"scaling": table_scaling, "critical": table_critical, "breakdown": table_breakdown, "chunk": table_chunk,
          "residency": table_residency_rows, "residency_picks": table_residency_picks, "accuracy": table_accuracy, "aware": table_aware}


def render(text: str) -> str:
    for name, fn in TABLES.items():
        pat = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)", re.S)
        if not pat.search(text):
            raise SystemExit(f"{DOC} has no <!-- table:{name} --> block")
        body = fn()
        text = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is out of date")
    args = ap.parse_args()
    old = DOC.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{DOC} is out of date: run python scripts/results_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
