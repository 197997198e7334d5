"""Chunked entropy against torch.distributions.Categorical (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos.entropy import entropy_from_logits


def test_matches_categorical_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    got = entropy_from_logits(logits, chunk_size=4)  # 15 rows, chunks of 4: last chunk ragged
    ref = torch.distributions.Categorical(logits=ref_logits).entropy()
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, ref)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_gradcheck_through_checkpointed_chunks() -> None:
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=2), (logits,))


def test_stability_and_known_values() -> None:
    # uniform over V=7 -> log 7; one-hot-like huge logits -> ~0 (finite, no NaN from log 0)
    uniform = entropy_from_logits(torch.zeros(2, 7))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(7.0)))
    peaked = entropy_from_logits(torch.tensor([[1e4, 0.0, -1e4], [-1e30, 0.0, 0.0]]))
    assert bool(torch.isfinite(peaked).all())
    torch.testing.assert_close(peaked, torch.tensor([0.0, math.log(2.0)]))


def test_half_precision_computed_in_float32_and_no_grad_path() -> None:
    z = torch.randn(6, 9)
    got = entropy_from_logits(z.to(torch.bfloat16))
    assert got.dtype == torch.float32
    ref = torch.distributions.Categorical(logits=z.to(torch.bfloat16).float()).entropy()
    torch.testing.assert_close(got, ref)
    with torch.no_grad():
        torch.testing.assert_close(
            entropy_from_logits(z, chunk_size=1), torch.distributions.Categorical(logits=z).entropy()
        )
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(z, chunk_size=0)
