"""Run report: a PNG plot of held-out accuracy and train reward vs step, a table, report.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(run_dir: Path, state: Any, *, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``report.json`` (+ ``report.png`` when matplotlib is installed); returns the report.

    ``heldout_accuracy_before`` is the accuracy at step 0 (after SFT warm-up, before RL);
    ``heldout_accuracy_after`` the accuracy at the last evaluated step; both fractions in [0, 1].
    """
    curve = list(state.heldout_curve)
    rep: dict[str, Any] = {
        "heldout_accuracy_before": curve[0][1] if curve else None,
        "heldout_accuracy_after": curve[-1][1] if curve else None,
        "best_heldout_accuracy": state.best_heldout_accuracy,
        "steps": state.step,
        "wall_seconds": state.wall_seconds,
        "heldout_curve": [{"step": s, "accuracy": a, "reward": r} for s, a, r in curve],
        "reward_curve": [{"step": s, "reward": r} for s, r in state.reward_curve],
        "decisions": state.decisions,
        "stopped": state.stopped,
        **(extra or {}),
    }
    (run_dir / "report.json").write_text(json.dumps(rep, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        rep["plot"] = None
        return rep
    fig, ax = plt.subplots(figsize=(7, 4))
    if curve:
        ax.plot([s for s, _, _ in curve], [a for _, a, _ in curve], "o-", label="held-out accuracy")
    if state.reward_curve:
        ax.plot([s for s, _ in state.reward_curve], [r for _, r in state.reward_curve], alpha=0.6, label="train reward (mean)")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("posttrain: held-out accuracy and reward vs step")
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=120)
    plt.close(fig)
    rep["plot"] = str(run_dir / "report.png")
    (run_dir / "report.json").write_text(json.dumps(rep, indent=2))
    return rep


def report_table(rep: dict[str, Any]) -> Any:
    """A rich Table of the held-out curve and the before/after figures."""
    from rich.table import Table

    t = Table(title="held-out accuracy by step")
    t.add_column("step", justify="right")
    t.add_column("held-out accuracy", justify="right")
    t.add_column("held-out reward", justify="right")
    for row in rep["heldout_curve"]:
        t.add_row(str(row["step"]), f"{row['accuracy']:.3f}", f"{row['reward']:.3f}")
    return t
