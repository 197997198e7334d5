"""The SFT cross-entropy (posttrain/algos/sft.py) on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos.sft import sft_cross_entropy, token_logprobs

D = torch.float64


def test_token_mean_over_the_masked_tokens_of_a_two_row_batch() -> None:
    # row 0 targets: lp -1, -2; row 1 target: lp -0.5 -> L = (1 + 2 + 0.5) / 3
    lp = torch.tensor([[0.0, -1.0, -2.0, -9.0], [0.0, -0.5, -7.0, -7.0]], dtype=D)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    assert float(sft_cross_entropy(lp, mask)) == pytest.approx(3.5 / 3, abs=1e-15)
    # a micro-batch of a larger batch: the batch's count (7 target tokens) is the denominator
    assert float(sft_cross_entropy(lp, mask, num_tokens=7)) == pytest.approx(0.5, abs=1e-15)


def test_every_target_token_weighs_the_same() -> None:
    # token mean, not a mean of row means: (1 + 1 + 1 + 4) / 4, where row means would give (1 + 2.5) / 2
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-4.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(sft_cross_entropy(lp, mask)) == pytest.approx(7 / 4, abs=1e-15)


def test_masked_positions_reach_neither_value_nor_gradient() -> None:
    lp = torch.tensor([[-1.0, -math.inf, float("nan")]], dtype=D, requires_grad=True)
    loss = sft_cross_entropy(lp, torch.tensor([[1, 0, 0]]))
    loss.backward()  # type: ignore[no-untyped-call]
    assert float(loss.detach()) == 1.0
    assert lp.grad is not None and lp.grad.tolist() == [[-1.0, 0.0, 0.0]]


def test_token_logprobs_shift_by_one() -> None:
    # V = 2; the logits at position t score token t + 1; position 0 is no target (0)
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(4.0), 0.0], [5.0, 5.0]]], dtype=D)
    ids = torch.tensor([[0, 1, 0]])
    lp = token_logprobs(logits, ids)
    assert lp[0].tolist() == pytest.approx([0.0, math.log(3 / 4), math.log(4 / 5)], abs=1e-15)


def test_bad_inputs_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"both be \[B, T\]"):
        sft_cross_entropy(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="no target token"):
        sft_cross_entropy(torch.zeros(1, 3), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="only 0/1"):
        sft_cross_entropy(torch.zeros(1, 2), torch.tensor([[0, 2]]))
