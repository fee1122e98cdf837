"""Value curves: held-out acceptance against what a dataset's training samples cost, fitted per dataset.

The curve is the saturating hyperbola ``a(s) = a0 + gain * s / (s + half)``:

- finite at ``s = 0``: the leave-one-dataset-out drafter is a real point (what the other datasets give);
- bounded (``a0 + gain``): acceptance cannot pass ``k + 1``, so where that ceiling is known the fit is held to
  ``a0 + gain <= k + 1`` (points still rising in a straight line would otherwise fit a gain of hundreds) and
  the curve never predicts past it;
- concave: each dollar buys less than the one before (more samples of one distribution teach less);
- its gap to the ceiling falls as ``1/s``, the tail of the power laws learning curves follow, with the
  exponent fixed at 1 because a handful of points (25/50/100% and leave-one-out) cannot pin an exponent down.
  An exponential saturation would need the same three parameters and promise far less from extra spend.

Pure functions: a weighted least-squares fit (exact in ``a0`` and ``gain`` for a given ``half``; ``half`` by a
log grid then golden-section search), and a parametric bootstrap over the points' standard errors for the
uncertainty of anything predicted from a curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

GRID = 240  # log-spaced trial values of ``half`` before the golden-section refinement
MIN_POINTS = 3


@dataclass(frozen=True)
class Curve:
    """``a(s) = a0 + gain * s / (s + half)``: acceptance at spend ``s`` (dollars or tokens)."""

    a0: float
    gain: float
    half: float  # the spend that buys half of ``gain``
    rmse: float = 0.0  # weighted root-mean-square residual of the fit, in standard errors (1 ~ as noisy as said)
    saturated: bool = True  # False: ``half`` sits at the top of the search, the points show no bend yet
    ceiling: float | None = None  # the most acceptance can be (k + 1), where known: no prediction passes it
    capped: bool = False  # the fit reached the ceiling: ``gain`` is the ceiling's, not measured

    @property
    def measured(self) -> bool:
        """Whether ``gain`` and ``half`` are the points' own: they bend, and the ceiling did not set them."""
        return self.saturated and not self.capped

    def _raw(self, s: float) -> float:
        return self.a0 + self.gain * s / (s + self.half)

    def __call__(self, s: float) -> float:
        s = max(float(s), 0.0)
        v = self._raw(s)
        return v if self.ceiling is None else min(v, self.ceiling)

    def slope(self, s: float) -> float:
        """Acceptance per unit of spend at ``s``: what the next dollar (or token) buys (none at the ceiling)."""
        s = max(float(s), 0.0)
        if self.ceiling is not None and self._raw(s) >= self.ceiling:
            return 0.0
        return self.gain * self.half / (s + self.half) ** 2

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Curve:
        return cls(**{k: d[k] for k in ("a0", "gain", "half", "rmse", "saturated", "ceiling", "capped") if k in d})


def _weights(se: Sequence[float | None] | None, n: int) -> tuple[np.ndarray, float]:
    """(1/se^2 per point relative to the smallest error, that smallest error: 1 when none is used). A point with
    no (or a zero) error gets the largest error of the others (a figure of under two drafts has none, and is the
    least sure)."""
    if se is None or len(se) != n:
        return np.ones(n), 1.0
    vals = np.array([float(s) if s is not None and math.isfinite(float(s)) and float(s) > 0 else np.nan
                     for s in se])
    if not np.isfinite(vals).any():
        return np.ones(n), 1.0
    filled = np.where(np.isfinite(vals), vals, np.nanmax(vals))
    return (filled.min() / filled) ** 2, float(filled.min())


def _solve(x: np.ndarray, y: np.ndarray, w: np.ndarray, half: float,
           ceiling: float | None = None) -> tuple[float, float, float, bool]:
    """(a0, gain, weighted squared residual, whether the ceiling bound it) of the best fit for this ``half``
    with ``a0 + gain <= ceiling``: the residual is a convex quadratic in (a0, gain), so when the free optimum
    passes the ceiling the held one lies on it, ``a(s) = a0 * half / (s + half) + ceiling * s / (s + half)``,
    linear in ``a0`` alone."""
    frac = x / (x + half)
    sw = np.sqrt(w)
    basis = np.stack([np.ones_like(x), frac], axis=1)
    coef, *_ = np.linalg.lstsq(basis * sw[:, None], y * sw, rcond=None)
    a0, gain = float(coef[0]), float(coef[1])
    if ceiling is None or a0 + gain <= ceiling:
        return a0, gain, float(np.sum(w * (basis @ coef - y) ** 2)), False
    rest = 1.0 - frac
    a0 = float(np.sum(w * rest * (y - ceiling * frac)) / max(float(np.sum(w * rest * rest)), 1e-300))
    pred = a0 * rest + ceiling * frac
    return a0, ceiling - a0, float(np.sum(w * (pred - y) ** 2)), True


def fit_curve(x: Sequence[float], y: Sequence[float], se: Sequence[float | None] | None = None,
              ceiling: float | None = None) -> Curve | str:
    """See ``_fit``; numbers too extreme to fit are a reason too, never an exception or a console warning."""
    if ceiling is not None and not math.isfinite(ceiling):
        ceiling = None
    try:
        with np.errstate(all="ignore"):  # an overflow here ends in a reason below, not in numpy's warning
            fit = _fit(x, y, se, ceiling)
    except (ValueError, OverflowError, ZeroDivisionError, np.linalg.LinAlgError) as e:
        return f"the points cannot be fitted ({type(e).__name__}: {e})"
    if isinstance(fit, Curve) and not all(math.isfinite(v) for v in (fit.a0, fit.gain, fit.half, fit.rmse)):
        return f"the points cannot be fitted (a coefficient is not finite: {fit})"
    return fit


def _fit(x: Sequence[float], y: Sequence[float], se: Sequence[float | None] | None,
         ceiling: float | None = None) -> Curve | str:
    """The weighted least-squares curve through points (spend, acceptance, its standard error), or why not,
    held under ``ceiling`` (k + 1) where given.

    Needs at least three distinct spends, one of them positive. ``half`` is searched over 1/1000 to 1000
    times the largest spend; a best fit at the top means the points still rise in a straight line
    (``saturated`` False: the curve's promise beyond them is a guess)."""
    xs = np.asarray([float(v) for v in x], dtype=float)
    ys = np.asarray([float(v) for v in y], dtype=float)
    if xs.shape != ys.shape or not (np.isfinite(xs).all() and np.isfinite(ys).all()):
        return "spend and acceptance must be finite numbers, one of each per point"
    if (xs < 0).any():
        return "a spend is negative"
    if len(np.unique(xs)) < MIN_POINTS or xs.max() <= 0:
        return f"needs {MIN_POINTS} points at distinct spends (got {len(np.unique(xs))})"
    w, scale = _weights(se, len(xs))
    top = float(xs.max())
    lo, hi = math.log(top * 1e-3), math.log(top * 1e3)
    grid = np.linspace(lo, hi, GRID)
    scores = [_solve(xs, ys, w, math.exp(g), ceiling)[2] for g in grid]
    i = int(np.argmin(scores))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, GRID - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden-section search of the bracket around the best grid point
        c, d = b - golden * (b - a), a + golden * (b - a)
        if _solve(xs, ys, w, math.exp(c), ceiling)[2] <= _solve(xs, ys, w, math.exp(d), ceiling)[2]:
            b = d
        else:
            a = c
    half = math.exp((a + b) / 2)
    a0, gain, resid, capped = _solve(xs, ys, w, half, ceiling)
    dof = max(len(xs) - 3, 1)
    return Curve(a0=a0, gain=gain, half=half, rmse=math.sqrt(resid / dof) / scale,
                 saturated=i < GRID - 1 and half < top * 1e3 * 0.99, ceiling=ceiling, capped=capped)


def curve_draws(x: Sequence[float], y: Sequence[float], se: Sequence[float | None], n: int = 200,
                seed: int = 0, ceiling: float | None = None) -> list[Curve]:
    """Curves refitted on points redrawn within their standard errors (a parametric bootstrap): the spread
    of a prediction over these curves is its uncertainty. Draws whose fit fails are left out; none when no
    point has an error."""
    rng = np.random.default_rng(seed)
    ys = np.asarray(y, dtype=float)
    w, scale = _weights(se, len(ys))
    if not any(s is not None and math.isfinite(float(s)) and float(s) > 0 for s in se):
        return []  # no point has an error: no spread to draw from (the plan says its sd is unknown)
    sd = scale / np.sqrt(w)  # the errors the fit weighs by: a point with none redrawn as the least sure
    out = []
    for _ in range(n):
        fit = fit_curve(x, ys + rng.normal(size=len(ys)) * sd, se, ceiling)
        if isinstance(fit, Curve):
            out.append(fit)
    return out


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for fewer than two values)."""
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
