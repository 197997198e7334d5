"""Clipped and unclipped value loss against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from posttrain.algos.value import value_loss

D = torch.float64


def test_clipped_value_loss_hand_values() -> None:
    # eps = 0.2
    # tok0: V=1.0, V_old=0.5, R=2.0: (1-2)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69
    #       -> 0.5 * max(1, 1.69) = 0.845, clipped branch used
    # tok1: V=2.0, V_old=2.0, R=1.0: both 1 -> 0.5, not clipped (not strictly larger)
    # tok2: V=0.4, V_old=0.5, R=0.0: inside the band -> 0.5 * 0.16 = 0.08, not clipped
    # tok3: V=3.0, V_old=0.5, R=2.5: (0.5)^2 = .25; V_clip = 0.7, (0.7-2.5)^2 = 3.24 -> 1.62, clipped
    # tok4: masked out (garbage)
    v = torch.tensor([[1.0, 2.0, 0.4, 3.0, 100.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.5, 0.5, -50.0]], dtype=D)
    ret = torch.tensor([[2.0, 1.0, 0.0, 2.5, 7.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=D)
    loss, diag = value_loss(v, old, ret, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.5, 0.08, 1.62, 0.0]], dtype=D))
    torch.testing.assert_close(diag["clipped"], torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]], dtype=D))
    torch.testing.assert_close(diag["value_error"], torch.tensor([[-1.0, 1.0, 0.4, 0.5, 0.0]], dtype=D))
    loss.sum().backward()
    assert v.grad is not None
    # d/dV: clipped tokens 0; tok1: (V - R) = 1; tok2: 0.4; masked 0
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 1.0, 0.4, 0.0, 0.0]], dtype=D))


def test_unclipped_value_loss() -> None:
    v = torch.tensor([[1.0, 3.0]], dtype=D)
    ret = torch.tensor([[2.0, 0.0]], dtype=D)
    loss, diag = value_loss(v, torch.zeros_like(v), ret, torch.tensor([[1.0, 1.0]], dtype=D), clip_eps=None)
    # 0.5 * (1-2)^2 = 0.5; 0.5 * 3^2 = 4.5
    torch.testing.assert_close(loss, torch.tensor([[0.5, 4.5]], dtype=D))
    assert bool((diag["clipped"] == 0).all())


def test_value_loss_errors() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="shapes"):
        value_loss(x, x, torch.zeros(1, 3), x, 0.2)
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(x, x, x, x, 0.0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 1e300])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_masked_garbage_gives_finite_loss_and_gradient(bad: float, clip_eps: float | None) -> None:
    """Values / returns at masked positions (padding, prompt) may hold anything: neither the loss nor
    the gradient w.r.t. V may become NaN / inf because of them, and on-mask results are unchanged."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    clean = torch.tensor([[0.0, 0.5, -0.2, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.4, 0.1, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 1.0, -1.0, 0.0]], dtype=torch.float64)
    dirty = clean.clone()
    dirty[0, 0] = dirty[0, 3] = bad
    grads = []
    for v0, o, r in ((clean, old, ret), (dirty, old.masked_fill(mask == 0, bad), ret.masked_fill(mask == 0, bad))):
        v = v0.clone().requires_grad_(True)
        loss, diag = value_loss(v, o, r, mask, clip_eps)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(v.grad).all(), (loss, v.grad)
        assert torch.isfinite(diag["value_error"]).all()
        grads.append((loss.detach(), v.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)
    assert (grads[1][1][mask == 0] == 0).all()
