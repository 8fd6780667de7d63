"""calibrate's robust fitting, pure functions on plain numbers (scipy, no torch): a linear model fitted in relative
error with a robust loss, residuals as measured / fitted - 1, and a repeated measurement's residuals about its median.
Everything that fits a measurement imports these from here (fit.py, ops.py)."""

from __future__ import annotations

import statistics
from typing import Sequence

NOISE = 0.02  # the relative noise a timing is expected to carry: the robust fits' f_scale (beyond it a sample's
# pull stops growing with its distance, so a stray slow sample does not move a constant)


def robust_linear(A: Sequence[Sequence[float]], y: Sequence[float], x0: Sequence[float] | None = None,
                  lower: Sequence[float] | None = None, offset: Sequence[float] | None = None) -> list[float]:
    """Coefficients c of y ~ b + A c (`offset` b, default 0) fitted in relative error, (b + A c) / y - 1, with
    scipy's robust soft_l1 loss at
    f_scale NOISE: samples within the noise count as in least squares, a stray one (a copy 3x slower) pulls no
    harder than one at a few times the noise. `lower`: bounds on c (default none); `x0` the start (default: plain
    least squares in relative error, clipped into the bounds). Every y must be positive."""
    import numpy as np
    from scipy.optimize import least_squares

    A = np.asarray(A, dtype=float)
    y = np.asarray(y, dtype=float)
    W = A / y[:, None]  # relative: each row divided by its own measurement
    one = np.ones(len(y)) - (0.0 if offset is None else np.asarray(offset, dtype=float) / y)  # A c / y aims here
    lo = np.full(A.shape[1], -np.inf) if lower is None else np.asarray(lower, dtype=float)
    if x0 is None:
        x0 = np.linalg.lstsq(W, one, rcond=None)[0]
    x0 = np.maximum(np.asarray(x0, dtype=float), lo)
    # fitted in units of the start (each coefficient near 1; one at 0 in units that move the fit by about 1): the
    # solver's steps and tolerances then see one scale, where the raw coefficients span 20 orders of magnitude
    col = np.abs(W).max(axis=0)
    scale = np.where(x0 != 0, np.abs(x0), 1.0 / np.where(col > 0, col, 1.0))
    res = least_squares(lambda u: W @ (u * scale) - one, x0 / scale, bounds=(lo / scale, np.inf), loss="soft_l1",
                        f_scale=NOISE, xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=2000)
    return [float(c) for c in res.x * scale]


def relative_residuals(measured: Sequence[float], fitted: Sequence[float]) -> list[float]:
    """measured / fitted - 1 per sample (0 where both are 0; a sample fitted at 0 but measured above is left out)."""
    out = []
    for m, f in zip(measured, fitted):
        if f > 0:
            out.append(m / f - 1.0)
        elif m == 0:
            out.append(0.0)
    return out


def about_median(samples: Sequence[float]) -> list[float]:
    """Each repeat of one measurement / their median - 1: the residuals of a measurement calibrate repeats."""
    if not samples:
        return []
    m = statistics.median(samples)
    return [x / m - 1.0 for x in samples] if m > 0 else []
