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

from chunkflow.commands.bench.choices import PlannerChoice
from chunkflow.commands.bench.sweep import BenchError, BenchMeta
from chunkflow_planner.catalog import HardwareSpec, ModelSpec
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.overlap import GB, TFLOP, analyse
from chunkflow_planner.predict import predict
from chunkflow_planner.units import short_bytes

COLORS = {"none": "black", "layerwise": "tab:red", "chunkflow": "tab:blue", "diffusers-group": "tab:green"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'chunkflow-dit[plots]' (the CSV was written)") from None
    return plt


def _rows(df, cfg: OffloadConfig):
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
    f = _Figures(df, meta, spec, hw, choice, out)
    f.scaling()
    f.breakdown()
    if meta.spec.has_chunk_sweep:
        f.chunk_size()
    if meta.spec.has_residency_sweep:
        f.residency()
    f.accuracy()
    f.roofline()
    return f.paths


class _Figures:
    """One sweep's figures: shared titles, footer and predictions; one method per figure."""

    def __init__(self, df, meta: BenchMeta, spec: ModelSpec, hw: HardwareSpec, choice: PlannerChoice, out: Path):
        self.plt = _plt()
        self.df, self.meta, self.spec, self.hw, self.choice, self.out = df, meta, spec, hw, choice, out
        self.b, self.sp = meta.spec, meta.sp
        self.unit = "frames" if self.b.axis == "frames" else "batch size"
        self.w0 = self.b.workload(spec, self.b.values[0])
        where = f"{meta.gpu}, SP={self.sp}" + (
            ", NCCL_P2P_DISABLE=1" if meta.env.get("NCCL_P2P_DISABLE") not in (None, "", "0") else "")
        if self.sp > 1:
            where += ", chunk copies " + ("paced around collectives" if self.b.comm_aware else "not paced (awareness off)")
        if self.b.compile != "off":
            where += f", torch.compile {self.b.compile} (predictions: eager)"
        self.sub = f"{where}, {meta.date[:10]}; predictions: profile '{hw.name}'"
        self.footer = "\n".join(textwrap.wrap(f"command: {meta.command}", 180))
        self.paths: list[Path] = []

    def pred(self, w, cfg: OffloadConfig):
        return predict(self.spec, w, self.hw, cfg, self.sp)

    def finish(self, fig, name: str, title: str) -> None:
        fig.suptitle(f"{title}\n{self.sub}", fontsize=9)
        fig.text(0.01, 0.005, self.footer, fontsize=5.5, color="gray", va="bottom", ha="left")
        fig.tight_layout(rect=(0, 0.03 + 0.012 * self.footer.count("\n"), 1, 1))
        import io

        from chunkflow_planner.files import write_atomic

        path = self.out / name
        buf = io.BytesIO()
        fig.savefig(buf, dpi=110, format="png")
        write_atomic(path, buf.getvalue())
        self.plt.close(fig)
        self.paths.append(path)

    def scaling(self) -> None:
        """Figure 3: step time and peak memory against the workload, with the critical point."""
        b, spec, df = self.b, self.spec, self.df
        dense = _dense(spec, b.axis, b.values)
        ws = [b.workload(spec, v) for v in dense]
        crit = analyse(spec, self.w0, self.hw, self.sp).critical
        for name, col, attr, scale, ylabel in (
            ("step_time.png", "measured_step_s", "step_time_s", 1.0, "step time (s, one forward per step)"),
            ("memory.png", "measured_peak_bytes", "peak_memory_bytes", 1e-9, "peak GPU memory allocated (GB, rank 0)"),
        ):
            fig, ax = self.plt.subplots(figsize=(8, 5))
            for m in b.modes:
                cfg = b.config(m)
                ax.plot(dense, [getattr(self.pred(w, cfg), attr) * scale for w in ws], "-", color=COLORS[m],
                        label=f"{cfg.label} predicted")
                rows = _rows(df, cfg)
                ys = rows[col].astype(float) * scale
                if ys.notna().any():
                    ax.plot(rows["value"], ys, "o", color=COLORS[m], label=f"{cfg.label} measured")
            for name_ in b.baselines:  # measured only: the planner does not model other offloaders
                rows = df[df["mode"] == name_].sort_values("value")
                ys = rows[col].astype(float) * scale
                if ys.notna().any():
                    ax.plot(rows["value"], ys, "s--", color=COLORS.get(name_, "tab:gray"), label=f"{name_} measured")
            if crit.value is not None and min(dense) <= crit.value <= max(dense) * 1.5:
                ax.axvline(crit.value, color="gray", ls="--",
                           label=f"predicted critical point (F_block = F*): {crit.value:.1f} {b.axis}")
            elif crit.value is not None:
                ax.text(0.02, 0.02, f"predicted critical point: {crit.value:.1f} {b.axis} (off the axis)",
                        transform=ax.transAxes, color="gray", fontsize=8)
            if name == "memory.png" and df["measured_peak_bytes"].isna().all():
                ax.text(0.5, 0.95, "no GPU: peak memory not measured (predictions only)", transform=ax.transAxes,
                        ha="center", va="top", color="gray")
            _axes(ax, self.unit, ylabel)
            what = "step time" if name == "step_time.png" else "peak GPU memory"
            self.finish(fig, name, f"{spec.name} ({self.w0.width}x{self.w0.height}): {what} vs {self.unit}, "
                                   "measured (points) and predicted (lines)")

    def breakdown(self) -> None:
        """Figure 4: where the step goes, per workload and mode, layerwise's step marked."""
        b, df = self.b, self.df
        fig, ax = self.plt.subplots(figsize=(max(8, 1.2 * len(b.values) * len(b.modes)), 5))
        parts = (("compute_s", "compute", "tab:gray"), ("collective_s", "collective", "tab:purple"),
                 ("prefetch_stall_s", "prefetch stall", "tab:orange"), ("overhead_s", "runtime overhead", "tab:olive"))
        x, ticks, labels = 0.0, [], []
        seen: set[str] = set()

        def once(label: str) -> str | None:
            new = label not in seen
            seen.add(label)
            return label if new else None

        for v in b.values:
            lw = _rows(df, b.config("layerwise"))
            lw = lw[lw["value"] == v]
            xs0 = x
            for m in b.modes:
                r = _rows(df, b.config(m))
                r = r[r["value"] == v]
                if not len(r):
                    continue
                r = r.iloc[0]
                bottom = 0.0
                for col, lab, color in parts:
                    h = float(r[col]) if r[col] == r[col] else 0.0
                    ax.bar(x, h, bottom=bottom if h >= 0 else 0.0, width=0.8, color=color, label=once(lab),
                           edgecolor="white", linewidth=0.5)
                    bottom += max(h, 0.0)
                ax.plot([x], [r["predicted_step_s"]], "_", color="black", markersize=18, mew=2,
                        label=once("predicted step"))
                ticks.append(x)
                labels.append(f"{m}\n{v}")
                x += 1.0
            if len(lw):
                ax.hlines(float(lw["measured_step_s"].iloc[0]), xs0 - 0.45, x - 0.55, colors="tab:red",
                          linestyles="--", label=once("layerwise step (measured)"))
            x += 0.6
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("time per step (s)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        self.finish(fig, "breakdown.png", f"{self.spec.name}: step-time breakdown per {b.axis} and mode (chunkflow "
                                          f"C={short_bytes(b.chunk)} r={b.residency:.3g})")

    def chunk_size(self) -> None:
        """Figure 5: step time against the chunk size at one workload, chunkflow against layerwise."""
        b, df = self.b, self.df
        w = b.workload(self.spec, b.chunk_value)
        rows = df[(df["mode"] == "chunkflow") & (df["value"] == b.chunk_value)
                  & ((df["residency"] - b.residency).abs() < 1e-9)].sort_values("chunk_bytes")
        cs = sorted(b.chunk_sizes)
        fig, ax = self.plt.subplots(figsize=(8, 5))
        ax.plot([c / 1e6 for c in cs], [self.pred(w, b.config("chunkflow", c)).step_time_s for c in cs],
                "-", color=COLORS["chunkflow"], label="chunkflow predicted")
        ax.plot(rows["chunk_bytes"] / 1e6, rows["measured_step_s"], "o", color=COLORS["chunkflow"],
                label="chunkflow measured")
        for m, ls in (("layerwise", "--"), ("none", ":")):
            r = _rows(df, b.config(m))
            r = r[r["value"] == b.chunk_value]
            if len(r):
                ax.axhline(float(r["measured_step_s"].iloc[0]), color=COLORS[m], ls=ls, label=f"{m} measured")
        if self.choice.chunk_bytes:
            ax.axvline(self.choice.chunk_bytes / 1e6, color="tab:green", ls="-.",
                       label=f"planner's chunk size: {short_bytes(self.choice.chunk_bytes)}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([c / 1e6 for c in cs])
        ax.set_xticklabels([short_bytes(c) for c in cs])
        _axes(ax, "chunk size C", "step time (s)")
        self.finish(fig, "chunk_size.png", f"{self.spec.name} at {b.chunk_value} {b.axis}: step time vs chunk size "
                                           f"(residency {b.residency:.3g})")

    def residency(self) -> None:
        """Figure 6: step time and peak memory against the residency at one workload, against no offload."""
        b, df = self.b, self.df
        w = b.workload(self.spec, b.residency_value)
        rs = [i / 50 for i in range(0, 51) if i / 50 <= max(0.6, max(b.residencies)) + 1e-9]
        pts = [self.pred(w, b.config("chunkflow", residency=r)) for r in rs]
        none_p = self.pred(w, b.config("none"))
        cf = df[(df["mode"] == "chunkflow") & (df["value"] == b.residency_value)
                & (df["chunk_bytes"] == b.chunk)].sort_values("residency")
        nm = _rows(df, b.config("none"))
        nm = nm[nm["value"] == b.residency_value]
        fig, (a1, a2) = self.plt.subplots(1, 2, figsize=(11, 4.5))
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
            if self.choice.residency is not None:
                ax.axvline(self.choice.residency, color="tab:green", ls="-.",
                           label=f"planner's residency for <= 1.05x none: {self.choice.residency:.2f}")
            _axes(ax, "residency r (fraction of each block kept on the GPU)", ylabel)
        self.finish(fig, "residency.png", f"{self.spec.name} at {b.residency_value} {b.axis}: memory-latency "
                                          f"trade-off over residency (chunk {short_bytes(b.chunk)})")

    def accuracy(self) -> None:
        """Predicted against measured step time and peak memory, every point."""
        fig, (a1, a2) = self.plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, mcol, pcol, scale, what in ((a1, "measured_step_s", "predicted_step_s", 1.0, "step time (s)"),
                                            (a2, "measured_peak_bytes", "predicted_peak_bytes", 1e-9,
                                             "peak GPU memory (GB)")):
            d = self.df[self.df[mcol].notna()]
            for m in self.b.modes:
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
            _axes(ax, f"predicted {what}", f"measured {what}")
        self.finish(fig, "accuracy.png", f"{self.spec.name}: planner accuracy, every measured point")

    def roofline(self) -> None:
        """Figure 7: roofline of streamed blocks, I_block of each workload against I*."""
        b, hw, spec = self.b, self.hw, self.spec
        P, BW = hw.peak_tflops * TFLOP, hw.h2d_gbps * GB
        a0 = analyse(spec, self.w0, hw, self.sp)
        eta = hw.for_model(spec).eta_comp_at(a0.F_star)
        i_vals = [analyse(spec, b.workload(spec, v), hw, self.sp).I_block for v in b.values]
        lo, hi = min(i_vals + [a0.I_star]) / 10, max(i_vals + [a0.I_star]) * 10
        grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
        fig, ax = self.plt.subplots(figsize=(8, 5))
        ax.plot(grid, [min(eta * P, hw.eta_pref * BW * i) / TFLOP for i in grid], "-", color="black", label="roofline")
        ax.axvline(a0.I_star, color="gray", ls="--", label=f"I* = {a0.I_star:.0f} FLOP/B")
        for v, i in zip(b.values, i_vals):
            y = min(eta * P, hw.eta_pref * BW * i) / TFLOP
            ax.plot([i], [y], "s", color="tab:green")
            ax.annotate(f"{v} {b.axis}", (i, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
        off = self.df[self.df["mode"] != "none"]
        if len(off):
            ax.plot(off["i_block"], off["f_block"] * spec.n_blocks / off["measured_step_s"] / TFLOP, "x",
                    color="tab:red", label="measured with offload: block FLOPs per GPU / step time")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _axes(ax, "operational intensity I = F_block / B_pref (FLOP per prefetched byte, per GPU)",
              "attainable throughput per GPU (TFLOP/s)")
        ax.grid(alpha=0.3, which="both")
        self.finish(fig, "roofline.png", f"{spec.name}: roofline of streamed blocks (I_block of each workload vs I*)")


def _axes(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
