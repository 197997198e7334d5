"""The run report's held-out series (greedy, sampled, pass@k) and the printed rise, by hand."""

import json
import types

from posttrain.evaluation.report import heldout_series, rise_lines, series_label, write_report


def _write_metrics(run_dir, rows):
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut by a cra")


def test_series_rise_and_report_by_hand(tmp_path):
    _write_metrics(tmp_path, [
        {"step": 0, "heldout/accuracy": 0.25, "heldout_sampled/accuracy": 0.125, "heldout/pass@1": 0.125,
         "heldout/pass@2": 0.25, "revision": "promoted"},
        {"step": 1, "reward/mean": 0.5},  # a training row: not an evaluation
        {"step": 10, "heldout/accuracy": 0.5, "heldout_sampled/accuracy": 0.375, "heldout/pass@1": 0.375,
         "heldout/pass@2": 0.5},
        {"step": 20, "heldout/accuracy": 0.4, "heldout_sampled/accuracy": 0.5, "heldout/pass@1": 0.5,
         "heldout/pass@2": 0.625},
    ])
    series = heldout_series(tmp_path)
    assert list(series) == ["heldout/accuracy", "heldout_sampled/accuracy", "heldout/pass@1", "heldout/pass@2"]
    assert series["heldout/accuracy"] == [(0, 0.25), (10, 0.5), (20, 0.4)]
    lines = rise_lines(series, 0.0, 0.7)
    assert lines[0] == ("held-out accuracy (greedy): step 0 0.250 -> step 20 0.400 (+15.0 points; "
                        "best 0.500 at step 10)")
    assert lines[1].startswith("held-out accuracy (sampled at T=0.7): step 0 0.125 -> step 20 0.500 (+37.5 points")
    assert lines[3].startswith("held-out pass@2 (T=0.7): step 0 0.250 -> step 20 0.625 (+37.5 points")
    assert series_label("heldout/accuracy", 1.0, None) == "held-out accuracy (sampled at T=1)"
    state = types.SimpleNamespace(heldout_curve=[(0, 0.25, 0.25), (10, 0.5, 0.5), (20, 0.4, 0.4)],
                                  best_heldout_accuracy=0.5, step=20, wall_seconds=3.0, reward_curve=[(1, 0.5)],
                                  decisions=[], stopped=None)
    rep = write_report(tmp_path, state)
    assert rep["heldout_series"]["heldout/pass@2"][-1] == {"step": 20, "value": 0.625}
    assert json.loads((tmp_path / "report.json").read_text())["heldout_accuracy_after"] == 0.4


def test_no_metrics_no_series(tmp_path):
    assert heldout_series(tmp_path) == {} and rise_lines({}, 0.0, None) == []
