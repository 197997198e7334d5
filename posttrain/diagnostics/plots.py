"""PNG plots of the report (matplotlib, the ``plot`` extra): strata bars and per-step trends."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from posttrain.diagnostics.strata import StrataTable
from posttrain.diagnostics.trends import METRIC_TRENDS


def pyplot() -> object | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``None`` if not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_strata(tables: Sequence[StrataTable], path: Path) -> Path | None:
    """One panel per non-empty table: accuracy and mean reward per stratum, n above each bar."""
    plt = pyplot()
    shown = [t for t in tables if t.strata]
    if plt is None or not shown:
        return None
    cols = 3
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)  # type: ignore[attr-defined]
    for ax, t in zip(axes.flat, shown, strict=False):
        xs = range(len(t.strata))
        acc = [s.accuracy if s.accuracy is not None else 0.0 for s in t.strata]
        rew = [s.reward_mean if s.reward_mean is not None else 0.0 for s in t.strata]
        ax.bar([x - 0.2 for x in xs], acc, width=0.4, label="accuracy")
        ax.bar([x + 0.2 for x in xs], rew, width=0.4, label="reward")
        for x, s in zip(xs, t.strata, strict=True):
            ax.annotate(f"n={s.n}", (x, max(acc[x], rew[x])), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [s.label for s in t.strata], rotation=20, fontsize=7)
        ax.set_title(t.feature, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # type: ignore[attr-defined]
    return path


def plot_trends(trends: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    """One small panel per trend series against the RL step."""
    plt = pyplot()
    if plt is None or not trends:
        return None
    names = {**METRIC_TRENDS, "reward_length_corr": "reward-length correlation"}
    cols = 3
    rows = (len(trends) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 2.6 * rows), squeeze=False)  # type: ignore[attr-defined]
    for ax, (key, series) in zip(axes.flat, trends.items(), strict=False):
        ax.plot([s for s, _ in series], [v for _, v in series], "o-", ms=3)
        ax.set_title(names.get(key, key), fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(trends):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("RL step", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # type: ignore[attr-defined]
    return path
