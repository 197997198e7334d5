"""Learning-rate multipliers by hand."""

import math

import pytest
import torch

from posttrain.learner.schedule import build_optimizer, build_scheduler, lr_multiplier


def test_warmup_then_constant():
    f = lr_multiplier("constant", warmup_steps=4)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_by_hand():
    # warmup 2, total 6: decay over steps 2..6 (4 steps), p = (s - 2) / 4.
    lin = lr_multiplier("linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.2)
    # s=2: p=0 -> 1; s=4: p=0.5 -> 1 - 0.8*0.5 = 0.6; s=6: p=1 -> 0.2; s=9: clamped -> 0.2
    assert [lin(s) for s in (0, 1, 2, 4, 6, 9)] == pytest.approx([0.5, 1.0, 1.0, 0.6, 0.2, 0.2])
    cos = lr_multiplier("cosine", total_steps=4)
    # p = s/4: 0.5 * (1 + cos(pi p)): s=0 -> 1, s=2 -> 0.5, s=4 -> 0
    assert [cos(s) for s in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0])
    assert cos(1) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_scheduler_steps_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], lr=0.1)
    sched = build_scheduler(opt, "constant", warmup_steps=2)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        lr_multiplier("step")
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier("cosine")
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], lr=1.0)
