"""The HTML section of ``report.html`` with the held-out accuracy intervals: first / best / last and the rise.

It renders the summaries ``posttrain report`` prints and writes to ``heldout_intervals.json``
(:func:`posttrain.evaluation.report.accuracy_summaries`: bootstrap 95% percentile intervals over the
problems, Efron & Tibshirani 1993, the rise's paired), the same figures in the same format as the
terminal table. A series without per-problem outcomes shows ``-`` for its intervals and its note
(``no interval: per-problem outcomes not recorded``) in place of the rise's.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Protocol

from posttrain.diagnostics.intervals import Interval


class EvalPointView(Protocol):
    """One evaluation of a series (met by :class:`posttrain.evaluation.report.EvalPoint`)."""

    @property
    def step(self) -> int: ...

    @property
    def accuracy(self) -> float: ...

    @property
    def interval(self) -> Interval | None: ...


class AccuracySummaryView(Protocol):
    """A held-out accuracy series in brief (met by :class:`posttrain.evaluation.report.AccuracySummary`)."""

    @property
    def label(self) -> str: ...

    @property
    def first(self) -> EvalPointView: ...

    @property
    def best(self) -> EvalPointView: ...

    @property
    def last(self) -> EvalPointView: ...

    @property
    def rise(self) -> Interval | None: ...

    @property
    def note(self) -> str: ...


def _span(iv: Interval | None, scale: float = 1.0, fmt: str = ".3f") -> str:
    return "-" if iv is None else f"{iv.low * scale:{fmt}}..{iv.high * scale:{fmt}}"


def intervals_section(summaries: Sequence[AccuracySummaryView]) -> str:
    """The section's HTML: a heading, one line on the method, and a table with, per series, rows ``first``,
    ``best``, ``last`` (step, accuracy, 95% interval) and ``rise`` (steps, points, the paired interval in
    points or the summary's note). Empty string for no series (a run with no held-out evaluation)."""
    if not summaries:
        return ""
    rows = []
    for a in summaries:
        for i, (what, p) in enumerate((("first", a.first), ("best", a.best), ("last", a.last))):
            rows.append(f"<tr><td>{escape(a.label) if i == 0 else ''}</td><td>{what}</td><td>{p.step}</td>"
                        f"<td>{p.accuracy:.3f}</td><td>{_span(p.interval)}</td></tr>")
        rise = (a.last.accuracy - a.first.accuracy) * 100
        ci = _span(a.rise, 100, "+.1f") if a.rise is not None else f"<span class='note'>{escape(a.note)}</span>"
        rows.append(f"<tr class='rise'><td></td><td>rise</td><td>{a.first.step}-&gt;{a.last.step}</td>"
                    f"<td>{rise:+.1f} pts</td><td>{ci}</td></tr>")
    return ("<h2>Held-out accuracy, bootstrap 95% intervals over problems</h2>"
            "<p class='note'>percentile bootstrap over the held-out problems; the rise first "
            "-&gt; last is bootstrapped paired (the same resampled problems at both evaluations), in points.</p>"
            "<table class='intervals'><tr><th>series</th><th></th><th>step</th><th>accuracy</th>"
            f"<th>95% interval</th></tr>{''.join(rows)}</table>")
