"""Tests for posttrain/algos/distill.py (reverse-KL sampled-token loss, full forward KL)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos.distill import forward_kl_distill, reverse_kl_advantage, reverse_kl_distill

D = torch.float64


def test_reverse_kl_zero_when_student_equals_teacher() -> None:
    s = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.1, -0.7]], dtype=D, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
    loss = reverse_kl_distill(s, s.detach().clone(), mask)
    (g,) = torch.autograd.grad(loss.sum(), s)
    # advantage -(log s - log t) = 0 on every token: zero loss and zero gradient, exactly
    assert torch.equal(loss, torch.zeros(2, 3, dtype=D))
    assert torch.equal(g, torch.zeros(2, 3, dtype=D))


def test_reverse_kl_hand() -> None:
    # token 0: s = -1, t = -2: adv = -(-1 + 2) = -1; loss = -adv * s = -1; grad = -adv = log s - log t = 1
    # token 1: s = -3, t = -0.5: adv = 2.5; loss = -2.5 * -3 = 7.5; grad = -2.5 (raise the student's prob)
    # token 2: masked, garbage (nan student, inf teacher) must not leak
    s = torch.tensor([[-1.0, -3.0, math.nan]], dtype=D, requires_grad=True)
    t = torch.tensor([[-2.0, -0.5, math.inf]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)
    loss = reverse_kl_distill(s, t, mask)
    (g,) = torch.autograd.grad(loss.sum(), s)
    assert torch.allclose(loss, torch.tensor([[-1.0, 7.5, 0.0]], dtype=D), atol=1e-12)
    assert torch.allclose(g, torch.tensor([[1.0, -2.5, 0.0]], dtype=D), atol=1e-12)


def test_reverse_kl_advantage_hand_three_tokens() -> None:
    # coef 0.5; token 0: s = -1, t = -2 -> -0.5 * (-1 + 2) = -0.5 (the student is over-confident: push down)
    # token 1: s = -3, t = -0.5 -> -0.5 * (-3 + 0.5) = 1.25 (the teacher prefers it: push up)
    # token 2: s = t = -0.25 -> 0; token 3 masked with garbage -> exactly 0
    s = torch.tensor([[-1.0, -3.0, -0.25, math.nan]], dtype=D)
    t = torch.tensor([[-2.0, -0.5, -0.25, -math.inf]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    adv = reverse_kl_advantage(s, t, mask, coef=0.5)
    assert adv.dtype == D
    assert torch.allclose(adv, torch.tensor([[-0.5, 1.25, 0.0, 0.0]], dtype=D), rtol=0, atol=1e-15)
    # the sampled-token loss's gradient is the negated advantage at coef 1 (same signal)
    s1 = s.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(reverse_kl_distill(s1, t, mask).sum(), s1)
    assert torch.allclose(g[:, :3], -reverse_kl_advantage(s, t, mask)[:, :3], atol=1e-12)


def test_reverse_kl_advantage_zero_for_equal_and_refuses_bad_input() -> None:
    s = torch.tensor([[-0.5, -2.0], [-3.0, -0.1]], dtype=torch.float32)
    assert torch.equal(reverse_kl_advantage(s, s.clone(), torch.ones(2, 2)), torch.zeros(2, 2, dtype=D))  # x - x is exactly 0 in IEEE arithmetic
    with pytest.raises(ValueError, match="coef must be > 0"):
        reverse_kl_advantage(s, s, torch.ones(2, 2), coef=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        reverse_kl_advantage(s, s[:1], torch.ones(2, 2))


def test_reverse_kl_teacher_gets_no_gradient() -> None:
    s = torch.tensor([[-1.0]], dtype=D, requires_grad=True)
    t = torch.tensor([[-2.0]], dtype=D, requires_grad=True)
    loss = reverse_kl_distill(s, t, torch.ones(1, 1, dtype=D))
    assert torch.autograd.grad(loss.sum(), t, allow_unused=True)[0] is None


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True) if pi > 0)


def test_forward_kl_hand() -> None:
    # V = 3. Student logits 0 -> uniform 1/3. Teacher probs [0.5, 0.25, 0.25].
    # KL = 0.5 ln(0.5 / (1/3)) + 2 * 0.25 ln(0.25 / (1/3)) = 0.5 ln 1.5 + 0.5 ln 0.75 = 0.0589
    p = [0.5, 0.25, 0.25]
    expected = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    assert expected == pytest.approx(_kl(p, [1 / 3] * 3), abs=1e-15)
    student = torch.zeros(1, 2, 3, dtype=D, requires_grad=True)
    teacher_logprobs = torch.log(torch.tensor([[p, p]], dtype=D))
    mask = torch.tensor([[1, 0]], dtype=D)
    loss = forward_kl_distill(student, teacher_logprobs, mask)
    assert torch.allclose(loss, torch.tensor([[expected, 0.0]], dtype=D), atol=1e-12)
    # teacher as logits (log-probs plus any constant) gives the same result
    loss_logits = forward_kl_distill(student, teacher_logprobs + 7.0, mask)
    assert torch.allclose(loss_logits, loss, atol=1e-12)
    # gradient w.r.t. the student logits: softmax(student) - p_teacher = [1/3 - 0.5, 1/3 - 0.25, 1/3 - 0.25]
    (g,) = torch.autograd.grad(loss.sum(), student)
    assert torch.allclose(
        g[0, 0], torch.tensor([1 / 3 - 0.5, 1 / 3 - 0.25, 1 / 3 - 0.25], dtype=D), atol=1e-12
    )
    assert torch.equal(g[0, 1], torch.zeros(3, dtype=D))


def test_forward_kl_teacher_zero_mass_and_student_equal() -> None:
    # teacher puts 0 on token 2: that entry contributes 0 (0 log 0 = 0), not nan
    p = [0.75, 0.25, 0.0]
    q = [0.5, 0.25, 0.25]
    teacher = torch.tensor([[[math.log(0.75), math.log(0.25), -math.inf]]], dtype=D)
    student = torch.log(torch.tensor([[q]], dtype=D)).requires_grad_(True)
    loss = forward_kl_distill(student, teacher, torch.ones(1, 1, dtype=D))
    assert float(loss.detach()) == pytest.approx(_kl(p, q), abs=1e-12)  # 0.75 ln 1.5
    (g,) = torch.autograd.grad(loss.sum(), student)
    assert bool(torch.isfinite(g).all())
    # student == teacher: KL 0
    same = torch.log(torch.tensor([[q]], dtype=D))
    assert float(forward_kl_distill(same, same, torch.ones(1, 1, dtype=D))) == pytest.approx(0.0, abs=1e-15)


def test_forward_kl_masked_garbage_and_shapes() -> None:
    student = torch.tensor([[[0.0, 1.0], [math.nan, math.inf]]], dtype=D, requires_grad=True)
    teacher = torch.tensor([[[1.0, 0.0], [-math.inf, math.nan]]], dtype=D)
    loss = forward_kl_distill(student, teacher, torch.tensor([[1, 0]], dtype=D))
    (g,) = torch.autograd.grad(loss.sum(), student)
    assert (
        float(loss.detach()[0, 1]) == 0.0
        and bool(torch.isfinite(g).all())
        and torch.equal(g[0, 1], torch.zeros(2, dtype=D))
    )
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        forward_kl_distill(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.ones(1, 2))
    with pytest.raises(ValueError, match="action_mask"):
        reverse_kl_distill(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 3))
