"""Bootstrap percentile intervals of held-out accuracy and of its paired rise, against hand-computed cases."""

import math
import random

import pytest

from posttrain.diagnostics.intervals import accuracy_interval, rise_interval


def ones(k: int, n: int) -> tuple[list[int], list[int]]:
    """``(valid, correct)`` of ``n`` greedy problems, the first ``k`` right."""
    return [1] * n, [1] * k + [0] * (n - k)


@pytest.mark.parametrize("k", [0, 7])
def test_all_equal_outcomes_give_a_zero_width_interval(k):
    iv = accuracy_interval(*ones(k, k or 7))
    assert (iv.estimate, iv.low, iv.high, iv.n) == (k / (k or 7), k / (k or 7), k / (k or 7), k or 7)


def test_ten_problems_half_right_against_the_exact_bootstrap_distribution():
    # The bootstrap mean of 10 problems, 5 right, is Binomial(10, 1/2) / 10 exactly:
    # P(X <= 1) = 11/1024 = 0.011 and P(X <= 2) = 56/1024 = 0.055, so the 2.5% quantile is 0.2; by
    # symmetry the 97.5% one is 0.8. (Normal approximation: 0.5 +- 1.96 * sqrt(0.25 / 10) = [0.19, 0.81].)
    iv = accuracy_interval(*ones(5, 10))
    assert (iv.estimate, iv.low, iv.high) == (0.5, pytest.approx(0.2), pytest.approx(0.8))


def test_three_problems_one_right_against_the_exact_bootstrap_distribution():
    # Right answers in a resample ~ Binomial(3, 1/3): P(0) = 8/27 > 2.5%, P(<= 2) = 26/27 < 97.5%.
    iv = accuracy_interval(*ones(1, 3))
    assert (iv.low, iv.high) == (0.0, 1.0)


def test_problems_with_several_samples_count_once_and_unjudged_ones_not_at_all():
    # Accuracy is correct samples over judged samples (the evaluation's figure): (4 + 0 + 2) / (4 + 4 + 4).
    iv = accuracy_interval([4, 4, 4, 0], [4, 0, 2, 0])
    assert iv.estimate == pytest.approx(0.5) and iv.n == 3
    assert 0.0 <= iv.low < 0.5 < iv.high <= 1.0
    nothing = accuracy_interval([0, 0], [0, 0])
    assert nothing.n == 0 and math.isnan(nothing.estimate) and math.isnan(nothing.low)


def test_same_seed_same_interval_other_seed_close():
    a, b = accuracy_interval(*ones(37, 80), seed=3), accuracy_interval(*ones(37, 80), seed=3)
    c = accuracy_interval(*ones(37, 80), seed=4)
    assert a == b
    assert abs(a.low - c.low) <= 0.03 and abs(a.high - c.high) <= 0.03


def test_the_interval_contains_the_estimate_on_random_outcomes():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randrange(20, 120)
        p = rng.uniform(0.1, 0.9)
        correct = [int(rng.random() < p) for _ in range(n)]
        iv = accuracy_interval([1] * n, correct, resamples=500, seed=rng.randrange(1000))
        assert iv.low <= iv.estimate <= iv.high, (n, sum(correct), iv)


def test_width_shrinks_like_one_over_sqrt_n():
    # Four times the problems at the same accuracy: half the width (normal approximation: 2 * 1.96 *
    # sqrt(p (1 - p) / n) = 0.196 at n = 100, 0.098 at n = 400).
    w100 = accuracy_interval(*ones(50, 100)).high - accuracy_interval(*ones(50, 100)).low
    w400 = accuracy_interval(*ones(200, 400)).high - accuracy_interval(*ones(200, 400)).low
    assert w100 == pytest.approx(0.196, abs=0.02) and w400 == pytest.approx(0.098, abs=0.01)
    assert 1.7 <= w100 / w400 <= 2.3


def test_the_rise_of_identical_evaluations_is_exactly_zero():
    rng = random.Random(1)
    first = ([1] * 50, [int(rng.random() < 0.4) for _ in range(50)])
    iv = rise_interval(first, first)
    assert (iv.estimate, iv.low, iv.high, iv.n) == (0.0, 0.0, 0.0, 50)


def test_paired_rise_against_the_exact_bootstrap_distribution():
    # First evaluation all wrong, last right on 5 of 10: each resample's rise is its accuracy on the last,
    # Binomial(10, 1/2) / 10 as above -> [0.2, 0.8].
    iv = rise_interval(ones(0, 10), ones(5, 10))
    assert (iv.estimate, iv.low, iv.high) == (0.5, pytest.approx(0.2), pytest.approx(0.8))


def test_pairing_narrows_the_interval_of_a_rise_on_shared_problems():
    # 60 problems, 30 right at first; the last evaluation keeps them and gets 6 more. Paired, the rise is
    # 6 problems flipping (0.1, interval well above zero); unpaired (two independent accuracies of 60
    # problems) its interval would be about +-0.18 wide and include zero.
    first, last = ones(30, 60), ones(36, 60)
    iv = rise_interval(first, last)
    assert iv.estimate == pytest.approx(0.1)
    assert 0.0 < iv.low < 0.1 < iv.high < 0.2


def test_rise_keeps_problems_judged_in_both_and_refuses_other_problems():
    iv = rise_interval(([1, 1, 0], [1, 0, 0]), ([1, 0, 1], [1, 0, 0]))
    assert iv.n == 1 and (iv.estimate, iv.low, iv.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same problems"):
        rise_interval(ones(1, 3), ones(1, 4))
    with pytest.raises(ValueError, match="correct <= valid"):
        accuracy_interval([1, 1], [2, 0])
