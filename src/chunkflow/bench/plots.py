"""The bench's plots (matplotlib, the `plots` extra), drawn from bench.csv and bench.json alone.

  step_time.png   step time vs workload: measured points, predicted curves per mode, critical point (figure 3)
  memory.png      peak GPU memory vs workload, measured and predicted
  breakdown.png   compute / collective / prefetch stall / overhead per point, layerwise step marked (figure 4)
  chunk_size.png  step time vs chunk size at one workload, chunkflow against layerwise (figure 5)
  residency.png   step time and peak memory vs residency at one workload, against no offload (figure 6)
  accuracy.png    predicted against measured step time and peak memory, every point
  roofline.png    attainable FLOP/s vs operational intensity, I_block of each workload against I* (figure 7)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from chunkflow.bench.choices import PlannerChoice
from chunkflow.bench.sweep import BenchError, BenchMeta, Config, short_bytes
from chunkflow_planner.catalog import HardwareSpec, ModelSpec

COLORS = {"none": "black", "layerwise": "tab:red", "chunkflow": "tab:blue"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'chunkflow[plots]' (the CSV was written)") from None
    return plt


def _rows(df, cfg: Config):
    sub = df[(df["mode"] == cfg.mode) & ((df["residency"] - cfg.residency).abs() < 1e-9)]
    if cfg.mode == "chunkflow":
        sub = sub[sub["chunk_bytes"] == cfg.chunk_bytes]
    return sub.sort_values("value")


def _dense(spec: ModelSpec, axis: str, values: list[int]) -> list[int]:
    lo, hi = min(values), max(values)
    step = (spec.vae_temporal or 1) if axis == "frames" else 1
    return list(range(lo, hi + 1, step))


def plot_all(df, meta: BenchMeta, spec: ModelSpec, hw: HardwareSpec, choice: PlannerChoice, out: Path) -> list[Path]:
    """Every plot the sweep has data for; returns their paths."""
    from chunkflow.run import predict
    from chunkflow_planner.overlap import GB, TFLOP, analyse

    plt = _plt()
    b, sp = meta.spec, meta.sp
    unit = "frames" if b.axis == "frames" else "batch size"
    w0 = b.workload(spec, b.values[0])
    shape = f"{w0.width}x{w0.height}"
    where = f"{meta.gpu}, SP={sp}" + (", NCCL_P2P_DISABLE=1" if meta.env.get("NCCL_P2P_DISABLE") not in (None, "", "0") else "")
    if sp > 1:
        where += ", chunk copies " + ("paced around collectives" if b.comm_aware else "not paced (awareness off)")
    sub = f"{where}, {meta.date[:10]}; predictions: profile '{hw.name}'"
    paths: list[Path] = []

    footer = "\n".join(textwrap.wrap(f"command: {meta.command}", 180))

    def finish(fig, name: str, title: str) -> None:
        fig.suptitle(f"{title}\n{sub}", fontsize=9)
        fig.text(0.01, 0.005, footer, fontsize=5.5, color="gray", va="bottom", ha="left")
        fig.tight_layout(rect=(0, 0.03 + 0.012 * footer.count("\n"), 1, 1))
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    def pred(w, cfg: Config):
        return predict(spec, w, hw, cfg.mode, cfg.chunk_bytes, cfg.residency, sp, b.comm_aware)

    # figure 3: step time and peak memory against the workload, with the critical point
    dense = _dense(spec, b.axis, b.values)
    ws = [b.workload(spec, v) for v in dense]
    crit = analyse(spec, w0, hw, sp).critical
    for name, col, attr, scale, ylabel in (
        ("step_time.png", "measured_step_s", "step_time_s", 1.0, "step time (s, one forward per step)"),
        ("memory.png", "measured_peak_bytes", "peak_memory_bytes", 1e-9, "peak GPU memory allocated (GB, rank 0)"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for m in b.modes:
            cfg = b.scaling_config(m)
            ax.plot(dense, [getattr(pred(w, cfg), attr) * scale for w in ws], "-", color=COLORS[m],
                    label=f"{cfg.label} predicted")
            rows = _rows(df, cfg)
            ys = rows[col].astype(float) * scale
            if ys.notna().any():
                ax.plot(rows["value"], ys, "o", color=COLORS[m], label=f"{cfg.label} measured")
        if crit.value is not None and min(dense) <= crit.value <= max(dense) * 1.5:
            ax.axvline(crit.value, color="gray", ls="--",
                       label=f"predicted critical point (F_block = F*): {crit.value:.1f} {b.axis}")
        elif crit.value is not None:
            ax.text(0.02, 0.02, f"predicted critical point: {crit.value:.1f} {b.axis} (off the axis)",
                    transform=ax.transAxes, color="gray", fontsize=8)
        if name == "memory.png" and df["measured_peak_bytes"].isna().all():
            ax.text(0.5, 0.95, "no GPU: peak memory not measured (predictions only)", transform=ax.transAxes,
                    ha="center", va="top", color="gray")
        ax.set_xlabel(unit)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        what = "step time" if name == "step_time.png" else "peak GPU memory"
        finish(fig, name, f"{spec.name} ({shape}): {what} vs {unit}, measured (points) and predicted (lines)")

    # figure 4: where the step goes, per workload and mode, layerwise's step marked
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(b.values) * len(b.modes)), 5))
    parts = (("compute_s", "compute", "tab:gray"), ("collective_s", "collective", "tab:purple"),
             ("prefetch_stall_s", "prefetch stall", "tab:orange"), ("overhead_s", "runtime overhead", "tab:olive"))
    x, ticks, labels = 0.0, [], []
    seen: set[str] = set()
    for v in b.values:
        lw = _rows(df, b.scaling_config("layerwise"))
        lw = lw[lw["value"] == v]
        xs0 = x
        for m in b.modes:
            r = _rows(df, b.scaling_config(m))
            r = r[r["value"] == v]
            if not len(r):
                continue
            r = r.iloc[0]
            bottom = 0.0
            for col, lab, color in parts:
                h = float(r[col]) if r[col] == r[col] else 0.0
                ax.bar(x, h, bottom=bottom if h >= 0 else 0.0, width=0.8, color=color,
                       label=lab if lab not in seen else None, edgecolor="white", linewidth=0.5)
                seen.add(lab)
                bottom += max(h, 0.0)
            ax.plot([x], [r["predicted_step_s"]], "_", color="black", markersize=18, mew=2,
                    label="predicted step" if "pred" not in seen else None)
            seen.add("pred")
            ticks.append(x)
            labels.append(f"{m}\n{v}")
            x += 1.0
        if len(lw):
            ax.hlines(float(lw["measured_step_s"].iloc[0]), xs0 - 0.45, x - 0.55, colors="tab:red", linestyles="--",
                      label="layerwise step (measured)" if "lw" not in seen else None)
            seen.add("lw")
        x += 0.6
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("time per step (s)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    finish(fig, "breakdown.png", f"{spec.name}: step-time breakdown per {b.axis} and mode (chunkflow "
                                 f"C={short_bytes(b.chunk)} r={b.residency:g})")

    # figure 5: chunk size
    if b.has_chunk_sweep:
        w = b.workload(spec, b.chunk_value)
        rows = df[(df["mode"] == "chunkflow") & (df["value"] == b.chunk_value)
                  & ((df["residency"] - b.residency).abs() < 1e-9)].sort_values("chunk_bytes")
        cs = sorted(b.chunk_sizes)
        fig, ax = plt.subplots(figsize=(8, 5))
        ax.plot([c / 1e6 for c in cs], [pred(w, Config.of("chunkflow", c, b.residency)).step_time_s for c in cs],
                "-", color=COLORS["chunkflow"], label="chunkflow predicted")
        ax.plot(rows["chunk_bytes"] / 1e6, rows["measured_step_s"], "o", color=COLORS["chunkflow"],
                label="chunkflow measured")
        for m, ls in (("layerwise", "--"), ("none", ":")):
            r = _rows(df, Config.of(m))
            r = r[r["value"] == b.chunk_value]
            if len(r):
                ax.axhline(float(r["measured_step_s"].iloc[0]), color=COLORS[m], ls=ls, label=f"{m} measured")
        if choice.chunk_bytes:
            ax.axvline(choice.chunk_bytes / 1e6, color="tab:green", ls="-.",
                       label=f"planner's chunk size: {short_bytes(choice.chunk_bytes)}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([c / 1e6 for c in cs])
        ax.set_xticklabels([short_bytes(c) for c in cs])
        ax.set_xlabel("chunk size C")
        ax.set_ylabel("step time (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        finish(fig, "chunk_size.png", f"{spec.name} at {b.chunk_value} {b.axis}: step time vs chunk size "
                                      f"(residency {b.residency:g})")

    # figure 6: residency
    if b.has_residency_sweep:
        w = b.workload(spec, b.residency_value)
        rs = [i / 50 for i in range(0, 51) if i / 50 <= max(0.6, max(b.residencies)) + 1e-9]
        pts = [pred(w, Config.of("chunkflow", b.chunk, r)) for r in rs]
        none_p = pred(w, Config.of("none"))
        cf = df[(df["mode"] == "chunkflow") & (df["value"] == b.residency_value)
                & (df["chunk_bytes"] == b.chunk)].sort_values("residency")
        nm = _rows(df, Config.of("none"))
        nm = nm[nm["value"] == b.residency_value]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, col, attr, scale, ylabel in ((a1, "measured_step_s", "step_time_s", 1.0, "step time (s)"),
                                             (a2, "measured_peak_bytes", "peak_memory_bytes", 1e-9,
                                              "peak GPU memory allocated (GB, rank 0)")):
            ax.plot(rs, [getattr(p, attr) * scale for p in pts], "-", color=COLORS["chunkflow"],
                    label="chunkflow predicted")
            ys = cf[col].astype(float) * scale
            if ys.notna().any():
                ax.plot(cf["achieved_residency"], ys, "o", color=COLORS["chunkflow"], label="chunkflow measured")
            ax.axhline(getattr(none_p, attr) * scale, color="gray", ls="--", label="no offload, predicted")
            if len(nm) and nm[col].notna().any():
                ax.axhline(float(nm[col].iloc[0]) * scale, color="black", ls=":", label="no offload, measured")
            if choice.residency is not None:
                ax.axvline(choice.residency, color="tab:green", ls="-.",
                           label=f"planner's residency for <= 1.05x none: {choice.residency:.2f}")
            ax.set_xlabel("residency r (fraction of each block kept on the GPU)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        finish(fig, "residency.png", f"{spec.name} at {b.residency_value} {b.axis}: memory-latency trade-off "
                                     f"over residency (chunk {short_bytes(b.chunk)})")

    # planner accuracy: every point
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, mcol, pcol, scale, what in ((a1, "measured_step_s", "predicted_step_s", 1.0, "step time (s)"),
                                        (a2, "measured_peak_bytes", "predicted_peak_bytes", 1e-9,
                                         "peak GPU memory (GB)")):
        d = df[df[mcol].notna()]
        for m in b.modes:
            s = d[d["mode"] == m]
            ax.plot(s[pcol].astype(float) * scale, s[mcol].astype(float) * scale, "o", color=COLORS[m], label=m)
        if len(d):
            lo = float(min(d[pcol].min(), d[mcol].min())) * scale
            hi = float(max(d[pcol].max(), d[mcol].max())) * scale
            ax.plot([lo, hi], [lo, hi], "-", color="gray", lw=0.8, label="measured = predicted")
            ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="gray", alpha=0.12,
                            label="+-10%")
        else:
            ax.text(0.5, 0.5, "not measured here", transform=ax.transAxes, ha="center", color="gray")
        ax.set_xlabel(f"predicted {what}")
        ax.set_ylabel(f"measured {what}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    finish(fig, "accuracy.png", f"{spec.name}: planner accuracy, every measured point")

    # figure 7: roofline of streamed blocks
    P, BW = hw.peak_tflops * TFLOP, hw.h2d_gbps * GB
    a0 = analyse(spec, w0, hw, sp)
    eta = hw.for_model(spec.name).eta_comp_at(a0.F_star)
    i_vals = [analyse(spec, b.workload(spec, v), hw, sp).I_block for v in b.values]
    lo, hi = min(i_vals + [a0.I_star]) / 10, max(i_vals + [a0.I_star]) * 10
    grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(grid, [min(eta * P, hw.eta_pref * BW * i) / TFLOP for i in grid], "-", color="black", label="roofline")
    ax.axvline(a0.I_star, color="gray", ls="--", label=f"I* = {a0.I_star:.0f} FLOP/B")
    for v, i in zip(b.values, i_vals):
        y = min(eta * P, hw.eta_pref * BW * i) / TFLOP
        ax.plot([i], [y], "s", color="tab:green")
        ax.annotate(f"{v} {b.axis}", (i, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    off = df[df["mode"] != "none"]
    if len(off):
        ax.plot(off["i_block"], off["f_block"] * spec.n_blocks / off["measured_step_s"] / TFLOP, "x",
                color="tab:red", label="measured with offload: block FLOPs per GPU / step time")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity I = F_block / B_pref (FLOP per prefetched byte, per GPU)")
    ax.set_ylabel("attainable throughput per GPU (TFLOP/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    finish(fig, "roofline.png", f"{spec.name}: roofline of streamed blocks (I_block of each workload vs I*)")
    return paths
