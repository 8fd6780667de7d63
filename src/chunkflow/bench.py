"""`chunkflow bench`: sweep workload, mode, residency and chunk size; write CSV and plots of measured vs predicted.

The model is built once (random bf16 weights); each configuration offloads it, runs every workload with the
same denoising loop as `chunkflow run` and removes the offload again. Predictions come from the planner for the
same hardware profile. Plots (matplotlib, the `plots` extra):
  step_time.png   step time vs workload: measured points, predicted curves per mode, the critical point (F*)
  memory.png      peak GPU memory vs workload, measured and predicted
  residency.png   memory-latency trade-off over residency at the largest workload (paper figure 6)
  roofline.png    attainable FLOP/s vs operational intensity I, I_block of each workload against I* (figure 7)
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.workload import make_workload, tokens

COLUMNS = [
    "model", "axis", "value", "frames", "batch", "height", "width", "tokens", "mode", "chunk_bytes", "residency",
    "achieved_residency", "measured_step_s", "predicted_step_s", "err_step", "measured_peak_bytes",
    "predicted_peak_bytes", "err_peak", "peak_reserved_bytes", "pinned_bytes", "f_block", "f_star", "i_block",
    "i_star", "regime", "critical", "hardware", "device",
]


class BenchError(ValueError):
    """A sweep that cannot run; the message says why."""


@dataclass(frozen=True)
class Config:
    mode: str
    chunk_bytes: int | None = None
    residency: float = 0.0

    @property
    def label(self) -> str:
        if self.mode != "chunkflow":
            return self.mode
        from chunkflow_planner.units import format_bytes

        return f"chunkflow C={format_bytes(self.chunk_bytes or 0).replace(' ', '').replace('.00', '')} r={self.residency:g}"


def configs(modes: list[str], chunk_sizes: list[int], residencies: list[float]) -> list[Config]:
    out = []
    for m in modes:
        if m == "chunkflow":
            out += [Config("chunkflow", c, r) for c in chunk_sizes for r in residencies]
        else:
            out.append(Config(m))
    return out


def workloads(spec: ModelSpec, axis: str, values: list[int], height: int | None, width: int | None,
              steps: int) -> list[Workload]:
    kw = dict(height=height, width=width, steps=max(1, steps), cfg_passes=1)
    return [make_workload(spec, frames=v, **kw) if axis == "frames" else make_workload(spec, batch=v, **kw)
            for v in values]


def run_bench(spec: ModelSpec, hw: HardwareSpec, axis: str, values: list[int], cfgs: list[Config], *,
              height: int | None = None, width: int | None = None, device=None, warmup: int = 1, steps: int = 2,
              progress: Callable[[], None] = lambda: None, log: Callable[[str], None] = lambda s: None):
    """Measure and predict every (config, workload) point; a pandas DataFrame with COLUMNS."""
    import pandas as pd
    import torch

    import chunkflow
    from chunkflow.models.build import build_transformer
    from chunkflow.models.inputs import make_inputs
    from chunkflow.run import denoise, predict
    from chunkflow_planner.overlap import analyse

    ws = workloads(spec, axis, values, height, width, steps)
    dtype = torch.bfloat16
    model, h0 = build_transformer(spec, weights=None, dtype=dtype, device=device, mode="none")
    h0.remove()  # block weights on the host, non-block on the device: each config offloads from here
    rows = []
    for cfg in cfgs:
        handle = chunkflow.offload(model, mode=cfg.mode, chunk_size=cfg.chunk_bytes or "16MB",
                                   residency=cfg.residency if cfg.mode == "chunkflow" else (1.0 if cfg.mode == "none" else 0.0),
                                   device=device)
        try:
            for v, w in zip(values, ws):
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                inputs = make_inputs(spec, w, dtype, device, seed=0)
                timing = denoise(model, spec, w, inputs, device, warmup, steps)
                del inputs
                stats = handle.stats().as_dict()
                res = cfg.residency if cfg.mode == "chunkflow" else (1.0 if cfg.mode == "none" else 0.0)
                p = predict(spec, w, hw, cfg.mode, cfg.chunk_bytes, res)
                a = analyse(spec, w, hw)
                med = statistics.median(timing.times)
                rows.append(dict(
                    model=spec.name, axis=axis, value=v, frames=w.frames, batch=w.batch, height=w.height, width=w.width,
                    tokens=tokens(spec, w), mode=cfg.mode, chunk_bytes=cfg.chunk_bytes, residency=res,
                    achieved_residency=stats["achieved_residency"], measured_step_s=med,
                    predicted_step_s=p.step_time_s, err_step=(med - p.step_time_s) / p.step_time_s,
                    measured_peak_bytes=timing.peak_allocated, predicted_peak_bytes=p.peak_memory_bytes,
                    err_peak=((timing.peak_allocated - p.peak_memory_bytes) / p.peak_memory_bytes
                              if timing.peak_allocated is not None else None),
                    peak_reserved_bytes=timing.peak_reserved, pinned_bytes=stats["pinned_bytes"],
                    f_block=a.F_block, f_star=a.F_star, i_block=a.I_block, i_star=a.I_star, regime=a.regime,
                    critical=a.critical.value, hardware=hw.name, device=str(device),
                ))
                log(f"{cfg.label:>28} {axis} {v}: {med:.4f} s measured, {p.step_time_s:.4f} s predicted")
                progress()
        finally:
            handle.remove()
    del model
    return pd.DataFrame(rows, columns=COLUMNS)


# ------------------------------------------------------------------------------------------------ plots


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'chunkflow[plots]' (the CSV was written)") from None
    return plt


def _dense_axis(spec: ModelSpec, axis: str, values: list[int]) -> list[int]:
    lo, hi = min(values), max(values)
    if axis == "frames":
        t = spec.vae_temporal or 1
        return list(range(lo, hi + 1, t))
    return list(range(lo, hi + 1))


def plot_all(df, spec: ModelSpec, hw: HardwareSpec, axis: str, values: list[int], cfgs: list[Config], out: Path,
             subtitle: str, height: int | None = None, width: int | None = None) -> list[Path]:
    """The four PNGs; returns their paths."""
    from chunkflow.run import predict
    from chunkflow_planner.overlap import GB, TFLOP, analyse

    plt = _plt()
    dense = _dense_axis(spec, axis, values)
    ws = workloads(spec, axis, dense, height, width, 1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    unit = "frames" if axis == "frames" else "batch size"
    shape = f"{ws[0].width}x{ws[0].height}"
    crit = analyse(spec, ws[0], hw).critical
    paths = []

    def finish(fig, name, title):
        fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    def res_of(c):
        return c.residency if c.mode == "chunkflow" else (1.0 if c.mode == "none" else 0.0)

    # (a) step time and (b) peak memory against the workload
    for name, col, pcol, scale, ylabel, title in (
        ("step_time.png", "measured_step_s", "step_time_s", 1.0, "step time per denoising step (s)",
         f"{spec.name} ({shape}): step time vs {unit}, measured (points) and predicted (lines)"),
        ("memory.png", "measured_peak_bytes", "peak_memory_bytes", 1e-9, "peak GPU memory allocated (GB)",
         f"{spec.name} ({shape}): peak GPU memory vs {unit}, measured (points) and predicted (lines)"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, c in enumerate(cfgs):
            pred = [getattr(predict(spec, w, hw, c.mode, c.chunk_bytes, res_of(c)), pcol) * scale for w in ws]
            ax.plot(dense, pred, "-", color=colors[i % len(colors)], label=f"{c.label} predicted")
            sub = df[(df["mode"] == c.mode) & (df["residency"] == res_of(c))]
            if c.mode == "chunkflow":
                sub = sub[sub["chunk_bytes"] == c.chunk_bytes]
            ys = sub[col].astype(float) * scale
            if ys.notna().any():
                ax.plot(sub["value"], ys, "o", color=colors[i % len(colors)], label=f"{c.label} measured")
        if crit.value is not None and name == "step_time.png":
            ax.axvline(crit.value, color="gray", ls="--", label=f"critical point (F_block = F*): {crit.value:.1f} {axis}")
        ax.set_xlabel(f"{unit}" + (" (video frames)" if axis == "frames" else " (images per step)"))
        ax.set_ylabel(ylabel)
        if name == "memory.png" and df["measured_peak_bytes"].isna().all():
            ax.text(0.5, 0.95, "no GPU: peak memory not measured (predictions only)", transform=ax.transAxes,
                    ha="center", va="top", color="gray")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        finish(fig, name, title)

    # (c) memory-latency over residency at the largest workload, first chunk size (paper figure 6)
    w_big = ws[-1]
    chunk = next((c.chunk_bytes for c in cfgs if c.mode == "chunkflow"), 16 * 10**6)
    rs = [i / 50 for i in range(51)]
    pts = [predict(spec, w_big, hw, "chunkflow", chunk, r) for r in rs]
    none_p = predict(spec, w_big, hw, "none", None, 1.0)
    big = df[df["value"] == values[-1]] if len(df) else df
    none_m = big[big["mode"] == "none"]
    cf = big[(big["mode"] == "chunkflow") & (big["chunk_bytes"] == chunk)]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    a1.plot(rs, [p.step_time_s for p in pts], "-", label="chunkflow predicted")
    a1.plot(cf["achieved_residency"], cf["measured_step_s"], "o", label="chunkflow measured")
    a1.axhline(none_p.step_time_s, color="gray", ls="--", label="no offload, predicted")
    if len(none_m):
        a1.axhline(float(none_m["measured_step_s"].iloc[0]), color="black", ls=":", label="no offload, measured")
    a1.set_xlabel("residency r (fraction of each block kept on the GPU)")
    a1.set_ylabel("step time (s)")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.plot(rs, [p.peak_memory_bytes / 1e9 for p in pts], "-", label="chunkflow predicted")
    if cf["measured_peak_bytes"].notna().any():
        a2.plot(cf["achieved_residency"], cf["measured_peak_bytes"].astype(float) / 1e9, "o", label="chunkflow measured")
    a2.axhline(none_p.peak_memory_bytes / 1e9, color="gray", ls="--", label="no offload, predicted")
    if len(none_m) and none_m["measured_peak_bytes"].notna().any():
        a2.axhline(float(none_m["measured_peak_bytes"].iloc[0]) / 1e9, color="black", ls=":", label="no offload, measured")
    a2.set_xlabel("residency r (fraction of each block kept on the GPU)")
    a2.set_ylabel("peak GPU memory allocated (GB)")
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    from chunkflow_planner.units import format_bytes

    finish(fig, "residency.png", f"{spec.name} at {values[-1]} {axis}: memory-latency trade-off over residency "
                                 f"(chunk {format_bytes(chunk)})")

    # (d) roofline: attainable FLOP/s against FLOP per prefetched byte (paper figure 7)
    P, BW = hw.peak_tflops * TFLOP, hw.h2d_gbps * GB
    a0 = analyse(spec, ws[0], hw)
    eta = hw.for_model(spec.name).eta_comp_at(a0.F_star)
    i_vals = [analyse(spec, w, hw).I_block for w in workloads(spec, axis, values, height, width, 1)]
    lo, hi = min(i_vals + [a0.I_star]) / 10, max(i_vals + [a0.I_star]) * 10
    grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(grid, [min(eta * P, hw.eta_pref * BW * i) / TFLOP for i in grid], "-", color="black", label="roofline")
    ax.plot(grid, [eta * P / TFLOP] * len(grid), ":", color="tab:blue", label=f"compute roof eta_comp*P_peak ({eta:.2f} x {hw.peak_tflops:g} TFLOP/s)")
    ax.plot(grid, [hw.eta_pref * BW * i / TFLOP for i in grid], ":", color="tab:orange",
            label=f"H2D roof eta_pref*BW_h2d*I ({hw.eta_pref:.2f} x {hw.h2d_gbps:.1f} GB/s)")
    ax.axvline(a0.I_star, color="gray", ls="--", label=f"I* = {a0.I_star:.0f} FLOP/B")
    for v, i in zip(values, i_vals):
        ax.plot([i], [min(eta * P, hw.eta_pref * BW * i) / TFLOP], "s", color="tab:green")
        ax.annotate(f"{v} {axis}", (i, min(eta * P, hw.eta_pref * BW * i) / TFLOP), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    off = df[df["mode"] != "none"]
    if len(off):
        f_step = off["f_block"] * spec.n_blocks
        ax.plot(off["i_block"], f_step / off["measured_step_s"] / TFLOP, "x", color="tab:red",
                label="measured with offload: block FLOPs / step time")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity I = F_block / B_pref (FLOP per prefetched byte)")
    ax.set_ylabel("attainable throughput (TFLOP/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    finish(fig, "roofline.png", f"{spec.name}: roofline of streamed blocks (I_block of each workload vs I*)")
    return paths


def subtitle(device, hw: HardwareSpec) -> str:
    import torch

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no GPU; times are not a GPU's)"
    return f"{gpu}, {datetime.date.today().isoformat()}; predictions for hardware profile '{hw.name}'"
