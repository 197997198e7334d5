"""Loss reductions: hand numbers on a ragged batch, length weighting, micro-batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos import REDUCTIONS
from posttrain.algos.advantages import AdvantageInputs, grpo
from posttrain.algos.reductions import reduce_loss, seq_mean_token_mean, token_mean

D = torch.float64
NAN = math.nan

# Ragged batch: row lengths 1, 3, 0, 2 (row 2 has no action token at all).
MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=D)
# Masked-out positions hold NaN: they must never reach the loss.
LOSS = torch.tensor([[2, NAN, NAN, NAN], [1, 2, 3, NAN], [NAN, NAN, NAN, NAN], [4, 6, NAN, NAN]], dtype=D)


def test_every_registered_name_is_covered_here() -> None:
    assert sorted(REDUCTIONS) == [
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
        "token_mean",
    ]


@pytest.mark.parametrize(
    ("name", "kw", "expected"),
    [
        # 6 action tokens summing to 2+1+2+3+4+6 = 18 -> 18/6 = 3.0
        ("token_mean", {}, 3.0),
        # row means 2, 2, (empty row: weight 0), 5 -> (2+2+0+5)/B=4 = 2.25 (the empty row counts in B)
        ("seq_mean_token_mean", {}, 2.25),
        # row sums 2, 6, 0, 10 -> 18/4 = 4.5
        ("seq_mean_token_sum", {}, 4.5),
        # 18 / (B * L_max) = 18 / (4 * 5) = 0.9
        ("seq_mean_token_sum_norm", {"max_len": 5}, 0.9),
    ],
)
def test_each_reduction_on_a_ragged_batch(name: str, kw: dict[str, int], expected: float) -> None:
    got = reduce_loss(LOSS, MASK, name, **kw)
    assert torch.isfinite(got)
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_weights_by_hand() -> None:
    # seq_mean_token_mean: 1/(len_i * B): row0 1/4, row1 1/12, row2 0, row3 1/8
    w = seq_mean_token_mean(MASK)
    expected = torch.tensor(
        [[1 / 4, 0, 0, 0], [1 / 12, 1 / 12, 1 / 12, 0], [0, 0, 0, 0], [1 / 8, 1 / 8, 0, 0]], dtype=D
    )
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(token_mean(MASK), MASK / 6)
    assert bool((token_mean(torch.zeros(2, 3)) == 0).all())


def test_sum_norm_requires_the_budget_and_global_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="max_len"):
        REDUCTIONS["seq_mean_token_sum_norm"](MASK)
    with pytest.raises(ValueError, match="num_sequences"):
        REDUCTIONS["seq_mean_token_sum"](MASK, num_sequences=2)
    with pytest.raises(ValueError, match="num_tokens"):
        REDUCTIONS["token_mean"](MASK, num_tokens=3)
    with pytest.raises(KeyError, match="token_mean"):
        reduce_loss(LOSS, MASK, "no_such_reduction")


@pytest.mark.parametrize(
    ("name", "ratio"),
    [
        ("seq_mean_token_mean", 1.0),  # length-neutral: each row weighs 1/B
        ("token_mean", 5.0),  # says so: a row's weight is len_i / N_tokens
        ("seq_mean_token_sum", 5.0),  # says so: len_i / B
        ("seq_mean_token_sum_norm", 5.0),  # says so: len_i / (B * L_max)
    ],
)
def test_sequence_reward_broadcast_is_length_weighted_only_where_the_reduction_says_so(
    name: str, ratio: float
) -> None:
    # Two answers of lengths 1 and 5 with the same sequence advantage (two groups, each a
    # correct vs. wrong pair, so both correct answers get the same A). The estimator broadcasts
    # A unchanged to every token (never A*len, never A/len) ...
    mask = torch.zeros(4, 5, dtype=D)
    mask[0, :1] = 1
    mask[1, :5] = 1
    mask[2, :1] = 1
    mask[3, :5] = 1
    out = grpo(
        AdvantageInputs(
            action_mask=mask,
            rewards=torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=D),
            group_index=torch.tensor([0, 1, 0, 1]),
        )
    )
    adv = out.advantages
    assert bool((adv[0, :1] == adv[1, :5]).all())
    # ... and the policy-gradient loss -A at ratio 1 reduced: each row's total contribution.
    per_token = -adv
    contrib = [
        reduce_loss(torch.where(torch.arange(4)[:, None] == i, per_token, 0.0), mask, name, max_len=8)
        for i in range(2)
    ]
    assert (contrib[1] / contrib[0]).item() == pytest.approx(ratio, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), b=st.integers(1, 7), t=st.integers(1, 6), name=st.sampled_from(sorted(REDUCTIONS)))
def test_micro_batch_split_with_global_counts_equals_full_batch(
    data: st.DataObject, b: int, t: int, name: str
) -> None:
    bits = data.draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    vals = data.draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=D).reshape(b, t)
    loss = torch.tensor(vals, dtype=D).reshape(b, t)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, b - 1), max_size=3)) if b > 1 else []))
    bounds = [0, *cuts, b]
    kw = {"num_sequences": b, "num_tokens": float(mask.sum()), "max_len": 6}
    full = reduce_loss(loss, mask, name, max_len=6)
    parts = sum(
        reduce_loss(loss[lo:hi], mask[lo:hi], name, **kw)  # type: ignore[arg-type]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    )
    assert float(parts) == pytest.approx(float(full), abs=1e-10)


def test_gradient_does_not_leak_through_masked_positions() -> None:
    # Finite garbage (huge values) off the mask: zero gradient there, unchanged loss.
    garbage = torch.where(torch.isnan(LOSS), torch.full_like(LOSS, 1e30), LOSS)
    x = torch.zeros_like(LOSS, requires_grad=True)
    loss = reduce_loss(garbage * (1 + x), MASK, "token_mean")
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    assert x.grad is not None
    # d/dx_it of sum_it L_it (1 + x_it) w_it = L_it * w_it: row1 token0 = 1 * 1/6
    assert x.grad[1, 0].item() == pytest.approx(1 / 6)
    assert bool((x.grad[MASK == 0] == 0).all())
