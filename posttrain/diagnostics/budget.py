"""Budget-matched comparison: held-out accuracy at an equal number of generated tokens.

Comparing recipes at "1000 learner steps" each is not fair, because recipes spend different
numbers of rollout tokens per step. A run's accuracy at a budget of ``T``
generated tokens is the accuracy of its last held-out evaluation taken when it had generated at
most ``T`` tokens: the policy you would actually hold had you stopped there (no interpolation,
which would invent evaluations that never happened).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

# Two-sided 95% Student-t critical values, df = 1..30; beyond that the normal 1.96.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


@dataclasses.dataclass(frozen=True)
class Curve:
    """One run's held-out evaluations with the cumulative budget spent when each was taken."""

    steps: list[int]
    tokens: list[float]  # cumulative generated tokens at each evaluation
    seconds: list[float]  # cumulative wall-clock seconds at each evaluation
    accuracy: list[float]
    total_tokens: float
    total_seconds: float


def run_curve(metrics: Sequence[Mapping[str, Any]]) -> Curve:
    """The :class:`Curve` of a run's per-step metrics (``tokens/generated``, ``time/step_s``).

    A step's generated tokens and time are counted before its own evaluation (evaluation follows
    the update in the loop); the step-0 evaluation is at 0 tokens and 0 seconds.
    """
    tok = sec = 0.0
    c = Curve([], [], [], [], 0.0, 0.0)
    for m in sorted(metrics, key=lambda m: int(m["step"])):
        tok += float(m.get("tokens/generated") or 0.0)
        sec += float(m.get("time/step_s") or 0.0)
        acc = m.get("heldout/accuracy")
        if isinstance(acc, (int, float)) and math.isfinite(acc):
            c.steps.append(int(m["step"]))
            c.tokens.append(tok)
            c.seconds.append(sec)
            c.accuracy.append(float(acc))
    return dataclasses.replace(c, total_tokens=tok, total_seconds=sec)


def index_at(curve: Curve, budget: float, axis: str = "tokens") -> int | None:
    """Index (into ``curve.steps`` / ``curve.accuracy``) of the last evaluation with ``axis`` (``tokens`` or
    ``seconds``) <= ``budget``; ``None`` when the run never spent ``budget`` (it cannot speak for that
    budget) or has no evaluation within it."""
    xs = curve.tokens if axis == "tokens" else curve.seconds
    total = curve.total_tokens if axis == "tokens" else curve.total_seconds
    if total < budget:
        return None
    within = [i for i, x in enumerate(xs) if x <= budget]
    return within[-1] if within else None


def accuracy_at(curve: Curve, budget: float, axis: str = "tokens") -> float | None:
    """Accuracy of the last evaluation with ``axis`` (``tokens`` or ``seconds``) <= ``budget``
    (:func:`index_at`); ``None`` where that has none."""
    i = index_at(curve, budget, axis)
    return None if i is None else curve.accuracy[i]


def t_critical(df: int) -> float:
    """Two-sided 95% Student-t critical value for ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclasses.dataclass(frozen=True)
class Difference:
    """``b - a`` in accuracy with its 95% CI (``None`` bounds when it cannot be estimated)."""

    mean: float
    low: float | None
    high: float | None
    n_a: int
    n_b: int
    method: str


def _var(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def difference(a: Mapping[int, float], b: Mapping[int, float]) -> Difference | None:
    """Mean of ``b - a`` over seeds with a 95% t-interval; ``None`` if either side is empty.

    Seeds present in both are paired (each seed shares its held-out set and initial sampling
    stream across recipes), using the paired t-interval; with fewer than 2 common seeds the
    samples are treated as independent (Welch). One value per side gives no interval.
    """
    if not a or not b:
        return None
    common = sorted(set(a) & set(b))
    if len(common) >= 2:
        d = [b[s] - a[s] for s in common]
        mean, half = sum(d) / len(d), t_critical(len(d) - 1) * math.sqrt(_var(d) / len(d))
        return Difference(mean, mean - half, mean + half, len(common), len(common), f"paired t over {len(d)} seeds")
    xa, xb = list(a.values()), list(b.values())
    mean = sum(xb) / len(xb) - sum(xa) / len(xa)
    if len(xa) < 2 or len(xb) < 2:
        return Difference(mean, None, None, len(xa), len(xb), "no interval: one run on a side")
    va, vb = _var(xa) / len(xa), _var(xb) / len(xb)
    se = math.sqrt(va + vb)
    if se == 0:
        return Difference(mean, mean, mean, len(xa), len(xb), "Welch t (zero variance)")
    df = (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1))
    half = t_critical(max(1, int(df))) * se
    return Difference(mean, mean - half, mean + half, len(xa), len(xb), f"Welch t, df {int(df)}")
