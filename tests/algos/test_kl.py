"""KL estimators (hand values, k3 >= 0, unbiasedness by exact expectation) and KL controllers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos import KL_ESTIMATORS
from posttrain.algos.kl import AdaptiveKLController, FixedKLController, kl_k1, kl_k2, kl_k3

LOG2 = math.log(2.0)


def test_every_registered_name_is_covered_here() -> None:
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]
    assert KL_ESTIMATORS["k3"] is kl_k3


def test_hand_values() -> None:
    # p = 0.5, q = 0.25: log p - log q = log 2 = 0.6931472
    #   k1 = 0.6931472; k2 = 0.5 * 0.6931472^2 = 0.2402265
    #   k3: x = log q - log p = -log 2; e^x - x - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    # p = 0.25, q = 0.5: k1 = -0.6931472; k2 = 0.2402265; k3 = 2 - 0.6931472 - 1 = 0.3068528
    lp = torch.log(torch.tensor([0.5, 0.25, 0.3], dtype=torch.float64))
    lq = torch.log(torch.tensor([0.25, 0.5, 0.3], dtype=torch.float64))
    torch.testing.assert_close(kl_k1(lp, lq), torch.tensor([LOG2, -LOG2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(
        kl_k2(lp, lq), torch.tensor([0.5 * LOG2**2, 0.5 * LOG2**2, 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        kl_k3(lp, lq), torch.tensor([0.5 + LOG2 - 1, 2 - LOG2 - 1, 0.0], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="shape"):
        kl_k1(lp, lq[:2])


@settings(max_examples=100, deadline=None)
@given(st.floats(-30, 0), st.floats(-30, 0))
def test_k3_and_k2_are_nonnegative(lp: float, lq: float) -> None:
    a, b = torch.tensor([lp], dtype=torch.float64), torch.tensor([lq], dtype=torch.float64)
    assert kl_k3(a, b).item() >= 0.0
    assert kl_k2(a, b).item() >= 0.0


def test_k1_and_k3_are_unbiased_under_exact_expectation() -> None:
    # E_{y~p}[k(y)] computed exactly by summing over a 5-token vocabulary must equal KL(p||q).
    p = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    q = torch.tensor([0.3, 0.1, 0.2, 0.2, 0.2], dtype=torch.float64)
    exact = (p * (p.log() - q.log())).sum()
    for fn in (kl_k1, kl_k3):
        est = (p * fn(p.log(), q.log())).sum()
        torch.testing.assert_close(est, exact)
    # k2 is biased: its expectation differs from the KL for this pair.
    assert abs((p * kl_k2(p.log(), q.log())).sum().item() - exact.item()) > 1e-3


def test_adaptive_controller_hand_values_and_state() -> None:
    c = AdaptiveKLController(init_coef=0.1, target_kl=6.0, horizon=10000)
    # KL 9: error = 9/6 - 1 = 0.5, clipped to 0.2; mult = 1 + 0.2 * 256/10000 = 1.00512 -> 0.100512
    assert c.update(9.0, n_steps=256) == pytest.approx(0.100512)
    # KL 6.6: error 0.1 (unclipped); mult = 1 + 0.1 * 1000/10000 = 1.01 -> 0.100512 * 1.01 = 0.10151712
    assert c.update(6.6, n_steps=1000) == pytest.approx(0.10151712)
    # KL 0: error -1 -> -0.2; mult = 1 - 0.2 * 5000/10000 = 0.9 -> 0.091365408
    assert c.update(0.0, n_steps=5000) == pytest.approx(0.091365408)
    assert c.value == pytest.approx(0.091365408)
    d = AdaptiveKLController(init_coef=1.0, target_kl=1.0, horizon=1.0)
    d.load_state_dict(c.state_dict())
    assert d.state_dict() == c.state_dict()
    assert d.update(9.0, 256) == c.update(9.0, 256)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="finite"):
        c.update(math.nan, 1)
    with pytest.raises(ValueError, match="missing"):
        d.load_state_dict({"value": 1.0})


def test_adaptive_controller_gain_is_capped_hand_trajectory() -> None:
    """Issue 22: K = min(n_steps / horizon, 1), so each factor lies in [0.8, 1.2].

    The repro's settings: beta0 = 0.05, target 0.01, horizon 10 samples, n = 256 samples per step
    (n / horizon = 25.6, capped to K = 1). The uncapped update gave 0.05 * (1 - 0.2 * 25.6) = -0.206."""
    c = AdaptiveKLController(init_coef=0.05, target_kl=0.01, horizon=10)
    # KL 0: e = 0/0.01 - 1 = -1 -> -0.2; K = 1; beta = 0.05 * 0.8 = 0.04
    assert c.update(0.0, n_steps=256) == pytest.approx(0.04, rel=1e-12)
    # KL 0.5: e = 49 -> 0.2; beta = 0.04 * 1.2 = 0.048
    assert c.update(0.5, n_steps=256) == pytest.approx(0.048, rel=1e-12)
    # KL 0.011: e = 0.1 (inside the clip); beta = 0.048 * 1.1 = 0.0528
    assert c.update(0.011, n_steps=256) == pytest.approx(0.0528, rel=1e-12)
    # KL 0.0095: e = -0.05; beta = 0.0528 * 0.95 = 0.05016
    assert c.update(0.0095, n_steps=256) == pytest.approx(0.05016, rel=1e-12)
    # n = 5 < horizon: K = 0.5 (the paper's reference form); KL 0.012: e = 0.2; beta = 0.05016 * 1.1 = 0.055176
    assert c.update(0.012, n_steps=5) == pytest.approx(0.055176, rel=1e-12)
    # n = 10 = horizon: K = 1 exactly; KL 0.02: e = 1 -> 0.2; beta = 0.055176 * 1.2 = 0.0662112
    assert c.update(0.02, n_steps=10) == pytest.approx(0.0662112, rel=1e-12)


@pytest.mark.parametrize("n_steps", [256, 512, 10_000])
def test_adaptive_controller_with_the_repro_settings_never_reaches_zero(n_steps: int) -> None:
    """beta0 = 0.05, target 0.01, horizon 10: KL far below (0) and far above (100x) target, many updates."""
    below = AdaptiveKLController(0.05, 0.01, 10)
    for _ in range(100):
        assert below.update(0.0, n_steps) > 0
    # each update is the smallest factor, 0.8 (K = 1, e = -0.2): 0.05 * 0.8**100 ~ 1.0e-11
    assert below.value == pytest.approx(0.05 * 0.8**100, rel=1e-9)
    for _ in range(4900):
        assert below.update(0.0, n_steps) > 0
    # 0.05 * 0.8**5000 underflows a float; the controller keeps beta at the smallest positive one
    assert 0 < below.value < 1e-300
    above = AdaptiveKLController(0.05, 0.01, 10)
    for _ in range(200):
        assert above.update(1.0, n_steps) > 0
    # 200 factors of 1.2: 0.05 * 1.2**200 (log10 = log10(0.05) + 200 log10(1.2) = -1.301 + 15.836 = 14.535)
    assert math.log10(above.value) == pytest.approx(math.log10(0.05) + 200 * math.log10(1.2), rel=1e-9)
    swing = AdaptiveKLController(0.05, 0.01, 10)
    for i in range(1000):  # alternating far above / far below: 1.2 * 0.8 = 0.96 per pair, always > 0
        assert swing.update(1.0 if i % 2 else 0.0, n_steps) > 0
    assert swing.value == pytest.approx(0.05 * 0.96**500, rel=1e-9)


def test_adaptive_controller_refuses_a_zero_start_and_a_bad_state() -> None:
    with pytest.raises(ValueError, match="init_coef"):
        AdaptiveKLController(0.0, 0.01, 10)  # a multiplicative controller at 0 stays at 0
    c = AdaptiveKLController(0.05, 0.01, 10)
    with pytest.raises(ValueError, match="value must be finite and > 0"):
        c.load_state_dict({"value": -0.206, "target_kl": 0.01, "horizon": 10.0})
    assert c.value == 0.05


def test_fixed_controller() -> None:
    c = FixedKLController(0.05)
    assert c.update(100.0, 10) == 0.05 and c.value == 0.05
    c2 = FixedKLController(0.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_extreme_log_ratios_stay_finite_with_finite_gradients(name: str, dtype: torch.dtype) -> None:
    """A -inf / huge log-prob on either side gives the documented clamp, not inf or NaN: a masked or
    0-coefficient KL term must not poison the update (inf * 0 = NaN)."""
    from posttrain.algos.kl import LOG_RATIO_CLAMP

    lp = torch.tensor([-1.0, -1.0, -500.0, float("-inf"), -0.5], dtype=dtype, requires_grad=True)
    lq = torch.tensor([-500.0, float("-inf"), -1.0, -1.0, -0.7], dtype=dtype)
    kl = KL_ESTIMATORS[name](lp, lq)
    assert torch.isfinite(kl).all(), kl
    (kl * torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0], dtype=dtype)).sum().backward()
    assert torch.isfinite(lp.grad).all(), lp.grad
    c = LOG_RATIO_CLAMP
    expected = {"k1": [c, c, -c, -c], "k2": [c * c / 2] * 4,
                "k3": [math.expm1(-c) + c, math.expm1(-c) + c, math.expm1(c) - c, math.expm1(c) - c]}[name]
    torch.testing.assert_close(kl[:4].detach(), torch.tensor(expected, dtype=dtype))
    # inside the clamp nothing changed: the last token keeps its exact value
    x = -0.7 + 0.5
    exact = {"k1": -x, "k2": 0.5 * x * x, "k3": math.expm1(x) - x}[name]
    assert kl[4].item() == pytest.approx(exact, rel=1e-6)
