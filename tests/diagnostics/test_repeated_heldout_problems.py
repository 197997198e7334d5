"""A held-out set that repeats problems: each problem is one unit of the bootstrap, on every path.

A task with fewer distinct held-out problems than ``eval.size`` fills the set with repeats
(``sample_unique``; a file task cycles its rows): ``chain_sum`` with ``terms: 2`` has 25 distinct
held-out problems, so ``eval.size=200`` evaluates each about 8 times. ``posttrain compare`` already summed
a problem's samples into one unit, but the run's end-of-run lines, ``posttrain report`` and ``posttrain
eval``'s ``intervals_95`` resampled every repeat as if it were another problem, so their intervals were too
narrow (by about the square root of the repeat count). The recorded outcomes now hold one entry per
problem (repeats summed), and outcomes recorded before are merged when read.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.diagnostics.heldout_outcomes import SetOutcomes, read_outcomes
from posttrain.diagnostics.intervals import accuracy_interval
from posttrain.envs.task import TaskExample
from posttrain.evaluation.report import accuracy_summaries, heldout_series
from posttrain.loop.heldout import EvalResult, outcomes_of

# 4 problems a..d, each evaluated 5 times greedily (identical verdicts): a and b right, c and d wrong.
IDS = ["a", "b", "c", "d"] * 5
RIGHT = {"a", "b"}


def _result(ids: list[str]) -> EvalResult:
    per = tuple((1, int(i in RIGHT)) for i in ids)
    acc = sum(c for _, c in per) / len(per)
    return EvalResult(accuracy=acc, reward_mean=acc, mean_length=1.0, status_counts={}, n=len(ids), per_prompt=per)


def test_outcomes_of_a_set_with_repeats_hold_one_entry_per_problem() -> None:
    examples = [TaskExample(prompt_id=i, prompt=i, reference=None) for i in IDS]
    o = outcomes_of(_result(IDS), examples)
    # hand-computed: 5 judged samples per problem, 5 correct for a and b
    assert o == SetOutcomes(("a", "b", "c", "d"), (5, 5, 5, 5), (5, 5, 0, 0))
    assert o.accuracy == 0.5  # the logged accuracy (a mean over all 20 samples) is unchanged


def _write_run(run_dir: Path, ids: list[str], acc_last: float, right_last: set[str]) -> None:
    run_dir.mkdir()
    rows = [{"step": 0, "heldout/accuracy": 0.5}, {"step": 2, "heldout/accuracy": acc_last}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [{"step": 0, "set": "heldout", "accuracy": 0.5, "prompt_ids": ids, "valid": [1] * len(ids),
              "correct": [int(i in RIGHT) for i in ids]},
             {"step": 2, "set": "heldout", "accuracy": acc_last, "prompt_ids": ids, "valid": [1] * len(ids),
              "correct": [int(i in right_last) for i in ids]}]
    (run_dir / "heldout_outcomes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_a_recorded_set_with_repeats_is_read_per_problem(tmp_path: Path) -> None:
    # a run recorded before the fix: 20 entries for 4 problems
    _write_run(tmp_path / "run", IDS, 0.75, {"a", "b", "c"})
    o = read_outcomes(tmp_path / "run")["heldout"][2]
    assert o == SetOutcomes(("a", "b", "c", "d"), (5, 5, 5, 5), (5, 5, 5, 0)) and o.accuracy == 0.75


def test_report_intervals_resample_problems_not_repeats(tmp_path: Path) -> None:
    _write_run(tmp_path / "rep", IDS, 0.75, {"a", "b", "c"})
    _write_run(tmp_path / "once", ["a", "b", "c", "d"], 0.75, {"a", "b", "c"})
    rep = accuracy_summaries(heldout_series(tmp_path / "rep"), 0.0, None)[0]
    once = accuracy_summaries(heldout_series(tmp_path / "once"), 0.0, None)[0]
    # the same 4 problems: the same intervals whether each was evaluated once or 5 times
    assert rep.last.interval == once.last.interval and rep.rise == once.rise
    assert rep.last.interval is not None and rep.last.interval.n == 4
    # what the old code computed: 20 "problems", an interval narrower than the 4 problems support
    narrow = accuracy_interval([1] * 20, [int(i in {"a", "b", "c"}) for i in IDS])
    assert narrow.high - narrow.low < rep.last.interval.high - rep.last.interval.low
