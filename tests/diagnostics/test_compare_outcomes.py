"""``posttrain compare`` on runs that recorded per-problem outcomes: the paired interval per held-out set at
the budget, and ``--target`` (tokens and seconds to reach an accuracy, the teacher's included), by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from posttrain.commands import compare
from posttrain.commands.compare_outcomes import parse_target
from posttrain.diagnostics.heldout_outcomes import SetOutcomes, append_outcomes
from tests.diagnostics.synthetic import CONFIG, write_run
from tests.diagnostics.test_commands import parse
from tests.diagnostics.test_outcome_difference import outcomes, write_teacher_run


def metrics(accs: list[float], tokens: float) -> list[dict[str, Any]]:
    """Evaluations at steps 0, 1, 2 with ``accs``; each step generates ``tokens`` in 10 s."""
    return [{"step": s, "heldout/accuracy": a, **({"tokens/generated": tokens, "time/step_s": 10.0} if s else {})}
            for s, a in enumerate(accs)]


def run_with_outcomes(root: Path, accs: list[float], tokens: float, by_step: dict[int, dict[str, SetOutcomes]],
                      **cfg: Any) -> Path:
    write_run(root, metrics=metrics(accs, tokens), config={**CONFIG, **cfg})
    for step, sets in by_step.items():
        append_outcomes(root, step, sets)
    return root


def test_compare_pairs_the_outcomes_each_run_holds_at_the_budget(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # Baseline A generates 100 tokens per step, B 50: at a budget of 100 tokens A holds its step-1
    # evaluation and B its step-2 one. Their heldout outcomes there differ on p2 only (+1 of 4: +0.25,
    # bootstrap [0, 0.75] as in test_outcome_difference); the decoys at the other steps would give -0.5.
    decoy = {"heldout": outcomes({"p1": 0, "p2": 0, "p3": 0, "p4": 0})}
    a = run_with_outcomes(tmp_path / "A", [0.1, 0.5, 0.6], 100.0,
                          {0: decoy, 1: {"heldout": outcomes({"p1": 1, "p2": 0, "p3": 0, "p4": 1}),
                                         "heldout_unseen": outcomes({"q1": 1, "q2": 0})}, 2: decoy})
    b = run_with_outcomes(tmp_path / "B", [0.1, 0.6, 0.75], 50.0,
                          {1: decoy, 2: {"heldout": outcomes({"p4": 1, "p3": 0, "p2": 1, "p1": 1})}},
                          optim={"lr": 0.01})
    c = write_run(tmp_path / "C", metrics=metrics([0.1, 0.2, 0.3], 50.0), config={**CONFIG, "optim": {"lr": 0.1}})
    args = parse(compare, ["compare", str(a), str(b), str(c), "--budget-tokens", "100", "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "B - A, heldout: +0.250, 95% CI [+0.000, +0.750] (4 problems, seeds [0], steps A [1] / B [2])" in out
    assert "B - A, heldout_unseen: no interval: outcomes not recorded" in out  # B evaluated no unseen set
    assert "C - A, heldout: no interval: outcomes not recorded" in out
    res = json.loads((tmp_path / "out" / "compare.json").read_text())["paired_intervals"]
    assert res["B"]["heldout"]["estimate"] == pytest.approx(0.25) and res["B"]["heldout"]["n"] == 4
    assert res["C"]["heldout"] == {"none": "outcomes not recorded"}
    # At 150 tokens A holds step 1; B (100 tokens in all) cannot speak for that budget.
    args = parse(compare, ["compare", str(a), str(b), "--budget-tokens", "150", "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert "B - A, heldout: no interval: a run has no evaluation within the budget" in capsys.readouterr().out


def test_several_seeds_are_paired_by_seed_and_pooled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The pooled case of test_outcome_difference: seeds 0 and 1 of each recipe, +0.5 on both prompts.
    sides = {"A": [{"p1": 1, "p2": 0}, {"p1": 0, "p2": 0}], "B": [{"p1": 1, "p2": 1}, {"p1": 1, "p2": 0}]}
    for lab, per_seed in sides.items():
        for seed, correct in enumerate(per_seed):
            run_with_outcomes(tmp_path / lab / f"seed{seed}", [0.1, 0.5, 0.5], 100.0,
                              {2: {"heldout": outcomes(correct)}}, seed=seed)
    args = parse(compare, ["compare", str(tmp_path / "A"), str(tmp_path / "B"), "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert "B - A, heldout: +0.500, 95% CI [+0.500, +0.500] (2 problems, seeds [0, 1]" in capsys.readouterr().out


def test_target_reports_tokens_and_seconds_to_reach_it_and_the_teachers_accuracy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A: 0.1, 0.5, 0.6 at 0, 100, 200 tokens (0, 10, 20 s). B distils from a teacher whose run recorded
    # heldout/accuracy 0.55 at its step-20 checkpoint: B (0.1, 0.6, 0.75 at 0, 50, 100 tokens) reaches
    # 0.55 at step 1 (50 tokens, 10 s), A at step 2 (200 tokens, 20 s).
    actor = write_teacher_run(tmp_path / "rl", 20, 0.55)
    rows = (tmp_path / "rl" / "metrics.jsonl").read_text().replace("heldout_unseen/", "heldout/")
    (tmp_path / "rl" / "metrics.jsonl").write_text(rows)
    a = write_run(tmp_path / "A", metrics=metrics([0.1, 0.5, 0.6], 100.0))
    b = write_run(tmp_path / "B", metrics=metrics([0.1, 0.6, 0.75], 50.0),
                  config={**CONFIG, "loss": {"distill": {"teacher": str(actor), "coef": 1.0, "only": True}}})
    args = parse(compare, ["compare", str(a), str(b), "--budget-tokens", "100", "--out", str(tmp_path / "out"),
                           "--target", "heldout/accuracy=teacher", "--target", "heldout/accuracy=0.7"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"tokens to reach heldout/accuracy >= 0.550 (the teacher's, {tmp_path / 'rl'}/metrics.jsonl, step 20)" in out
    assert "A: 1 of 1 seeds reached it; mean 200 tokens, 20 s over those; seed 0: 200 tokens, 20 s (step 2, 0.600)" in out
    assert "B: 1 of 1 seeds reached it; mean 50 tokens, 10 s over those; seed 0: 50 tokens, 10 s (step 1, 0.600)" in out
    assert "A: 0 of 1 seeds reached it; seed 0: not reached" in out  # 0.7
    reach = json.loads((tmp_path / "out" / "compare.json").read_text())["tokens_to_reach"]
    assert reach["heldout/accuracy=teacher"]["target"] == 0.55
    assert reach["heldout/accuracy=0.7"]["runs"]["B"]["0"] == {"step": 2, "value": 0.75, "tokens": 100.0,
                                                              "seconds": 20.0}


def test_a_teacher_target_without_a_recorded_teacher_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "A", metrics=metrics([0.1, 0.5, 0.6], 100.0))
    b = write_run(tmp_path / "B", metrics=metrics([0.1, 0.6, 0.75], 50.0),
                  config={**CONFIG, "loss": {"distill": {"teacher": "builtin:tiny", "coef": 1.0, "only": True}}})
    args = parse(compare, ["compare", str(a), str(b), "--out", str(tmp_path / "out"), "--target",
                           "heldout/accuracy=teacher"])
    assert args.func(args) == 0
    assert "no target: heldout/accuracy of teacher builtin:tiny not recorded" in capsys.readouterr().out
    args = parse(compare, ["compare", str(a), str(a), "--out", str(tmp_path / "out"), "--target",
                           "heldout/accuracy=teacher"])
    assert args.func(args) == 0
    assert "no run distills from a teacher (loss.distill.teacher)" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["heldout/accuracy", "=0.5", "heldout/accuracy=high", "heldout/accuracy=nan"])
def test_a_malformed_target_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match=f"--target {bad}"):
        parse_target(bad)


def test_a_malformed_target_is_refused_before_anything_is_trained(tmp_path: Path) -> None:
    args = parse(compare, ["compare", "grpo", "demo", "--out", str(tmp_path / "out"), "--target", "heldout/accuracy"])
    with pytest.raises(ValueError, match="--target heldout/accuracy: expected KEY=VALUE"):
        args.func(args)
    assert not (tmp_path / "out").exists()
