"""Bootstrap 95% intervals of held-out accuracy and of its rise between two evaluations.

The percentile interval of Efron & Tibshirani 1993 (*An Introduction to the Bootstrap*, ch. 13):
resample the problems with replacement ``resamples`` times, recompute the statistic on each
resample, and take its ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles. The statistic is the
accuracy as the evaluation computes it, correct samples over judged samples
(``sum(correct) / sum(valid)``), so one problem with several samples counts as one unit. The rise
between two evaluations of the **same** problems is bootstrapped *paired*: each resample draws one
set of problem indices and uses it for both evaluations, so what the two share (the problems'
difficulty) cancels. Pure functions of the outcomes, a seed and ``resamples``: same inputs -> same
interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

RESAMPLES = 2000
"""Bootstrap resamples by default (Efron & Tibshirani 1993 suggest >= 1000 for percentile intervals)."""

LEVEL = 0.95
"""Coverage of the interval by default."""


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap percentile interval ``[low, high]`` over ``n`` problems."""

    estimate: float
    low: float
    high: float
    n: int
    level: float = LEVEL


def _percentiles(stats: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(stats, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def _check(valid: np.ndarray, correct: np.ndarray, what: str) -> None:
    if valid.shape != correct.shape or valid.ndim != 1:
        raise ValueError(f"{what}: valid and correct need one value per problem, got shapes {valid.shape} "
                         f"and {correct.shape}")
    if (valid < 0).any() or (correct < 0).any() or (correct > valid).any():
        raise ValueError(f"{what}: need 0 <= correct <= valid for every problem")


def _check_args(resamples: int, level: float) -> None:
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap: need resamples >= 1 and 0 < level < 1, got {resamples}, {level}")


def accuracy_interval(valid: Sequence[int], correct: Sequence[int], *, resamples: int = RESAMPLES, seed: int = 0,
                      level: float = LEVEL) -> Interval:
    """Accuracy ``sum(correct) / sum(valid)`` with its bootstrap percentile interval (Efron & Tibshirani 1993).

    ``valid[i]`` / ``correct[i]``: problem ``i``'s judged samples (infra errors left out) and its correct
    ones (``1`` / ``0`` or ``1`` for a greedy evaluation). Problems with no judged sample carry no
    information and are left out (``n`` counts the rest). Resamples those problems with replacement
    ``resamples`` times (``numpy.random.default_rng(seed)``). All problems equally right (or wrong)
    -> a zero-width interval at the estimate. No judged problem -> NaN estimate and interval, ``n = 0``.
    """
    _check_args(resamples, level)
    v, c = np.asarray(valid, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    _check(v, c, "accuracy_interval")
    keep = v > 0
    v, c = v[keep], c[keep]
    if v.size == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, level)
    idx = np.random.default_rng(seed).integers(0, v.size, size=(resamples, v.size))
    lo, hi = _percentiles(c[idx].sum(axis=1) / v[idx].sum(axis=1), level)
    return Interval(float(c.sum() / v.sum()), lo, hi, int(v.size), level)


def rise_interval(first: tuple[Sequence[int], Sequence[int]], last: tuple[Sequence[int], Sequence[int]], *,
                  resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> Interval:
    """Rise of accuracy ``acc(last) - acc(first)`` on the same problems, with its paired bootstrap interval.

    ``first`` and ``last`` are ``(valid, correct)`` per problem (as in :func:`accuracy_interval`), the
    same problems in the same order. Problems judged in both evaluations are kept; each resample draws
    one index vector and computes both accuracies on it (paired bootstrap, Efron & Tibshirani 1993,
    ch. 13), so identical evaluations give ``[0, 0]``. No problem judged in both -> NaN, ``n = 0``.
    """
    _check_args(resamples, level)
    v0, c0 = (np.asarray(x, dtype=np.float64) for x in first)
    v1, c1 = (np.asarray(x, dtype=np.float64) for x in last)
    _check(v0, c0, "rise_interval (first)")
    _check(v1, c1, "rise_interval (last)")
    if v0.shape != v1.shape:
        raise ValueError(f"rise_interval: the two evaluations need the same problems, got {v0.size} and {v1.size}")
    keep = (v0 > 0) & (v1 > 0)
    v0, c0, v1, c1 = v0[keep], c0[keep], v1[keep], c1[keep]
    if v0.size == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, level)
    idx = np.random.default_rng(seed).integers(0, v0.size, size=(resamples, v0.size))
    stats = c1[idx].sum(axis=1) / v1[idx].sum(axis=1) - c0[idx].sum(axis=1) / v0[idx].sum(axis=1)
    lo, hi = _percentiles(stats, level)
    return Interval(float(c1.sum() / v1.sum() - c0.sum() / v0.sum()), lo, hi, int(v0.size), level)
