"""DAPO soft overlong punishment and the effort/budget penalty, by hand."""

from __future__ import annotations

import pytest
import torch

from posttrain.algos.shaping import dapo_overlong_penalty, effort_penalty


def test_dapo_overlong_hand_values() -> None:
    # L_max = 10, L_cache = 4 -> soft window starts after 6 tokens.
    #   L=0, 6 -> 0;  L=7 -> (6-7)/4 = -0.25;  L=9 -> -0.75;  L=10 -> -1.0;  L=11 (> L_max) -> -1
    got = dapo_overlong_penalty(torch.tensor([0, 6, 7, 9, 10, 11]), max_len=10, cache_len=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0]))
    # Full-budget cache window: L_cache = L_max = 4 -> L=1 -> (0-1)/4 = -0.25
    assert dapo_overlong_penalty(torch.tensor([1]), 4, 4).item() == pytest.approx(-0.25)


def test_dapo_overlong_errors() -> None:
    with pytest.raises(ValueError, match="cache_len"):
        dapo_overlong_penalty(torch.tensor([1]), max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        dapo_overlong_penalty(torch.tensor([1]), max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="negative"):
        dapo_overlong_penalty(torch.tensor([-1]), max_len=10, cache_len=2)


def test_effort_penalty_hand_values() -> None:
    # tau = 1, b0 = 10: threshold 10 -> lengths 5, 10 fine, 11 penalised
    lengths = torch.tensor([5, 10, 11])
    budget = torch.tensor([10.0, 10.0, 10.0])
    torch.testing.assert_close(effort_penalty(lengths, budget, tau=1.0), torch.tensor([0.0, 0.0, -1.0]))
    # tau = 0.5: threshold 5 -> 5 fine (not strictly greater), 10 and 11 penalised
    torch.testing.assert_close(effort_penalty(lengths, budget, tau=0.5), torch.tensor([0.0, -1.0, -1.0]))
    # per-prompt budgets: b0 = [4, 20, 11], tau = 1 -> [-1, 0, 0]
    torch.testing.assert_close(
        effort_penalty(lengths, torch.tensor([4.0, 20.0, 11.0]), 1.0), torch.tensor([-1.0, 0.0, 0.0])
    )


def test_effort_penalty_errors() -> None:
    with pytest.raises(ValueError, match="tau"):
        effort_penalty(torch.tensor([1]), torch.tensor([1.0]), 0.0)
    with pytest.raises(ValueError, match="budget"):
        effort_penalty(torch.tensor([1]), torch.tensor([0.0]), 1.0)
    with pytest.raises(ValueError, match="must both be"):
        effort_penalty(torch.tensor([1, 2]), torch.tensor([1.0]), 1.0)
