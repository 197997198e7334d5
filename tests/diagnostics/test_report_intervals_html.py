"""``posttrain report``'s report.html shows the held-out accuracy intervals its terminal table and
heldout_intervals.json give (first / best / last per set and the rise), or why a run has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.commands import report
from posttrain.diagnostics.heldout_outcomes import SetOutcomes, append_outcomes
from posttrain.evaluation.report import NO_OUTCOMES
from tests.diagnostics.synthetic import write_run
from tests.diagnostics.test_commands import parse


def _outcomes(right: int, n: int, prefix: str) -> SetOutcomes:
    return SetOutcomes(tuple(f"{prefix}{i}" for i in range(n)), (1,) * n, (1,) * right + (0,) * (n - right))


def _report_html(run: Path) -> str:
    args = parse(report, ["report", str(run), "--quiet"])
    assert args.func(args) == 0
    return (run / "diagnostics" / "report.html").read_text()


def test_html_shows_the_intervals_of_a_toy_run(tmp_path: Path) -> None:
    # 10 problems per set. In-distribution: 0 right at step 0, 5 at step 1: the last evaluation's interval and
    # the paired rise are Binomial(10, 1/2) / 10 percentiles, [0.2, 0.8] (tests/diagnostics/test_intervals.py).
    # Unseen: the same 2 problems right both times. Its accuracy's resamples are Binomial(10, 1/5) / 10:
    # P(X = 0) = 0.107 > 2.5% and P(X <= 4) = 0.967 < 97.5% < P(X <= 5) = 0.994 -> [0.0, 0.5]; rise exactly [0, 0].
    run = write_run(tmp_path / "run", metrics=[
        {"step": 0, "heldout/accuracy": 0.0, "heldout_unseen/accuracy": 0.2},
        {"step": 1, "reward/mean": 0.25, "loss": 0.0, "heldout/accuracy": 0.5, "heldout_unseen/accuracy": 0.2},
    ])
    append_outcomes(run, 0, {"heldout": _outcomes(0, 10, "p"), "heldout_unseen": _outcomes(2, 10, "u")})
    append_outcomes(run, 1, {"heldout": _outcomes(5, 10, "p"), "heldout_unseen": _outcomes(2, 10, "u")})
    html = _report_html(run)
    section = html[html.index("bootstrap 95% intervals"):]
    section = section[:section.index("</table>")]
    rows = section.split("<tr")[2:]  # after the header row
    cells = [[c.split("</td>")[0] for c in r.split("<td>")[1:]] for r in rows]
    assert cells[:4] == [
        ["in-distribution held-out accuracy (greedy)", "first", "0", "0.000", "0.000..0.000"],
        ["", "best", "1", "0.500", "0.200..0.800"],
        ["", "last", "1", "0.500", "0.200..0.800"],
        ["", "rise", "0-&gt;1", "+50.0 pts", "+20.0..+80.0"]]
    assert cells[4][:1] == ["unseen held-out accuracy (greedy)"] and cells[4][3:] == ["0.200", "0.000..0.500"]
    assert cells[7][3:] == ["+0.0 pts", "+0.0..+0.0"]
    # The same figures as heldout_intervals.json.
    js = json.loads((run / "diagnostics" / "heldout_intervals.json").read_text())
    assert js[0]["rise_interval"] == pytest.approx([0.2, 0.8])
    assert js[1]["first"]["interval"] == pytest.approx([0.0, 0.5])


def test_html_of_a_run_without_per_problem_outcomes_says_why_it_has_no_interval(tmp_path: Path) -> None:
    html = _report_html(write_run(tmp_path / "old"))  # held-out accuracy 0.5 at steps 0 and 1, nothing else
    section = html[html.index("bootstrap 95% intervals"):]
    assert "<td>0.500</td><td>-</td>" in section and NO_OUTCOMES in section


def test_html_has_no_interval_section_without_a_held_out_evaluation(tmp_path: Path) -> None:
    html = _report_html(write_run(tmp_path / "none", metrics=[{"step": 1, "reward/mean": 0.25, "loss": 0.0}]))
    assert "bootstrap 95% intervals" not in html
