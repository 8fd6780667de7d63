"""The prefetch-compute overlap model (paper section 3.1 and Appendix A): T_comp, T_pref, F_star, I_star.

A block's prefetch hides behind the previous block's compute when F_block >= F_star. Below it, part
of every block's transfer is exposed. `critical_point` finds the frame count (video) or batch (image)
where the per-GPU F_block crosses F_star, by root finding on the continuous workload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass
from typing import Literal

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.codec import encoded_bytes
from chunkflow_planner.flops import F_block_per_gpu
from chunkflow_planner.workload import latent_frames, nearest_valid_frames, tokens_per_latent_frame

GB = 1e9
TFLOP = 1e12


if TYPE_CHECKING:  # pragma: no cover
    from chunkflow_planner.offload import OffloadConfig


def brent(f, a: float, b: float, xtol: float = 1e-12, rtol: float = 1e-12, maxiter: int = 200) -> float:
    """A root of f in [a, b], f(a) and f(b) of opposite signs: Brent's method (inverse quadratic interpolation,
    secant, bisection), as scipy.optimize.brentq does it; pure Python, so the planner starts fast."""
    fa, fb = f(a), f(b)
    if fa == 0:
        return a
    if fb == 0:
        return b
    if (fa > 0) == (fb > 0):
        raise ValueError("brent: f(a) and f(b) must have opposite signs")
    c, fc = a, fa
    d = e = b - a
    for _ in range(maxiter):
        if (fb > 0) == (fc > 0):
            c, fc = a, fa
            d = e = b - a
        if abs(fc) < abs(fb):
            a, b, c = b, c, b
            fa, fb, fc = fb, fc, fb
        tol = 2 * rtol * abs(b) + 0.5 * xtol
        m = 0.5 * (c - b)
        if abs(m) <= tol or fb == 0:
            return b
        if abs(e) >= tol and abs(fa) > abs(fb):
            s = fb / fa
            if a == c:  # secant
                p, q = 2 * m * s, 1 - s
            else:  # inverse quadratic interpolation
                q, r = fa / fc, fb / fc
                p = s * (2 * m * q * (q - r) - (b - a) * (r - 1))
                q = (q - 1) * (r - 1) * (s - 1)
            if p > 0:
                q = -q
            p = abs(p)
            if 2 * p < min(3 * m * q - abs(tol * q), abs(e * q)):
                e, d = d, p / q
            else:
                d = e = m
        else:
            d = e = m
        a, fa = b, fb
        b += d if abs(d) > tol else (tol if m > 0 else -tol)
        fb = f(b)
    return b


def T_comp(F_block: float, P_peak: float, eta_comp: float) -> float:
    """Eq. 1: block compute time F_block / (eta_comp * P_peak), P_peak in FLOP/s."""
    return F_block / (eta_comp * P_peak)


def T_pref(B_pref: float, BW_h2d: float, eta_pref: float) -> float:
    """Eq. 2: prefetch time B_pref / (eta_pref * BW_h2d), BW_h2d in bytes/s."""
    return B_pref / (eta_pref * BW_h2d)


def F_star(P_peak: float, eta_comp: float, B_pref: float, BW_h2d: float, eta_pref: float) -> float:
    """Eq. 4: the critical compute workload eta_comp * P_peak * B_pref / (eta_pref * BW_h2d)."""
    return eta_comp * P_peak * T_pref(B_pref, BW_h2d, eta_pref)


def T_disk(B_disk: float, BW_disk: float) -> float:
    """Eq. 2 for the third link: reading B_disk bytes of the checkpoint's files at the disk's cold rate BW_disk
    (bytes/s, measured by `chunkflow calibrate --weights` with the loader's reader threads)."""
    return B_disk / BW_disk


def I_block(F_block: float, B_pref: float) -> float:
    """Eq. 5: operational intensity of a block against its prefetch volume (FLOP per byte)."""
    return F_block / B_pref


def I_star(P_peak: float, eta_comp: float, BW_h2d: float, eta_pref: float) -> float:
    """Eq. 6: the roofline turning point eta_comp * P_peak / (eta_pref * BW_h2d) (FLOP per byte)."""
    return eta_comp * P_peak / (eta_pref * BW_h2d)


def eta_samples(spec: ModelSpec, batch: int) -> int:
    """Samples of one forward that the efficiency curve does not see as a bigger block: a video model's curve is
    measured along frames at batch 1, so a forward of `batch` videos (batched CFG included) runs the kernels of one
    video `batch` times over and has one video's efficiency; an image model's curve is measured along the batch."""
    return batch if spec.is_video else 1


def T_comp_hw(F_block: float, hw: HardwareSpec, samples: int = 1) -> float:
    """Eq. 1 with the hardware's efficiency at this block size: F / (eta_comp(F / samples) * P_peak), `samples`
    from eta_samples."""
    return T_comp(F_block, hw.peak_tflops * TFLOP, hw.eta_comp_at(F_block / samples))


def F_star_hw(hw: HardwareSpec, B_pref: float, samples: int = 1) -> float:
    """Eq. 4 on `hw`: the F_block at which T_comp(F) = T_pref(B_pref).

    With a scalar eta_comp this is the closed form; with a measured eta_comp(F) curve the efficiency depends on
    F itself, so the root of T_comp(F) - T_pref is found by Brent's method in log F (T_comp grows with F).
    """
    P, BW = hw.peak_tflops * TFLOP, hw.h2d_gbps * GB
    if not hw.eta_comp_curve:
        return F_star(P, hw.eta_comp, B_pref, BW, hw.eta_pref)
    tp = T_pref(B_pref, BW, hw.eta_pref)
    g = lambda logF: T_comp_hw(math.exp(logF), hw, samples) - tp  # noqa: E731
    lo, hi = math.log(1.0), math.log(1e30)
    if g(lo) >= 0:
        return 1.0
    if g(hi) < 0:  # only with figures at the edge of their ranges: F* beyond any block
        return math.inf
    return math.exp(brent(g, lo, hi, xtol=1e-12, rtol=1e-12))


@dataclass(frozen=True)
class CriticalPoint:
    """Where F_block per GPU crosses F_star along the workload's free axis."""

    axis: Literal["frames", "batch"]
    value: float | None
    nearest_valid: int | None
    reason: str


@dataclass(frozen=True)
class OverlapAnalysis:
    """The first-order overlap analysis of one workload (all per GPU)."""

    F_block: float
    B_pref: float
    F_star: float
    I_block: float
    I_star: float
    T_comp: float
    T_pref: float
    critical: CriticalPoint

    @property
    def regime(self) -> Literal["hidden", "exposed"]:
        return "hidden" if self.F_block >= self.F_star else "exposed"


def _block_flops_along_axis(spec: ModelSpec, w: Workload, sp: int, L: float | None, per_forward: int = 1):
    """F_block per GPU as a function of the continuous frames (video) or the user's batch (image); `per_forward`
    samples of it in one forward (batched CFG: the guidance passes)."""
    per_frame = tokens_per_latent_frame(spec, w.height, w.width)
    if spec.is_video:
        return "frames", lambda n: F_block_per_gpu(spec, w.batch * per_forward, per_frame * latent_frames(spec, n),
                                                   sp, L)
    S = per_frame * latent_frames(spec, 1)
    return "batch", lambda b: F_block_per_gpu(spec, b * per_forward, S, sp, L)


def critical_point(
    spec: ModelSpec, w: Workload, f_star: float, sp: int = 1, L: float | None = None, max_frames: int = 100_000,
    per_forward: int = 1,
) -> CriticalPoint:
    """The continuous frames or batch at which F_block per GPU equals F_star (Brent's method), and the nearest valid
    one; `per_forward`: samples per forward for each of the user's (batched CFG)."""
    axis, flops = _block_flops_along_axis(spec, w, sp, L, per_forward)
    lo = 1.0
    if flops(lo) >= f_star:
        return CriticalPoint(axis, None, 1, f"prefetch hides behind compute already at {axis} = 1")
    hi = float(max_frames) if axis == "frames" else 2.0
    if axis == "batch":
        while flops(hi) < f_star:  # F_block is linear in B: doubling always brackets the root
            hi *= 2
    elif flops(hi) < f_star:
        return CriticalPoint(
            axis, None, None,
            f"never: even at {max_frames} frames the per-GPU block compute stays below F* "
            f"(SP degree {sp} divides it); only partial residency can hide the prefetch",
        )
    x = float(brent(lambda v: flops(v) - f_star, lo, hi, xtol=1e-9, rtol=1e-12))
    if axis == "frames":
        low, high = nearest_valid_frames(spec, x)
        nearest = low if (x - low) <= (high - x) else high
    else:
        nearest = max(1, int(x + 0.5))
    return CriticalPoint(axis, x, nearest, f"F_block per GPU reaches F* at {axis} = {x:.1f}")


def analyse(
    spec: ModelSpec,
    w: Workload,
    hw: HardwareSpec,
    sp: int = 1,
    prefetch_bytes: float | None = None,
    text_len: float | None = None,
    cfg: "OffloadConfig | None" = None,
) -> OverlapAnalysis:
    """The overlap analysis of workload `w` on `hw`: per-GPU F_block, B_pref, F_star, regime, critical point.

    `cfg` brings the two levers in: batched CFG analyses one forward of cfg_passes times the batch (F_block
    doubles), fp8 storage halves B_pref (so F_star halves), a codec makes it rho B_pref (tiers.encoded_bytes). The
    cast fp8 storage and the decode a codec add on the GPU are left to the step-time model, as the other costs beyond
    eqs. 1-6 are.

    B_pref is the mean per-block parameter bytes (Appendix B) unless `prefetch_bytes` overrides it (the
    paper profiles it). With a calibrated eta_comp(F) curve, T_comp uses the efficiency at this F_block and F_star
    is the root of T_comp(F) = T_pref; the critical point then solves F_block(x) = F_star, which is the same as
    T_comp(F_block(x)) = T_pref since T_comp increases with F. Tokens are the workload's S; batch and frames enter through F_block.
    """
    hw = hw.for_model(spec)
    from chunkflow_planner.workload import tokens

    P = hw.peak_tflops * TFLOP
    BW = hw.h2d_gbps * GB
    from chunkflow_planner.workload import per_forward

    B_pref = spec.mean_block_bytes if prefetch_bytes is None else float(prefetch_bytes)
    samples = 1  # samples per forward for each of the user's
    if cfg is not None:
        samples = per_forward(w, cfg.cfg_batched)[0].batch // w.batch
        B_pref = cfg.stored_bytes(B_pref, spec.dtype_bytes)
        B_pref = encoded_bytes(B_pref, cfg.codec, hw)
    F = F_block_per_gpu(spec, w.batch * samples, tokens(spec, w), sp, text_len)
    same = eta_samples(spec, w.batch * samples)
    fs = F_star_hw(hw, B_pref, same)
    return OverlapAnalysis(
        F_block=F,
        B_pref=B_pref,
        F_star=fs,
        I_block=I_block(F, B_pref),
        I_star=I_star(P, hw.eta_comp_at(fs / same), BW, hw.eta_pref),  # = F_star / B_pref, also with a curve
        T_comp=T_comp_hw(F, hw, same),
        T_pref=T_pref(B_pref, BW, hw.eta_pref),
        critical=critical_point(spec, w, fs, sp, text_len, per_forward=samples),
    )
