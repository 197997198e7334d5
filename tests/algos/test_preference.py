"""Tests for posttrain/algos/preference.py against numbers computed by hand with math."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algos import PREFERENCE_LOSSES

D = torch.float64


def _v(*xs: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(xs, dtype=D, requires_grad=grad)


def _softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_every_registered_loss_is_covered() -> None:
    assert set(PREFERENCE_LOSSES) == {"dpo", "ipo", "simpo", "orpo", "kto", "odpo"}


# pc = -10, pr = -12, rc = -11, rr = -11: h = (-10 + 11) - (-12 + 11) = 1 - (-1) = 2
PC, PR, RC, RR = -10.0, -12.0, -11.0, -11.0
H = 2.0


def test_dpo_hand_value_and_gradient() -> None:
    pc, pr = _v(PC, grad=True), _v(PR, grad=True)
    loss, diag = PREFERENCE_LOSSES["dpo"](pc, pr, _v(RC), _v(RR), beta=0.1)
    # -log sigmoid(0.1 * 2) = log(1 + e^-0.2) = 0.598139
    assert float(loss.detach()) == pytest.approx(_softplus(-0.2), abs=1e-12)
    assert float(loss.detach()) == pytest.approx(0.5981388693815918, abs=1e-12)
    # d/d pc = -beta sigmoid(-beta h), d/d pr = +beta sigmoid(-beta h)
    gc, gr = torch.autograd.grad(loss.sum(), (pc, pr))
    assert float(gc) == pytest.approx(-0.1 * _sig(-0.2), abs=1e-12)
    assert float(gr) == pytest.approx(0.1 * _sig(-0.2), abs=1e-12)
    assert float(diag["chosen_reward"]) == pytest.approx(0.1, abs=1e-12)  # beta (pc - rc) = 0.1 * 1
    assert float(diag["rejected_reward"]) == pytest.approx(-0.1, abs=1e-12)
    assert float(diag["reward_accuracy"]) == 1.0


def test_dpo_label_smoothing() -> None:
    # eps = 0.1: 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2)
    loss, _ = PREFERENCE_LOSSES["dpo"](_v(PC), _v(PR), _v(RC), _v(RR), beta=0.1, label_smoothing=0.1)
    assert float(loss.detach()) == pytest.approx(0.9 * _softplus(-0.2) + 0.1 * _softplus(0.2), abs=1e-12)
    # smoothing never lets the loss reach 0 for a huge margin: at h = 200 the eps term -> 0.1 * 20 = 2
    loss, _ = PREFERENCE_LOSSES["dpo"](_v(100.0), _v(-100.0), _v(0.0), _v(0.0), beta=0.1, label_smoothing=0.1)
    assert float(loss.detach()) == pytest.approx(0.9 * _softplus(-20.0) + 0.1 * _softplus(20.0), abs=1e-9)
    with pytest.raises(ValueError, match="label_smoothing"):
        PREFERENCE_LOSSES["dpo"](_v(PC), _v(PR), _v(RC), _v(RR), label_smoothing=0.5)


def test_dpo_batch_and_ref_required() -> None:
    loss, _ = PREFERENCE_LOSSES["dpo"](_v(PC, -1.0), _v(PR, -1.0), _v(RC, -1.0), _v(RR, -1.0), beta=0.1)
    # second pair has h = 0: loss log 2
    assert torch.allclose(loss, _v(_softplus(-0.2), math.log(2.0)), atol=1e-12)
    with pytest.raises(ValueError, match="ref_chosen_logp"):
        PREFERENCE_LOSSES["dpo"](_v(PC), _v(PR), None, None)
    with pytest.raises(ValueError, match=r"\[B\]"):
        PREFERENCE_LOSSES["dpo"](_v(PC, 1.0), _v(PR), _v(RC), _v(RR))


def test_ipo_hand() -> None:
    # tau = 0.1: (h - 1/(2 tau))^2 = (2 - 5)^2 = 9; d/d pc = 2 (h - 5) = -6
    pc = _v(PC, grad=True)
    loss, _ = PREFERENCE_LOSSES["ipo"](pc, _v(PR), _v(RC), _v(RR), tau=0.1)
    assert float(loss.detach()) == pytest.approx(9.0, abs=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), pc)
    assert float(g) == pytest.approx(-6.0, abs=1e-12)
    # at the target margin h = 1/(2 tau) the loss is 0: pc - rc = 5 with pr = rr
    loss, _ = PREFERENCE_LOSSES["ipo"](_v(-6.0), _v(-3.0), _v(-11.0), _v(-3.0), tau=0.1)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-12)


def test_simpo_hand() -> None:
    # beta 2, gamma 0.5: chosen -6 over 3 tokens -> 2 * -2 = -4; rejected -8 over 2 tokens -> 2 * -4 = -8
    # loss = -log sigmoid(-4 + 8 - 0.5) = log(1 + e^-3.5)
    pc = _v(-6.0, grad=True)
    loss, diag = PREFERENCE_LOSSES["simpo"](
        pc, _v(-8.0), None, None, chosen_lengths=_v(3.0), rejected_lengths=_v(2.0), beta=2.0, gamma=0.5
    )
    assert float(loss.detach()) == pytest.approx(_softplus(-3.5), abs=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), pc)
    assert float(g) == pytest.approx(-(2.0 / 3.0) * _sig(-3.5), abs=1e-12)  # length-normalised gradient
    assert float(diag["chosen_reward"]) == pytest.approx(-4.0) and float(
        diag["rejected_reward"]
    ) == pytest.approx(-8.0)
    # integer length tensors are accepted; the reference arguments are ignored
    loss2, _ = PREFERENCE_LOSSES["simpo"](
        _v(-6.0),
        _v(-8.0),
        _v(99.0),
        _v(99.0),
        chosen_lengths=torch.tensor([3]),
        rejected_lengths=torch.tensor([2]),
    )
    assert float(loss2) == pytest.approx(_softplus(-3.5), abs=1e-12)
    with pytest.raises(ValueError, match="chosen_lengths"):
        PREFERENCE_LOSSES["simpo"](
            _v(-6.0), _v(-8.0), None, None, chosen_lengths=_v(0.0), rejected_lengths=_v(2.0)
        )


def _log_odds(avg: float) -> float:
    return avg - math.log(1.0 - math.exp(avg))


def test_orpo_hand() -> None:
    # chosen -1 over 2 tokens (a = -0.5), rejected -3 over 3 tokens (a = -1), lam = 0.1
    # log odds(a) = a - log(1 - e^a); L_OR = log(1 + e^-(lo_c - lo_r)); L_SFT = 0.5
    lo = _log_odds(-0.5) - _log_odds(-1.0)
    loss, diag = PREFERENCE_LOSSES["orpo"](
        _v(-1.0), _v(-3.0), None, None, chosen_lengths=_v(2.0), rejected_lengths=_v(3.0), lam=0.1
    )
    assert float(diag["log_odds_ratio"]) == pytest.approx(lo, abs=1e-12)
    assert float(diag["nll"]) == pytest.approx(0.5, abs=1e-12)
    assert float(loss.detach()) == pytest.approx(0.5 + 0.1 * _softplus(-lo), abs=1e-12)


def test_orpo_is_stable_at_extremes() -> None:
    # average log-prob -1e-9 (probability ~1) and -60 (tiny): finite value and gradient
    pc = _v(-2e-9, grad=True)
    pr = _v(-120.0, grad=True)
    loss, _ = PREFERENCE_LOSSES["orpo"](pc, pr, None, None, chosen_lengths=_v(2.0), rejected_lengths=_v(2.0))
    gc, gr = torch.autograd.grad(loss.sum(), (pc, pr))
    assert all(bool(torch.isfinite(x).all()) for x in (loss, gc, gr))
    # log1mexp in both regimes against math: a = -0.1 (near 0) and a = -5
    for a in (-0.1, -5.0):
        loss, d = PREFERENCE_LOSSES["orpo"](
            _v(a), _v(-10.0), None, None, chosen_lengths=_v(1.0), rejected_lengths=_v(1.0), lam=1.0
        )
        assert float(d["log_odds_ratio"]) == pytest.approx(_log_odds(a) - _log_odds(-10.0), abs=1e-10)


def test_kto_hand_and_asymmetry() -> None:
    # r = policy - ref = -5 - (-6) = 1 for both examples; z0 = 0.5; beta = 0.1
    pol = _v(-5.0, -5.0, grad=True)
    des = torch.tensor([True, False])
    loss, diag = PREFERENCE_LOSSES["kto"](pol, _v(-6.0, -6.0), des, 0.5, beta=0.1, lambda_d=1.0, lambda_u=1.5)
    # desirable: 1 - sigmoid(0.1 * (1 - 0.5)); undesirable: 1.5 - 1.5 sigmoid(0.1 * (0.5 - 1))
    exp_d = 1.0 - _sig(0.05)
    exp_u = 1.5 - 1.5 * _sig(-0.05)
    assert torch.allclose(loss, _v(exp_d, exp_u), atol=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), pol)
    # desirable: raising r lowers the loss; undesirable: raising r raises it, scaled by lambda_u
    s = _sig(0.05)
    assert torch.allclose(g, _v(-0.1 * s * (1 - s), 1.5 * 0.1 * s * (1 - s)), atol=1e-12)
    assert torch.allclose(diag["reward"], _v(1.0, 1.0))
    # the reference point is clamped at 0 and detached
    z = torch.tensor(-3.0, dtype=D, requires_grad=True)
    loss, _ = PREFERENCE_LOSSES["kto"](_v(-5.0, grad=True), _v(-6.0), torch.tensor([True]), z)
    assert float(loss.detach()) == pytest.approx(1.0 - _sig(0.1), abs=1e-12)
    assert torch.autograd.grad(loss.sum(), z, allow_unused=True)[0] is None
    with pytest.raises(ValueError, match="bool"):
        PREFERENCE_LOSSES["kto"](_v(-5.0), _v(-6.0), torch.tensor([1]), 0.0)
    with pytest.raises(ValueError, match="scalar"):
        PREFERENCE_LOSSES["kto"](_v(-5.0), _v(-6.0), torch.tensor([True]), torch.zeros(2))


def test_odpo_hand() -> None:
    # h = 2, beta 0.1, score_diff 1, alpha 0.5: -log sigmoid(0.2 - 0.5) = log(1 + e^0.3)
    loss, diag = PREFERENCE_LOSSES["odpo"](
        _v(PC), _v(PR), _v(RC), _v(RR), score_diff=_v(1.0), beta=0.1, alpha=0.5
    )
    assert float(loss.detach()) == pytest.approx(_softplus(0.3), abs=1e-12)
    assert float(diag["offset"]) == pytest.approx(0.5)
    # log transform: score_diff e^2 -> f = 2 -> offset 1: log(1 + e^(1 - 0.2))
    loss, _ = PREFERENCE_LOSSES["odpo"](
        _v(PC), _v(PR), _v(RC), _v(RR), score_diff=_v(math.exp(2.0)), alpha=0.5, offset_transform="log"
    )
    assert float(loss.detach()) == pytest.approx(_softplus(0.8), abs=1e-12)
    # offset 0 is DPO
    a, _ = PREFERENCE_LOSSES["odpo"](_v(PC), _v(PR), _v(RC), _v(RR), score_diff=_v(0.0))
    b, _ = PREFERENCE_LOSSES["dpo"](_v(PC), _v(PR), _v(RC), _v(RR))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="score_diff"):
        PREFERENCE_LOSSES["odpo"](_v(PC), _v(PR), _v(RC), _v(RR), score_diff=_v(-1.0))
    with pytest.raises(ValueError, match="offset_transform"):
        PREFERENCE_LOSSES["odpo"](_v(PC), _v(PR), _v(RC), _v(RR), score_diff=_v(1.0), offset_transform="sqrt")
