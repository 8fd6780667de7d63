"""calibrate's fits: pure functions (no torch) from measured times to the profile's factors, tested on synthetic
measurements: the H2D line t0 + C / BW, eta curves, collective bandwidth and contention, whole-forward scales, VAE
decode fits."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from chunkflow.commands.calibrate.host import CalibrationError
from chunkflow.commands.calibrate.robust import NOISE, relative_residuals, robust_linear
from chunkflow_planner.bands import spread as spread_beyond_fit  # a sample's spread beyond the parameters fitted
from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.predict import predict


@dataclass(frozen=True)
class H2DFit:
    t0_s: float  # per-copy start-up
    bw_Bps: float  # asymptotic bytes per second
    residuals: tuple[float, ...] = ()  # each sample's measured / fitted - 1, in the order given

    def time(self, C: float) -> float:
        return self.t0_s + C / self.bw_Bps

    @property
    def fitted(self) -> int:
        """Parameters fitted (fit_quality's `fitted`): t0 and BW, or BW alone where t0 is 0 (pure bandwidth)."""
        return 2 if self.t0_s > 0 else 1

    def efficiency(self, C: float) -> float:
        """Realised / asymptotic bandwidth of one C-byte copy."""
        return (C / self.time(C)) / self.bw_Bps


def fit_h2d(sizes: Sequence[float], times: Sequence[float]) -> H2DFit:
    """Per-copy times t(C) = t0 + C / BW fitted in relative error, (t0 + C / BW) / t - 1, with a robust loss
    (robust_linear: scipy's soft_l1 at f_scale NOISE), t0 >= 0 and BW > 0; `sizes` may repeat (every repeat of a
    size one sample).

    Plain least squares would let the largest copies decide everything and leave t0 to noise; relative error weighs
    every size alike. Least squares in relative error (what this fit was before scipy) let one copy 3x slower move
    t0 by half and BW by percents; the robust loss does not. The start is the old closed form (the 2x2 normal
    equations; a negative t0 refit as pure bandwidth). The fit keeps each sample's measured / fitted - 1.

    Copies whose times do not grow with their size (a CPU's memcpy of small chunks, a busy machine) leave the bounded
    solver a slope at or near 0, a bandwidth beyond any link: where the slope's share of the largest copy is below
    the noise (1/BW x max size < NOISE x the shortest time) or BW falls outside catalog.H2D_GBPS_RANGE, the fit is
    the pure bandwidth of the closed form (t0 = 0, least squares in relative error through the origin), whose
    residuals then say how badly it fits. A size or time that is not a finite number is refused first."""
    from chunkflow_planner.catalog import H2D_GBPS_RANGE

    if len(sizes) != len(times) or len(sizes) < 2:
        raise CalibrationError("fit_h2d needs at least two (size, time) pairs of equal length")
    for i, (c, t) in enumerate(zip(sizes, times)):
        if not (math.isfinite(c) and math.isfinite(t)):
            raise CalibrationError(f"H2D copy {i} has size {c} B and time {t} s, not finite numbers: a copy was not "
                                   "timed (nothing was fitted); run calibrate again")
    if any(t <= 0 for t in times) or any(c <= 0 for c in sizes):
        raise CalibrationError("fit_h2d needs positive sizes and times")
    if len(set(sizes)) < 2:
        raise CalibrationError("fit_h2d needs at least two different sizes")
    start = _h2d_least_squares(sizes, times)
    t0, a = robust_linear([[1.0, float(c)] for c in sizes], times, x0=[max(start[0], 1e-3 * min(times)), start[1]],
                          lower=[0.0, 0.0])
    in_range = a > 0 and H2D_GBPS_RANGE[0] <= 1.0 / a / 1e9 <= H2D_GBPS_RANGE[1]
    if not in_range or a * max(sizes) < NOISE * min(times):  # no size effect above the noise: no bandwidth to fit
        t0, a = 0.0, _pure_bandwidth(sizes, times)
        gbps = 1.0 / a / 1e9
        if not H2D_GBPS_RANGE[0] <= gbps <= H2D_GBPS_RANGE[1]:
            raise CalibrationError(f"the H2D copies ({min(sizes):.3g}-{max(sizes):.3g} B in {min(times):.3g}-"
                                   f"{max(times):.3g} s) give {gbps:.3g} GB/s, outside the {H2D_GBPS_RANGE[0]:g}-"
                                   f"{H2D_GBPS_RANGE[1]:g} GB/s a host link can have; run calibrate again")
    fit = H2DFit(t0, 1.0 / a)
    return H2DFit(t0, 1.0 / a, tuple(relative_residuals(times, [fit.time(c) for c in sizes])))


def _pure_bandwidth(sizes: Sequence[float], times: Sequence[float]) -> float:
    """1 / BW of t = C / BW minimising sum ((C a - t) / t)^2: sum (C / t) / sum (C / t)^2."""
    return sum(c / t for c, t in zip(sizes, times)) / sum((c / t) ** 2 for c, t in zip(sizes, times))


def _h2d_least_squares(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(t0, 1 / BW) minimising sum ((t0 + C a - t) / t)^2: the 2x2 normal equations; t0 < 0 refit as a = C / t."""
    w = [1.0 / t for t in times]
    s11 = sum(wi * wi for wi in w)
    s12 = sum(wi * wi * c for wi, c in zip(w, sizes))
    s22 = sum(wi * wi * c * c for wi, c in zip(w, sizes))
    b1 = sum(wi * wi * t for wi, t in zip(w, times))
    b2 = sum(wi * wi * c * t for wi, c, t in zip(w, sizes, times))
    det = s11 * s22 - s12 * s12
    t0 = (b1 * s22 - b2 * s12) / det
    a = (s11 * b2 - s12 * b1) / det
    if t0 < 0 or a <= 0:
        return 0.0, _pure_bandwidth(sizes, times)
    return t0, a


def fit_quality(name: str, residuals: Sequence[float], source: str, samples: int | None = None, fitted: int = 0,
                misfits: Sequence[float] = (), misfits_fitted: int = 0):
    """The FitQuality of fit `name` (chunkflow_planner.bands.FITS) from its relative residuals (measured / fitted
    - 1, one a sample) and the number of parameters fitted to them (`fitted`: 1 per group of repeats taken about
    their median, the coefficients of each fit pooled); None with fewer than two residuals or no more than `fitted`
    (nothing is left over the fit to say its spread: the planner keeps the fit's prior). spread = bands.spread over them and `fitted`;
    flagged when wider than bands.FLAG_SPREAD, with what to measure again. At most bands.MAX_RESIDUALS are kept:
    where there are more, evenly spaced order statistics of them sorted (the smallest and the largest always among
    them), so the kept ones keep the distribution's shape; otherwise all, in sample order.

    `misfits`: residuals of another kind, few and not repeats (each whole forward about the curve scaled to them,
    `misfits_fitted` the scales fitted): the fit's own error, which the repeats' jitter does not show. They are kept
    with the residuals; where there are more than misfits_fitted, their root mean square over n - misfits_fitted
    (too few for a median) adds to the spread in quadrature (independent errors)."""
    from chunkflow_planner.bands import FITS, FLAG_SPREAD, MAX_RESIDUALS
    from chunkflow_planner.catalog import FitQuality

    rs = [float(r) for r in residuals if math.isfinite(r)]
    if len(rs) < 2 or len(rs) <= fitted:
        return None
    s = spread_beyond_fit(rs, fitted)
    ms = [float(m) for m in misfits if math.isfinite(m)]
    if len(ms) > misfits_fitted:
        s = math.hypot(s, math.sqrt(sum(m * m for m in ms) / (len(ms) - misfits_fitted)))
    rs += ms
    kept = rs
    if len(rs) > MAX_RESIDUALS:
        xs = sorted(rs)
        kept = [xs[round(i * (len(xs) - 1) / (MAX_RESIDUALS - 1))] for i in range(MAX_RESIDUALS)]
    flagged = s > FLAG_SPREAD
    return FitQuality(samples=max(samples or 0, len(rs)), spread=min(s, 10.0), residuals=[round(r, 6) for r in kept],
                      flagged=flagged, repeat=FITS[name].repeat if flagged else "", source=source)


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


FORWARD_SCALE_RANGE = (0.7, 1.1)  # whole-forward scales calibrate applies (measured on an H200: 0.949-0.991)


def _forward_workload(spec: ModelSpec, r: dict) -> Workload:
    """The workload of a whole-forward row (measure.measure_forward): one step, one guidance pass."""
    return Workload(batch=r["batch"], frames=r["frames"], height=spec.default_workload.height,
                    width=spec.default_workload.width, steps=1, cfg_passes=1)


def forward_scale(spec: ModelSpec, hw: HardwareSpec, rows: Sequence[dict]) -> float:
    """Predicted / measured compute of whole forwards (geometric mean): the factor the model's curve is scaled by."""
    from chunkflow_planner.offload import OffloadConfig

    ks = [compute_ratio(spec, _forward_workload(spec, r), hw, OffloadConfig(mode="none"), r["time_s"]) for r in rows]
    ks = [k for k in ks if k is not None]
    return gmean(ks) if ks else 1.0


def forward_misfits(spec: ModelSpec, hw: HardwareSpec, rows: Sequence[dict]) -> list[float | None]:
    """Each whole forward's measured time / the planner's prediction of it on `hw` (no offload) - 1, in row order;
    None where it predicts no time."""
    from chunkflow_planner.offload import OffloadConfig

    out: list[float | None] = []
    for r in rows:
        t = predict(spec, _forward_workload(spec, r), hw, OffloadConfig(mode="none")).step_time_s
        out.append(r["time_s"] / t - 1.0 if t > 0 else None)
    return out


def scale_to_forwards(spec: ModelSpec, hw: HardwareSpec, rows: Sequence[dict]
                      ) -> tuple[list[tuple[float, float]] | None, list[dict]]:
    """`spec`'s curve on `hw` (hw.eta_comp_curves) scaled to its whole forwards `rows` by forward_scale, where that
    scale is within FORWARD_SCALE_RANGE (else None: the curve stays as the blocks measured it); and the rows, each
    with its `scale`, whether it was `applied`, and its `misfit` (forward_misfits with the curve as it is left:
    what the scaled curve still misses of each whole forward, the `compute` fit's error beyond the timing jitter)."""
    k = forward_scale(spec, hw, rows)
    used = FORWARD_SCALE_RANGE[0] <= k <= FORWARD_SCALE_RANGE[1]
    curve = scaled_curve(hw.eta_comp_curves[spec.name], k) if used else None
    on = hw.model_copy(update={"eta_comp_curves": {**hw.eta_comp_curves, spec.name: curve}}) if used else hw
    return curve, [dict(r, scale=k, applied=used, misfit=m) for r, m in zip(rows, forward_misfits(spec, on, rows))]


def fit_vae_rows(spec: ModelSpec, plain: list[dict], tiled: list[dict], source: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The VaeDecodeFit (as a dict) of `spec`'s VAE from its measured decodes: untiled per voxel, tiled per decoder
    call where the catalog knows the VAE's tiling (each tiled row gains its `decoder_calls`), the tiled fit alone
    for both where there are no untiled decodes (a VAE that decodes only tiled); and the residuals of
    both fits ({vae_time, vae_memory}: ops.vae_residuals) with, under `fitted`, the coefficients fitted to them
    (ops.vae_coefficients of each fit that gave residuals: fit_quality's `fitted`)."""
    from chunkflow.commands.calibrate.ops import fit_vae, vae_coefficients, vae_residuals
    from chunkflow_planner.pipeline import decode_calls

    out: dict[str, Any] = {"vae_time": [], "vae_memory": [], "fitted": {"vae_time": 0, "vae_memory": 0}}

    def pool(rows, fit, calls=None):
        for name, res, n in zip(("vae_time", "vae_memory"), vae_residuals(rows, fit, calls), vae_coefficients(fit)):
            if res:
                out[name] += res
                out["fitted"][name] += n

    if not plain:  # a class that decodes only tiled (VaeSpec.tiled_only): its tiled fit prices both
        fit = fit_vae(tiled, spec.is_video, source + " (tiled)")
        pool(tiled, fit)
        return {**fit, "tiled": dict(fit)}, out
    fit = fit_vae(plain, spec.is_video, source)
    pool(plain, fit)
    if tiled:
        calls = None
        if spec.pipeline.vae.tiling is not None:
            calls = lambda r: decode_calls(spec, Workload(  # noqa: E731
                batch=r["batch"], frames=r["frames"], height=r["height"], width=r["width"], steps=1))
            for r in tiled:
                r["decoder_calls"] = calls(r)
        fit["tiled"] = fit_vae(tiled, False, source + " (tiled)", calls)
        pool(tiled, fit["tiled"], calls)
    return fit, out

def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))
