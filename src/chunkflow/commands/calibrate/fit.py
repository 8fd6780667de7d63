"""calibrate's fits: pure functions (no torch) from measured times to the profile's factors, tested on synthetic
measurements: the H2D line t0 + C / BW, eta curves, collective bandwidth and contention, whole-forward scales, VAE
decode fits."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from chunkflow.commands.calibrate.host import CalibrationError
from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.predict import predict


@dataclass(frozen=True)
class H2DFit:
    t0_s: float  # per-copy start-up
    bw_Bps: float  # asymptotic bytes per second

    def time(self, C: float) -> float:
        return self.t0_s + C / self.bw_Bps

    def efficiency(self, C: float) -> float:
        """Realised / asymptotic bandwidth of one C-byte copy."""
        return (C / self.time(C)) / self.bw_Bps


def fit_h2d(sizes: Sequence[float], times: Sequence[float]) -> H2DFit:
    """Least-squares fit of per-copy times t(C) = t0 + C / BW, in relative error (weights 1 / t).

    Plain least squares would let the largest copies decide everything and leave t0 to noise; dividing each
    equation by its t weighs every size alike. t0 is clamped at 0 (refit as pure bandwidth if negative).
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise CalibrationError("fit_h2d needs at least two (size, time) pairs of equal length")
    if any(t <= 0 for t in times) or any(c <= 0 for c in sizes):
        raise CalibrationError("fit_h2d needs positive sizes and times")
    # minimise sum ((t0 + C a - t) / t)^2 over (t0, a): the 2x2 normal equations
    w = [1.0 / t for t in times]
    s11 = sum(wi * wi for wi in w)
    s12 = sum(wi * wi * c for wi, c in zip(w, sizes))
    s22 = sum(wi * wi * c * c for wi, c in zip(w, sizes))
    b1 = sum(wi * wi * t for wi, t in zip(w, times))
    b2 = sum(wi * wi * c * t for wi, c, t in zip(w, sizes, times))
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise CalibrationError("fit_h2d needs at least two different sizes")
    t0 = (b1 * s22 - b2 * s12) / det
    a = (s11 * b2 - s12 * b1) / det
    if t0 < 0 or a <= 0:
        t0 = 0.0
        a = b2 / s22
    return H2DFit(t0, 1.0 / a)


def eta_curve(flops: Sequence[float], times: Sequence[float], peak_flops: float) -> list[tuple[float, float]]:
    """[F, eta] pairs sorted by F, eta = F / (P_peak t), clamped to (0, 1]; equal F values are merged (median)."""
    if len(flops) != len(times) or not flops:
        raise CalibrationError("eta_curve needs matching, non-empty FLOP and time lists")
    by_f: dict[float, list[float]] = {}
    for F, t in zip(flops, times):
        if F <= 0 or t <= 0:
            raise CalibrationError("eta_curve needs positive FLOPs and times")
        by_f.setdefault(float(F), []).append(min(1.0, F / (peak_flops * t)))
    return [(F, statistics.median(e)) for F, e in sorted(by_f.items())]


def summary_eta(curve: Sequence[tuple[float, float]]) -> float:
    """The scalar eta_comp kept next to the curve: its median."""
    return float(statistics.median(e for _, e in curve))


def coll_bandwidth_gbps(local_bytes: float, seconds: float) -> float:
    """Per-GPU all-to-all GB/s as steptime.t_all_to_all uses it: the local tensor's bytes over the time."""
    return local_bytes / seconds / 1e9


def contention_factor(t_busy: float, t_idle: float) -> float:
    """How many times slower a collective runs while H2D is in flight (at least 1)."""
    return max(1.0, t_busy / t_idle)


def compute_ratio(spec: ModelSpec, w: Workload, hw: HardwareSpec, cfg, measured_step_s: float,
                  sp: int = 1) -> float | None:
    """Predicted / measured compute of a step measured at `measured_step_s` (the measured step less the predicted
    non-compute part); None where that leaves no compute: the factor an efficiency curve is scaled by."""
    p = predict(spec, w, hw, cfg, sp)
    comp = measured_step_s - (p.step_time_s - p.compute_s)
    return p.compute_s / comp if comp > 0 else None


def scaled_curve(curve: Sequence[tuple[float, float]], k: float) -> list[tuple[float, float]]:
    """An eta_comp(F) curve with every efficiency times k (at most 1)."""
    return [(f, min(1.0, e * k)) for f, e in curve]


def forward_scale(spec: ModelSpec, hw: HardwareSpec, rows: Sequence[dict]) -> float:
    """Predicted / measured compute of whole forwards (geometric mean): the factor the model's curve is scaled by."""
    from chunkflow_planner.offload import OffloadConfig

    ks = [compute_ratio(spec, Workload(batch=r["batch"], frames=r["frames"], height=spec.default_workload.height,
                                       width=spec.default_workload.width, steps=1, cfg_passes=1),
                        hw, OffloadConfig(mode="none"), r["time_s"]) for r in rows]
    ks = [k for k in ks if k is not None]
    return gmean(ks) if ks else 1.0


def fit_vae_rows(spec: ModelSpec, plain: list[dict], tiled: list[dict], source: str) -> dict[str, Any]:
    """The VaeDecodeFit (as a dict) of `spec`'s VAE from its measured decodes: untiled per voxel, tiled per decoder
    call where the catalog knows the VAE's tiling (each tiled row gains its `decoder_calls`)."""
    from chunkflow.commands.calibrate.ops import fit_vae
    from chunkflow_planner.pipeline import decode_calls

    fit = fit_vae(plain, spec.is_video, source)
    if tiled:
        calls = None
        if spec.pipeline.vae.tiling is not None:
            calls = lambda r: decode_calls(spec, Workload(  # noqa: E731
                batch=r["batch"], frames=r["frames"], height=r["height"], width=r["width"], steps=1))
            for r in tiled:
                r["decoder_calls"] = calls(r)
        fit["tiled"] = fit_vae(tiled, False, source + " (tiled)", calls)
    return fit

def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))
