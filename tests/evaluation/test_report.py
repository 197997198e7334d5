"""The run report's held-out series (greedy, sampled, pass@k) and the printed rise, by hand."""

import json
import types

import pytest

from posttrain.diagnostics.heldout_outcomes import OUTCOMES_FILE, SetOutcomes, append_outcomes, read_outcomes
from posttrain.evaluation.report import (
    NO_OUTCOMES,
    accuracy_summaries,
    heldout_series,
    rise_lines,
    series_label,
    summaries_json,
    write_report,
)


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
    assert lines[0] == ("held-out accuracy (greedy): step 0 0.250 -> step 20 0.400 (+15.0 points, no interval: "
                        "per-problem outcomes not recorded; best 0.500 at step 10)")
    assert lines[1].startswith("held-out accuracy (sampled at T=0.7): step 0 0.125 -> step 20 0.500 (+37.5 points")
    assert lines[3] == "held-out pass@2 (T=0.7): step 0 0.250 -> step 20 0.625 (+37.5 points; best 0.625 at step 20)"
    assert series_label("heldout/accuracy", 1.0, None) == "held-out accuracy (sampled at T=1)"
    state = types.SimpleNamespace(heldout_curve=[(0, 0.25, 0.25), (10, 0.5, 0.5), (20, 0.4, 0.4)],
                                  best_heldout_accuracy=0.5, step=20, wall_seconds=3.0, reward_curve=[(1, 0.5)],
                                  decisions=[], stopped=None)
    rep = write_report(tmp_path, state)
    assert rep["heldout_series"]["heldout/pass@2"][-1] == {"step": 20, "value": 0.625}
    assert json.loads((tmp_path / "report.json").read_text())["heldout_accuracy_after"] == 0.4


def test_no_metrics_no_series(tmp_path):
    assert heldout_series(tmp_path) == {} and rise_lines({}, 0.0, None) == []


def _outcomes(right: int, n: int, prefix: str = "p") -> SetOutcomes:
    return SetOutcomes(tuple(f"{prefix}{i}" for i in range(n)), (1,) * n, (1,) * right + (0,) * (n - right))


def test_two_held_out_sets_with_per_problem_outcomes(tmp_path):
    # 10 problems per set. In-distribution: 0 right at step 0, 5 at step 5 (paired rise = Binomial(10, 1/2) / 10
    # -> 95% interval [0.2, 0.8], see test_intervals.py). Unseen: 2 -> 2 right, the same two (rise exactly 0).
    _write_metrics(tmp_path, [
        {"step": 0, "heldout/accuracy": 0.0, "heldout_unseen/accuracy": 0.2, "heldout_unseen_notool/accuracy": 0.1,
         "heldout_unseen/hidden/accuracy": 0.2},  # eval.hidden_verifier's figure: not a set of its own
        {"step": 5, "heldout/accuracy": 0.5, "heldout_unseen/accuracy": 0.2, "heldout_unseen_notool/accuracy": 0.1},
    ])
    append_outcomes(tmp_path, 0, {"heldout": _outcomes(0, 10), "heldout_unseen": _outcomes(2, 10, "u")})
    append_outcomes(tmp_path, 5, {"heldout": _outcomes(4, 10), "heldout_unseen": _outcomes(2, 10, "u")})
    append_outcomes(tmp_path, 5, {"heldout": _outcomes(5, 10)})  # a resumed run redid step 5: the last line counts
    with open(tmp_path / OUTCOMES_FILE, "a") as fh:
        fh.write('{"step": 9, "set": "heldout", "prompt_ids": ["p0"')  # torn by a crash
    assert read_outcomes(tmp_path)["heldout"][5].correct == (1,) * 5 + (0,) * 5
    series = heldout_series(tmp_path)
    assert list(series) == ["heldout/accuracy", "heldout_unseen/accuracy"]
    lines = rise_lines(series, 0.0, None)
    assert lines == [
        "in-distribution held-out accuracy (greedy): step 0 0.000 -> step 5 0.500 (+50.0 points, 95% CI +20.0..+80.0; "
        "best 0.500 at step 5)",
        "unseen held-out accuracy (greedy): step 0 0.200 -> step 5 0.200 (+0.0 points, 95% CI +0.0..+0.0; "
        "best 0.200 at step 0)"]
    first, unseen = accuracy_summaries(series, 0.0, None)
    assert first.first.interval is not None and (first.first.interval.low, first.first.interval.high) == (0.0, 0.0)
    assert first.last.interval is not None and first.last.interval.low == pytest.approx(0.2)
    assert first.rise is not None and first.rise.high == pytest.approx(0.8) and first.note == ""
    js = summaries_json([unseen])[0]
    assert js["key"] == "heldout_unseen/accuracy" and js["rise_interval"] == [0.0, 0.0]
    assert js["first"]["problems"] == 10


def test_outcomes_that_do_not_match_the_metrics_give_no_interval(tmp_path):
    _write_metrics(tmp_path, [{"step": 0, "heldout/accuracy": 0.25}, {"step": 3, "heldout/accuracy": 0.5}])
    append_outcomes(tmp_path, 0, {"heldout": _outcomes(1, 4)})
    append_outcomes(tmp_path, 3, {"heldout": _outcomes(2, 4, "q")})  # other problems than at step 0
    (a,) = accuracy_summaries(heldout_series(tmp_path), 0.0, None)
    assert a.first.interval is not None and a.rise is None and "different problems" in a.note
    append_outcomes(tmp_path, 3, {"heldout": _outcomes(3, 4)})  # 0.75: not the logged 0.5
    (a,) = accuracy_summaries(heldout_series(tmp_path), 0.0, None)
    assert a.last.interval is None and a.rise is None and a.note == NO_OUTCOMES
