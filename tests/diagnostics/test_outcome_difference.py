"""The paired accuracy difference of two runs' per-problem outcomes, and where on a budget curve a target is
reached, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.diagnostics.budget import run_curve
from posttrain.diagnostics.heldout_outcomes import SetOutcomes
from posttrain.diagnostics.outcome_difference import paired_difference
from posttrain.diagnostics.reach import Reach, first_reach, metric_by_step, step_at, teacher_metric


def outcomes(correct: dict[str, int], valid: int = 1) -> SetOutcomes:
    """One greedy (or ``valid``-sample) evaluation: ``{prompt id: correct samples}``."""
    return SetOutcomes(tuple(correct), tuple(valid for _ in correct), tuple(correct.values()))


def test_problems_are_paired_by_prompt_id_and_the_rest_left_out() -> None:
    # Per-problem differences (other - baseline) on p1..p4: 0, +1, 0, 0 -> +0.25. p5 (other only) and
    # p6 (baseline only) are not paired. Bootstrap of 4 problems: the mean difference is k/4 with
    # k ~ Binomial(4, 1/4): P(k = 0) = 0.32 > 0.025 -> low 0; P(k >= 3) = 0.051 > 0.025 >= P(k = 4) =
    # 0.004 -> high 3/4.
    base = outcomes({"p1": 1, "p2": 0, "p3": 0, "p4": 1, "p6": 1})
    other = outcomes({"p5": 1, "p4": 1, "p3": 0, "p2": 1, "p1": 1})  # another order
    iv = paired_difference([(base, other)])
    assert (iv.estimate, iv.n) == (pytest.approx(0.25), 4)
    assert (iv.low, iv.high) == (pytest.approx(0.0), pytest.approx(0.75))


def test_identical_outcomes_differ_by_exactly_zero() -> None:
    o = outcomes({"p1": 1, "p2": 0, "p3": 1})
    iv = paired_difference([(o, o)])
    assert (iv.estimate, iv.low, iv.high, iv.n) == (0.0, 0.0, 0.0, 3)


def test_seeds_are_pooled_per_prompt_not_averaged() -> None:
    # Seed 0: baseline p1 right, p2 wrong; other both right. Seed 1: baseline both wrong; other p1 right.
    # Pooled per prompt (valid, correct): baseline p1 (2, 1), p2 (2, 0); other p1 (2, 2), p2 (2, 1):
    # accuracy 1/4 -> 3/4, +0.5. Each prompt's own difference is +0.5 (1 - 1/2, 1/2 - 0), so every
    # resample gives +0.5: a zero-width interval over n = 2 prompts (not 4 problem-seeds).
    seed0 = (outcomes({"p1": 1, "p2": 0}), outcomes({"p1": 1, "p2": 1}))
    seed1 = (outcomes({"p1": 0, "p2": 0}), outcomes({"p1": 1, "p2": 0}))
    iv = paired_difference([seed0, seed1])
    assert (iv.estimate, iv.low, iv.high, iv.n) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5), 2)


def test_sampled_evaluations_weigh_problems_by_their_judged_samples() -> None:
    # 2 samples per problem, one infra error (valid 1) on the other side's p2: baseline 1/4, other 3/3.
    base = SetOutcomes(("p1", "p2"), (2, 2), (1, 0))
    other = SetOutcomes(("p1", "p2"), (2, 1), (2, 1))
    assert paired_difference([(base, other)]).estimate == pytest.approx(1.0 - 0.25)


def test_no_common_prompt_gives_no_estimate() -> None:
    iv = paired_difference([(outcomes({"p1": 1}), outcomes({"p2": 1}))])
    assert iv.n == 0 and iv.estimate != iv.estimate  # NaN


METRICS = [
    {"step": 0, "heldout/accuracy": 0.1, "heldout_unseen/accuracy": 0.1},
    {"step": 1, "tokens/generated": 100.0, "time/step_s": 1.0, "heldout_unseen/accuracy": 0.9},  # no heldout/*: not
    {"step": 2, "tokens/generated": 100.0, "time/step_s": 1.0, "heldout/accuracy": 0.3,      # an evaluation step
     "heldout_unseen/accuracy": 0.3},
    {"step": 3, "tokens/generated": 200.0, "time/step_s": 2.0},
    {"step": 4, "tokens/generated": 100.0, "time/step_s": 1.0, "heldout/accuracy": 0.6,
     "heldout_unseen/accuracy": 0.6},
]


def test_step_at_budget_is_the_evaluation_accuracy_at_reads() -> None:
    c = run_curve(METRICS)  # evaluations at steps 0, 2, 4 after 0, 200, 500 tokens
    assert [step_at(c, b) for b in (0, 199, 200, 499, 500, 501)] == [0, 0, 2, 2, 4, None]


def test_first_reach_is_the_first_evaluation_at_or_above_the_target() -> None:
    c = run_curve(METRICS)
    unseen = metric_by_step(METRICS, "heldout_unseen/accuracy")
    assert first_reach(c, unseen, 0.5) == Reach(step=4, value=0.6, tokens=500.0, seconds=5.0)
    assert first_reach(c, unseen, 0.3) == Reach(step=2, value=0.3, tokens=200.0, seconds=2.0)  # at counts
    assert first_reach(c, unseen, 0.61) is None
    assert first_reach(c, metric_by_step(METRICS, "no/such_key"), 0.0) is None


def write_teacher_run(root: Path, step: int, value: float) -> Path:
    """A run directory with ``metrics.jsonl`` and an (empty) checkpoint at ``step``; its ``actor/``."""
    actor = root / "checkpoints" / f"step_{step:08d}" / "actor"
    actor.mkdir(parents=True)
    (actor.parent / "meta.json").write_text(json.dumps({"format": 1, "step": step, "extra": {}}))
    rows = [{"step": 0, "heldout_unseen/accuracy": 0.2}, {"step": step, "heldout_unseen/accuracy": value}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return actor


def test_teacher_metric_is_its_runs_evaluation_at_the_checkpoint_step(tmp_path: Path) -> None:
    actor = write_teacher_run(tmp_path / "rl", 20, 0.55)
    value, where = teacher_metric(str(actor), "heldout_unseen/accuracy")  # type: ignore[misc]
    assert value == 0.55 and where.endswith("metrics.jsonl, step 20")
    assert teacher_metric(str(actor), "heldout/accuracy") is None  # not evaluated there
    assert teacher_metric("builtin:tiny", "heldout_unseen/accuracy") is None
    assert teacher_metric(str(tmp_path / "rl"), "heldout_unseen/accuracy") is None  # a run dir, not a checkpoint
