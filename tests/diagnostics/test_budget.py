"""Budget-matched accuracy and the confidence interval of a difference, by hand."""

from __future__ import annotations

import pytest

from posttrain.diagnostics.budget import accuracy_at, difference, run_curve, t_critical

METRICS = [
    {"step": 0, "heldout/accuracy": 0.1},
    {"step": 1, "tokens/generated": 100.0, "time/step_s": 1.0},
    {"step": 2, "tokens/generated": 100.0, "time/step_s": 1.0, "heldout/accuracy": 0.3},
    {"step": 3, "tokens/generated": 200.0, "time/step_s": 2.0},
    {"step": 4, "tokens/generated": 100.0, "time/step_s": 1.0, "heldout/accuracy": 0.6},
]


def test_run_curve_cumulates_before_each_evaluation() -> None:
    c = run_curve(METRICS)
    assert c.steps == [0, 2, 4]
    assert c.tokens == [0.0, 200.0, 500.0]
    assert c.seconds == [0.0, 2.0, 5.0]
    assert (c.total_tokens, c.total_seconds) == (500.0, 5.0)


def test_accuracy_at_budget_is_last_evaluation_within_it() -> None:
    c = run_curve(METRICS)
    assert accuracy_at(c, 199) == 0.1
    assert accuracy_at(c, 200) == 0.3
    assert accuracy_at(c, 499) == 0.3  # no interpolation towards the step-4 evaluation
    assert accuracy_at(c, 500) == 0.6
    assert accuracy_at(c, 501) is None  # the run never spent that much
    assert accuracy_at(c, 2.5, axis="seconds") == 0.3


def test_paired_difference() -> None:
    # seeds 0, 1: differences 0.1 and 0.3 -> mean 0.2, sd sqrt(0.02), se 0.1, t(1) = 12.706
    d = difference({0: 0.5, 1: 0.4}, {0: 0.6, 1: 0.7})
    assert d is not None and d.mean == pytest.approx(0.2)
    assert d.low == pytest.approx(0.2 - 1.2706) and d.high == pytest.approx(0.2 + 1.2706)
    assert d.method.startswith("paired")


def test_welch_difference_and_degenerate_cases() -> None:
    # a = (0.2, 0.4): mean 0.3, var 0.02; b = (0.5, 0.7, 0.9): mean 0.7, var 0.04
    # va = 0.01, vb = 0.04/3; se = sqrt(0.07/3); df = (0.07/3)^2 / (0.01^2 / 1 + (0.04/3)^2 / 2)
    # = 5.444e-4 / 1.889e-4 = 2.88 -> 2, t(2) = 4.303
    d = difference({0: 0.2, 1: 0.4}, {5: 0.5, 6: 0.7, 7: 0.9})
    assert d is not None and d.mean == pytest.approx(0.4)
    assert d.high == pytest.approx(0.4 + 4.303 * (0.07 / 3) ** 0.5)
    assert d.method == "Welch t, df 2"
    one = difference({0: 0.2}, {0: 0.5})
    assert one is not None and one.low is None and one.mean == pytest.approx(0.3)
    assert difference({}, {0: 0.5}) is None
    assert t_critical(1) == 12.706 and t_critical(100) == 1.96
