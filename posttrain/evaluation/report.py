"""Run report: a PNG plot of held-out accuracy and train reward vs step, a table, report.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SERIES_KEYS = ("heldout/accuracy", "heldout_sampled/accuracy", "heldout/pass@1")
"""Held-out figures a report follows from ``metrics.jsonl`` (plus every ``heldout/pass@k`` present)."""


def heldout_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` of the held-out evaluations logged in ``run_dir/metrics.jsonl``.

    Keys: :data:`SERIES_KEYS` and ``heldout/pass@k`` (k > 1) where logged; a resumed run's repeated
    step keeps its last row. Values are fractions in [0, 1]. Missing file or no evaluation -> ``{}``.
    """
    path = run_dir / "metrics.jsonl"
    by_step: dict[int, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash: the rows before it still count
                continue
            if isinstance(row, dict) and "heldout/accuracy" in row and isinstance(row.get("step"), int):
                by_step[row["step"]] = {k: float(v) for k, v in row.items() if k.startswith("heldout")
                                        and isinstance(v, (int, float)) and not isinstance(v, bool)}
    keys = list(SERIES_KEYS) + sorted({k for r in by_step.values() for k in r
                                       if k.startswith("heldout/pass@") and k[13:].isdigit() and k != "heldout/pass@1"})
    return {k: [(s, r[k]) for s, r in sorted(by_step.items()) if k in r] for k in keys
            if any(k in r for r in by_step.values())}


def series_label(key: str, eval_temperature: float, sampled_temperature: float | None) -> str:
    """Human name of a :func:`heldout_series` key under the run's eval temperatures."""
    if key == "heldout/accuracy":
        return "held-out accuracy " + ("(greedy)" if eval_temperature == 0 else f"(sampled at T={eval_temperature:g})")
    if key == "heldout_sampled/accuracy":
        return f"held-out accuracy (sampled at T={sampled_temperature:g})"
    t = eval_temperature if eval_temperature > 0 else sampled_temperature
    return f"held-out {key.split('/', 1)[1]} (T={t:g})"


def rise_lines(series: dict[str, list[tuple[int, float]]], eval_temperature: float,
               sampled_temperature: float | None) -> list[str]:
    """One line per series: ``label: first -> last (+d points, best b at step s)``, the measured rise."""
    out = []
    for key, pts in series.items():
        (s0, v0), (s1, v1) = pts[0], pts[-1]
        bs, bv = max(pts, key=lambda p: (p[1], -p[0]))
        out.append(f"{series_label(key, eval_temperature, sampled_temperature)}: step {s0} {v0:.3f} -> step {s1} "
                   f"{v1:.3f} ({(v1 - v0) * 100:+.1f} points; best {bv:.3f} at step {bs})")
    return out


def write_report(run_dir: Path, state: Any, *, extra: dict[str, Any] | None = None,
                 labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Write ``report.json`` (+ ``report.png`` when matplotlib is installed); returns the report.

    ``heldout_accuracy_before`` is the accuracy at step 0 (after SFT warm-up, before RL);
    ``heldout_accuracy_after`` the accuracy at the last evaluated step; both fractions in [0, 1].
    ``heldout_series`` holds every logged held-out figure by step (:func:`heldout_series`: greedy,
    sampled, pass@k), all plotted; ``labels`` names them (default: the metric keys).
    """
    curve = list(state.heldout_curve)
    series = heldout_series(run_dir)
    rep: dict[str, Any] = {
        "heldout_accuracy_before": curve[0][1] if curve else None,
        "heldout_accuracy_after": curve[-1][1] if curve else None,
        "best_heldout_accuracy": state.best_heldout_accuracy,
        "steps": state.step,
        "wall_seconds": state.wall_seconds,
        "heldout_curve": [{"step": s, "accuracy": a, "reward": r} for s, a, r in curve],
        "heldout_series": {k: [{"step": s, "value": v} for s, v in pts] for k, pts in series.items()},
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
    if series:
        for key, pts in series.items():
            ax.plot([s for s, _ in pts], [v for _, v in pts], "o-", label=(labels or {}).get(key, key))
    elif curve:
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
