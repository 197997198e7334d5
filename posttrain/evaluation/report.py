"""Run report: a PNG plot of held-out accuracy and train reward vs step, a table, report.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from posttrain.diagnostics.heldout_outcomes import SetOutcomes, read_outcomes
from posttrain.diagnostics.intervals import RESAMPLES, Interval, accuracy_interval, rise_interval

SERIES_KEYS = ("heldout/accuracy", "heldout_sampled/accuracy", "heldout/pass@1")
"""Held-out figures a report follows from ``metrics.jsonl`` (plus every ``heldout/pass@k`` present), and the
same for each further held-out set (``heldout`` replaced by the set's name, e.g. ``heldout_unseen/accuracy``)."""

NO_OUTCOMES = "no interval: per-problem outcomes not recorded"
"""What a report says where a run has no per-problem outcomes for an evaluation (runs written before them)."""

_MODES = ("_sampled", "_notool")


class HeldoutSeries(dict[str, list[tuple[int, float]]]):
    """:func:`heldout_series`'s ``{metric: [(step, value), ...]}``, carrying the run's per-problem outcomes
    (``outcomes``: :func:`~posttrain.diagnostics.heldout_outcomes.read_outcomes`) for the intervals."""

    def __init__(self, points: dict[str, list[tuple[int, float]]],
                 outcomes: dict[str, dict[int, SetOutcomes]] | None = None) -> None:
        super().__init__(points)
        self.outcomes: dict[str, dict[int, SetOutcomes]] = outcomes or {}


def _sets_of(rows: list[dict[str, float]]) -> list[str]:
    """The held-out sets logged in ``rows``: ``heldout`` first, then ``heldout_<name>`` sets by name."""
    found = {k[: -len("/accuracy")] for r in rows for k in r if k.endswith("/accuracy")}
    others = sorted(s for s in found if s.startswith("heldout_") and "/" not in s and not s.endswith(_MODES))
    return ["heldout", *others]


def metrics_rows_with(run_dir: Path, key: str) -> dict[int, dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` that hold ``key``, by their (int) ``step``: a resumed run's
    repeated step keeps its last row; a line cut by a crash is skipped (the rows before it still count);
    no file -> ``{}``."""
    path = run_dir / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and key in row:
                by_step[row["step"]] = row
    return by_step


def heldout_series(run_dir: Path) -> HeldoutSeries:
    """``{metric: [(step, value), ...]}`` of the held-out evaluations logged in ``run_dir/metrics.jsonl``.

    Keys, per held-out set ``S`` (``heldout``, then each further set such as ``heldout_unseen``):
    ``S/accuracy``, ``S_sampled/accuracy``, ``S/pass@1`` and ``S/pass@k`` (k > 1), where logged; a
    resumed run's repeated step keeps its last row. Values are fractions in [0, 1]. Missing file or
    no evaluation -> ``{}``. The result also carries the run's per-problem outcomes
    (:attr:`HeldoutSeries.outcomes`, empty for a run written before they were recorded).
    """
    by_step = {step: {k: float(v) for k, v in row.items() if k.startswith("heldout")
                      and isinstance(v, (int, float)) and not isinstance(v, bool)}
               for step, row in metrics_rows_with(run_dir, "heldout/accuracy").items()}
    keys: list[str] = []
    for s in _sets_of(list(by_step.values())):
        passk = f"{s}/pass@"
        keys += [f"{s}/accuracy", f"{s}_sampled/accuracy", f"{passk}1"] + sorted(
            {k for r in by_step.values() for k in r
             if k.startswith(passk) and k[len(passk):].isdigit() and k != f"{passk}1"})
    return HeldoutSeries({k: [(s, r[k]) for s, r in sorted(by_step.items()) if k in r] for k in keys
                          if any(k in r for r in by_step.values())}, read_outcomes(run_dir))


def set_name(s: str) -> str:
    """Human name of held-out set ``s``: ``heldout`` is the in-distribution set, ``heldout_unseen`` the
    unseen one (problems unlike any training problem: see the task), ``heldout_<x_y>`` ``x-y``."""
    return "in-distribution" if s == "heldout" else s[len("heldout_"):].replace("_", "-")


def series_label(key: str, eval_temperature: float, sampled_temperature: float | None, *,
                 several_sets: bool = False) -> str:
    """Human name of a :func:`heldout_series` key under the run's eval temperatures; ``several_sets``
    (the run evaluates more than ``heldout``) puts the set's name first (:func:`set_name`)."""
    head, _, fig = key.partition("/")
    s = head.removesuffix("_sampled")
    which = f"{set_name(s)} held-out" if several_sets or s != "heldout" else "held-out"
    if fig == "accuracy" and head == s:
        return f"{which} accuracy " + ("(greedy)" if eval_temperature == 0 else f"(sampled at T={eval_temperature:g})")
    if fig == "accuracy":
        return f"{which} accuracy (sampled" + ("" if sampled_temperature is None else f" at T={sampled_temperature:g}") + ")"
    t = eval_temperature if eval_temperature > 0 else sampled_temperature
    return f"{which} {fig}" + ("" if t is None else f" (T={t:g})")


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    """One evaluation of a held-out accuracy series: its step, accuracy and 95% interval (None: not recorded)."""

    step: int
    accuracy: float
    interval: Interval | None


@dataclasses.dataclass(frozen=True)
class AccuracySummary:
    """A held-out accuracy series in brief: first, best and last evaluation and the rise first -> last.

    ``rise`` is the paired bootstrap interval of ``last - first`` (None without per-problem outcomes; ``note``
    then says why)."""

    key: str
    label: str
    first: EvalPoint
    best: EvalPoint
    last: EvalPoint
    rise: Interval | None
    note: str


def _outcomes_at(series: dict[str, list[tuple[int, float]]], s: str, step: int, value: float) -> SetOutcomes | None:
    """Set ``s``'s recorded outcomes at ``step`` if they give the logged ``value`` (else None)."""
    o = series.outcomes.get(s, {}).get(step) if isinstance(series, HeldoutSeries) else None
    return o if o is not None and math.isclose(o.accuracy, value, rel_tol=0, abs_tol=1e-9) else None


def accuracy_summaries(series: dict[str, list[tuple[int, float]]], eval_temperature: float,
                       sampled_temperature: float | None, *, resamples: int = RESAMPLES,
                       seed: int = 0) -> list[AccuracySummary]:
    """One :class:`AccuracySummary` per accuracy series of ``series`` (greedy, sampled; every held-out set).

    Intervals are bootstrap 95% percentile intervals over the problems (Efron & Tibshirani 1993;
    :mod:`posttrain.diagnostics.intervals`, ``resamples`` and ``seed``) from the per-problem outcomes
    ``series`` carries (a :class:`HeldoutSeries`) where they match the logged accuracy; the rise's is
    paired (the same problems at both evaluations). Without them the intervals are None and ``note``
    says :data:`NO_OUTCOMES`.
    """
    several = any(not k.startswith(("heldout/", "heldout_sampled/")) for k in series)
    out = []
    for key, pts in series.items():
        if not key.endswith("/accuracy") or not pts:
            continue
        s = key[: -len("/accuracy")]

        def point(step: int, value: float, s: str = s) -> tuple[EvalPoint, SetOutcomes | None]:
            o = _outcomes_at(series, s, step, value)
            iv = accuracy_interval(o.valid, o.correct, resamples=resamples, seed=seed) if o is not None else None
            return EvalPoint(step, value, iv), o

        (first, o0), (last, o1) = point(*pts[0]), point(*pts[-1])
        best, _ = point(*max(pts, key=lambda p: (p[1], -p[0])))
        rise, note = None, NO_OUTCOMES
        if o0 is not None and o1 is not None:
            if o0.prompt_ids == o1.prompt_ids:
                rise, note = rise_interval((o0.valid, o0.correct), (o1.valid, o1.correct),
                                           resamples=resamples, seed=seed), ""
            else:
                note = "no interval: the first and last evaluations judged different problems"
        out.append(AccuracySummary(key, series_label(key, eval_temperature, sampled_temperature, several_sets=several),
                                   first, best, last, rise, note))
    return out


def _ci_points(iv: Interval) -> str:
    return f"{iv.level * 100:.0f}% CI {iv.low * 100:+.1f}..{iv.high * 100:+.1f}"


def rise_lines(series: dict[str, list[tuple[int, float]]], eval_temperature: float,
               sampled_temperature: float | None, *, resamples: int = RESAMPLES, seed: int = 0) -> list[str]:
    """One line per series: ``label: first -> last (+d points, 95% CI lo..hi; best b at step s)``, the measured rise.

    Accuracy lines carry the paired bootstrap interval of the rise (:func:`accuracy_summaries`), or say
    :data:`NO_OUTCOMES` for a run without per-problem outcomes; pass@k lines carry none. With more than
    one held-out set each label names its set (``in-distribution``, ``unseen``: :func:`set_name`).
    """
    summaries = {a.key: a for a in accuracy_summaries(series, eval_temperature, sampled_temperature,
                                                      resamples=resamples, seed=seed)}
    several = any(not k.startswith(("heldout/", "heldout_sampled/")) for k in series)
    out = []
    for key, pts in series.items():
        (s0, v0), (s1, v1) = pts[0], pts[-1]
        bs, bv = max(pts, key=lambda p: (p[1], -p[0]))
        a = summaries.get(key)
        ci = "" if a is None else f", {_ci_points(a.rise)}" if a.rise is not None else f", {a.note}"
        out.append(f"{series_label(key, eval_temperature, sampled_temperature, several_sets=several)}: step {s0} "
                   f"{v0:.3f} -> step {s1} {v1:.3f} ({(v1 - v0) * 100:+.1f} points{ci}; best {bv:.3f} at step {bs})")
    return out


def summaries_json(summaries: list[AccuracySummary]) -> list[dict[str, Any]]:
    """:func:`accuracy_summaries` as JSON-ready dicts (intervals as ``[low, high]``, None where not recorded)."""
    def iv(i: Interval | None) -> list[float] | None:
        return None if i is None else [i.low, i.high]

    def pt(p: EvalPoint) -> dict[str, Any]:
        return {"step": p.step, "accuracy": p.accuracy, "interval": iv(p.interval),
                "problems": None if p.interval is None else p.interval.n}

    return [{"key": a.key, "first": pt(a.first), "best": pt(a.best), "last": pt(a.last),
             "rise": a.last.accuracy - a.first.accuracy, "rise_interval": iv(a.rise), "note": a.note}
            for a in summaries]


def intervals_table(summaries: list[AccuracySummary]) -> Any:
    """A rich Table: per held-out accuracy series, first / best / last accuracy with their 95% intervals and
    the rise first -> last with its paired interval (in points)."""
    from rich.table import Table

    def ci(iv: Interval | None, scale: float = 1.0, fmt: str = ".3f") -> str:
        return "-" if iv is None else f"{iv.low * scale:{fmt}}..{iv.high * scale:{fmt}}"

    t = Table(title="held-out accuracy, bootstrap 95% intervals over problems")
    for col in ("series", "", "step", "accuracy", "95% interval"):
        t.add_column(col, justify="left" if col in ("series", "") else "right")
    for a in summaries:
        for i, (what, p) in enumerate((("first", a.first), ("best", a.best), ("last", a.last))):
            t.add_row(a.label if i == 0 else "", what, str(p.step), f"{p.accuracy:.3f}", ci(p.interval))
        t.add_row("", "rise", f"{a.first.step}->{a.last.step}", f"{(a.last.accuracy - a.first.accuracy) * 100:+.1f} pts",
                  ci(a.rise, 100, "+.1f") if a.rise is not None else a.note, end_section=True)
    return t


def write_report(run_dir: Path, state: Any, *, extra: dict[str, Any] | None = None,
                 labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Write ``report.json`` (+ ``report.png`` when matplotlib is installed); returns the report.

    ``heldout_accuracy_before`` is the accuracy at step 0 (after SFT warm-up, before RL);
    ``heldout_accuracy_after`` the accuracy at the last evaluated step; both fractions in [0, 1].
    ``heldout_series`` holds every logged held-out figure by step (:func:`heldout_series`: greedy,
    sampled, pass@k, every held-out set), all plotted; ``labels`` names them (default: the metric keys).
    ``heldout_intervals`` holds each accuracy series' first / best / last evaluation and rise with their
    bootstrap 95% intervals (:func:`summaries_json`; None where per-problem outcomes were not recorded).
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
        "heldout_intervals": summaries_json(accuracy_summaries(series, 0.0, None)),
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


PAIR_KEYS = ("heldout/pair_accuracy", "heldout/margin", "heldout/loss")
"""What a ``trainer: preference`` (offline) or ``trainer: reward_model`` run logs per held-out evaluation:
the share of held-out pairs ranked chosen-above-rejected, the mean margin and the mean loss."""


def pair_accuracy_curve(run_dir: Path) -> list[dict[str, float]]:
    """``[{step, pair_accuracy, margin, loss}, ...]`` by step from ``run_dir/metrics.jsonl`` (the rows holding
    ``heldout/pair_accuracy``; a resumed run's repeated step keeps its last row; a key not logged is absent)."""
    by_step = {step: {k.split("/", 1)[1]: float(row[k]) for k in PAIR_KEYS if isinstance(row.get(k), (int, float))}
               for step, row in metrics_rows_with(run_dir, "heldout/pair_accuracy").items()}
    return [{"step": s, **v} for s, v in sorted(by_step.items())]


def pair_accuracy_summary(curve: list[dict[str, float]]) -> dict[str, Any] | None:
    """First, best (highest, earliest on ties) and last evaluation of :func:`pair_accuracy_curve` and the rise
    first -> last; None for an empty curve. No interval: the runs do not record per-pair outcomes."""
    if not curve:
        return None
    best = max(curve, key=lambda p: (p["pair_accuracy"], -p["step"]))
    return {"first": curve[0], "best": best, "last": curve[-1],
            "rise": curve[-1]["pair_accuracy"] - curve[0]["pair_accuracy"]}


def pair_accuracy_table(curve: list[dict[str, float]], trainer: str) -> Any:
    """A rich Table of the held-out pair accuracy curve (every evaluation, then first / best / last marked)."""
    from rich.table import Table

    summary = pair_accuracy_summary(curve)
    marks: dict[int, list[str]] = {}
    if summary is not None:
        for what in ("first", "best", "last"):
            marks.setdefault(int(summary[what]["step"]), []).append(what)
    t = Table(title=f"held-out pair accuracy ({trainer}): the share of held-out pairs ranked chosen above rejected")
    for col in ("step", "pair accuracy", "margin", "loss", ""):
        t.add_column(col, justify="right" if col else "left")

    def f(p: dict[str, float], k: str) -> str:
        return f"{p[k]:.3f}" if k in p else "-"

    for p in curve:
        t.add_row(str(int(p["step"])), f(p, "pair_accuracy"), f(p, "margin"), f(p, "loss"),
                  ", ".join(marks.get(int(p["step"]), [])))
    if summary is not None:
        t.add_row("rise", f"{summary['rise'] * 100:+.1f} pts", "", "", "first -> last", end_section=True)
    return t
