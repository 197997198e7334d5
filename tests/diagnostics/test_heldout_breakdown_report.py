"""The report's held-out breakdown (posttrain/diagnostics/heldout_breakdown_report.py): per constraint family
and tool calls per episode, first -> last evaluation, in the terminal, diagnostics.json and report.html."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.commands import report
from posttrain.diagnostics.heldout_breakdown_report import BreakdownRow, breakdown_rows
from tests.diagnostics.synthetic import write_run
from tests.diagnostics.test_commands import parse

_METRICS = [
    {"step": 0, "heldout/accuracy": 0.25, "heldout/ifc/no_commas": 0.5, "heldout/ifc/all_lowercase": 0.25,
     "heldout_unseen/accuracy": 0.0, "heldout_unseen/ifc/quoted": 0.0, "heldout/tool_calls_mean": 0.0,
     "heldout_notool/accuracy": 0.0, "heldout/hidden/accuracy": 0.25},
    {"step": 1, "reward/mean": 0.25, "loss": 0.0},  # a training step: no evaluation
    {"step": 2, "heldout/accuracy": 0.5, "heldout/ifc/no_commas": 0.75, "heldout/ifc/all_lowercase": 0.25,
     "heldout_unseen/accuracy": 0.5, "heldout_unseen/ifc/quoted": 1.0, "heldout_unseen/ifc/title": 0.5,
     "heldout/tool_calls_mean": 1.5, "heldout_notool/accuracy": 0.0},
]


def test_first_and_last_value_per_key_by_set() -> None:
    assert breakdown_rows(_METRICS) == [
        BreakdownRow("heldout/tool_calls_mean", 0, 0.0, 2, 1.5),
        BreakdownRow("heldout/ifc/all_lowercase", 0, 0.25, 2, 0.25),
        BreakdownRow("heldout/ifc/no_commas", 0, 0.5, 2, 0.75),
        BreakdownRow("heldout_unseen/ifc/quoted", 0, 0.0, 2, 1.0),
        BreakdownRow("heldout_unseen/ifc/title", 2, 0.5, 2, 0.5),  # asked for at the last evaluation only
    ]
    assert breakdown_rows([{"step": 0, "heldout/accuracy": 0.5}]) == []  # another task, or an older run


def test_report_shows_the_breakdown(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    run = write_run(tmp_path / "run", metrics=_METRICS)
    args = parse(report, ["report", str(run)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "held-out breakdown" in out and "heldout_unseen/ifc/quoted" in out and "+1.000" in out
    doc = json.loads((run / "diagnostics" / "diagnostics.json").read_text())
    assert doc["heldout_breakdown"][0] == {"key": "heldout/tool_calls_mean", "first_step": 0, "first": 0.0,
                                           "last_step": 2, "last": 1.5}
    html = (run / "diagnostics" / "report.html").read_text()
    assert ("<tr><td>heldout/ifc/no_commas</td><td>0</td><td>0.500</td><td>2</td><td>0.750</td><td>0.250</td></tr>"
            in html)


def test_a_run_without_breakdown_metrics_has_no_section(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    args = parse(report, ["report", str(run), "--quiet"])
    assert args.func(args) == 0
    assert "Held-out breakdown" not in (run / "diagnostics" / "report.html").read_text()
