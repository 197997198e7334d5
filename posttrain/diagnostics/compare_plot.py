"""The compare plot: held-out accuracy against generated tokens and wall-clock, with seed bands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from posttrain.diagnostics.budget import Curve
from posttrain.diagnostics.plots import pyplot


def step_values(curve: Curve, grid: np.ndarray, axis: str) -> np.ndarray:
    """The curve's accuracy held constant between evaluations, on ``grid``; NaN outside its range."""
    xs = np.asarray(curve.tokens if axis == "tokens" else curve.seconds)
    total = curve.total_tokens if axis == "tokens" else curve.total_seconds
    out = np.full(grid.shape, np.nan)
    if xs.size == 0:
        return out
    idx = np.searchsorted(xs, grid, side="right") - 1
    ok = (idx >= 0) & (grid <= total)
    out[ok] = np.asarray(curve.accuracy)[idx[ok]]
    return out


def plot_compare(curves: Mapping[str, Sequence[Curve]], path: Path, budget: float | None) -> Path | None:
    """Two panels (tokens, wall-clock): each recipe's seed mean as a line, min-max over seeds as a band."""
    plt = pyplot()
    if plt is None or not curves:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))  # type: ignore[attr-defined]
    for ax, axis, label in ((axes[0], "tokens", "generated tokens"), (axes[1], "seconds", "wall-clock seconds")):
        top = max((c.total_tokens if axis == "tokens" else c.total_seconds) for cs in curves.values() for c in cs)
        grid = np.linspace(0.0, max(top, 1.0), 200)
        for name, cs in curves.items():
            vals = np.vstack([step_values(c, grid, axis) for c in cs])
            have = ~np.isnan(vals).all(axis=0)
            with np.errstate(all="ignore"):
                mean, lo, hi = np.nanmean(vals[:, have], 0), np.nanmin(vals[:, have], 0), np.nanmax(vals[:, have], 0)
            line = ax.plot(grid[have], mean, drawstyle="steps-post", label=f"{name} ({len(cs)} seeds)")[0]
            ax.fill_between(grid[have], lo, hi, step="post", alpha=0.2, color=line.get_color())
        if budget is not None and axis == "tokens":
            ax.axvline(budget, color="k", ls="--", lw=1, label="budget")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("held-out accuracy vs budget (line: seed mean, band: min-max over seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # type: ignore[attr-defined]
    return path
