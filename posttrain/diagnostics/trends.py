"""Per-step trends: reward-length correlation from the ledger, learner signals from the metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# metrics key -> what the report calls it. Each is plotted/tabled only if the run logged it.
METRIC_TRENDS: dict[str, str] = {
    "reward/mean": "train reward (mean)",
    "heldout/accuracy": "held-out accuracy",
    "entropy": "policy entropy (learner)",
    "clip_frac_low": "clip fraction (low side)",
    "clip_frac_high": "clip fraction (high side)",
    "staleness/accepted_token_frac": "accepted token fraction",
    "length/mean": "response length (mean)",
    "adv/zero_group_frac": "zero-advantage group fraction",
    "loss": "loss",
    "ratio_max": "ratio max",
    "logkappa_abs_max": "|log kappa| max",
    "lag/mean": "policy lag (mean)",
}


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson correlation of ``x`` and ``y``; ``None`` with fewer than 2 points or zero variance."""
    if len(x) < 2:
        return None
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    den = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else None


def reward_length_corr(rows: Sequence[dict[str, Any]]) -> dict[int, float | None]:
    """Per step, the correlation of reward with response length over trajectories with a reward."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["reward"] is not None:
            by_step.setdefault(r["step"], []).append(r)
    return {s: pearson([r["length"] for r in rs], [r["reward"] for r in rs]) for s, rs in sorted(by_step.items())}


def metric_series(metrics: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` for every step whose metrics hold a numeric ``key``."""
    return [(int(m["step"]), float(m[key])) for m in metrics
            if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]


def all_trends(rows: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every trend the run has data for: metric keys of :data:`METRIC_TRENDS` + ``reward_length_corr``."""
    out = {k: s for k in METRIC_TRENDS if (s := metric_series(metrics, k))}
    corr = [(s, c) for s, c in reward_length_corr(rows).items() if c is not None]
    if corr:
        out["reward_length_corr"] = corr
    return out
