"""Tests for posttrain/algos/policy_losses.py (hand-computed values, invariances, gradchecks)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algos import POLICY_LOSSES
from posttrain.algos.policy_losses import PolicyLossInputs, PolicyLossOutputs

D = torch.float64

# Every registered loss with the hyperparameter variants exercised by the generic tests.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("ppo_clip", {}),
    ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0}),
    ("gspo", {}),
    ("gspo", {"eps_low": 0.2, "eps_high": 0.2}),
    ("gspo_token", {}),
    ("cispo", {}),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.28}),
    ("topr", {}),
    ("topr", {"level": "token"}),
    ("topr", {"ratio_against": "behavior"}),
    ("sapo", {}),
    ("reinforce", {}),
    ("decoupled_ppo", {}),
    ("decoupled_ppo", {"behavior_weight_cap": 1.5}),
    ("decoupled_ppo", {"behavior_weight_cap": 1.5, "cap_mode": "mask"}),
]


def test_every_registered_loss_is_covered() -> None:
    assert {name for name, _ in VARIANTS} == set(POLICY_LOSSES)


def _run(name: str, hp: dict[str, Any], inputs: PolicyLossInputs) -> PolicyLossOutputs:
    out: PolicyLossOutputs = POLICY_LOSSES[name](inputs, **hp)
    return out


def _grad(
    name: str, hp: dict[str, Any], inputs: PolicyLossInputs, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """d(sum_t w_t loss_t)/d logprob; w is a reduction weight (all ones = sum)."""
    out = _run(name, hp, inputs)
    w = torch.ones_like(out.loss) if weights is None else weights
    (g,) = torch.autograd.grad((out.loss * w).sum(), inputs.logprob)
    return g


def _one(
    logprob: float,
    old: float,
    adv: float,
    behavior: float | None = None,
) -> PolicyLossInputs:
    """A single-token batch [1, 1] in float64."""
    return PolicyLossInputs(
        logprob=torch.tensor([[logprob]], dtype=D, requires_grad=True),
        old_logprob=torch.tensor([[old]], dtype=D),
        advantages=torch.tensor([[adv]], dtype=D),
        action_mask=torch.ones(1, 1, dtype=D),
        behavior_logprob=None if behavior is None else torch.tensor([[behavior]], dtype=D),
    )


MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 1, 0]], dtype=D)  # ragged, holes


def _on_policy_batch(row_constant_adv: bool) -> PolicyLossInputs:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g, dtype=D) * 3 - 0.1
    if row_constant_adv:
        adv = torch.tensor([[1.5], [-0.7], [0.3]], dtype=D).expand(3, 5).clone()
    else:
        adv = torch.randn(3, 5, generator=g, dtype=D)
    return PolicyLossInputs(
        logprob=lp.clone().requires_grad_(True),
        old_logprob=lp.clone(),  # pi_theta == pi_old
        advantages=adv,
        action_mask=MASK,
        behavior_logprob=lp.clone(),  # mu == pi_old
    )


# ---------------------------------------------------------------- (1) on-policy = plain PG


# GSPO's sequence ratio spreads the row's mean advantage over its tokens, so it reduces to the
# plain policy gradient only with a row-constant (sequence) advantage, as in the paper.
_ON_POLICY_CASES = [(n, hp, True) for n, hp in VARIANTS] + [
    (n, hp, False) for n, hp in VARIANTS if n not in ("gspo", "gspo_token")
]


@pytest.mark.parametrize(("name", "hp", "row_constant"), _ON_POLICY_CASES)
def test_on_policy_ratio_is_one_and_gradient_is_plain_pg(
    name: str, hp: dict[str, Any], row_constant: bool
) -> None:
    inputs = _on_policy_batch(row_constant)
    m = MASK.bool()
    out = _run(name, hp, inputs)
    # every valid action's ratio is exactly 1 (exp(0) == 1)
    assert torch.equal(out.diagnostics["ratio"][m], torch.ones(int(m.sum()), dtype=D))
    # gradient equals REINFORCE's -A grad logprob: d(-A_t r_t)/d lp_t = -A_t r_t = -A_t at r = 1
    ref_grad = _grad("reinforce", {}, inputs)
    assert torch.allclose(_grad(name, hp, inputs), ref_grad, atol=1e-12, rtol=0)
    # and under a reduction weight that is constant within a row (all REDUCTIONS are), e.g.
    # seq_mean_token_mean: w_{i,t} = 1 / (B * n_i)
    n = MASK.sum(dim=1, keepdim=True)
    w = (1.0 / (3 * n)).expand(3, 5) * MASK
    assert torch.allclose(_grad(name, hp, inputs, w), _grad("reinforce", {}, inputs, w), atol=1e-12, rtol=0)


@pytest.mark.parametrize(("name", "hp"), VARIANTS)
def test_on_policy_loss_values(name: str, hp: dict[str, Any]) -> None:
    inputs = _on_policy_batch(row_constant_adv=True)
    m = MASK.bool()
    a, lp = inputs.advantages, inputs.logprob.detach()
    loss = _run(name, hp, inputs).loss
    if name in ("ppo_clip", "gspo", "gspo_token", "decoupled_ppo"):
        expected = -a  # surrogate -r A at r = 1 (and mu = pi_old gives weight 1)
    elif name in ("cispo", "topr", "reinforce"):
        expected = -a * lp  # weight 1 times the REINFORCE term
    else:  # sapo: -(4 / tau) sigmoid(0) A = -2 A / tau, tau by the sign of A
        tau = torch.where(a > 0, torch.full_like(a, 1.0), torch.full_like(a, 1.05))
        expected = -2.0 * a / tau
    assert torch.allclose(loss[m], expected[m], atol=1e-12, rtol=0)
    assert torch.equal(loss[~m], torch.zeros(int((~m).sum()), dtype=D))


# ---------------------------------------------------------------- (2) masked positions are inert

_WILD = st.one_of(
    st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -1e30, 0.0]),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[PolicyLossInputs, PolicyLossInputs]:
    b = draw(st.integers(1, 3))
    t = draw(st.integers(1, 5))
    n = b * t

    def vec(lo: float, hi: float) -> list[float]:
        return draw(st.lists(st.floats(lo, hi, allow_nan=False), min_size=n, max_size=n))

    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=D).view(b, t)
    base = {
        "logprob": torch.tensor(vec(-4.0, -0.01), dtype=D).view(b, t),
        "old_logprob": torch.tensor(vec(-4.0, -0.01), dtype=D).view(b, t),
        "advantages": torch.tensor(vec(-2.0, 2.0), dtype=D).view(b, t),
        "behavior_logprob": torch.tensor(vec(-4.0, -0.01), dtype=D).view(b, t),
    }
    wild = {
        k: torch.where(
            mask.bool(), v, torch.tensor(draw(st.lists(_WILD, min_size=n, max_size=n)), dtype=D).view(b, t)
        )
        for k, v in base.items()
    }

    def mk(d: dict[str, torch.Tensor]) -> PolicyLossInputs:
        return PolicyLossInputs(
            logprob=d["logprob"].clone().requires_grad_(True),
            old_logprob=d["old_logprob"],
            advantages=d["advantages"],
            action_mask=mask,
            behavior_logprob=d["behavior_logprob"],
        )

    return mk(base), mk(wild)


@settings(max_examples=40, deadline=None)
@given(_batches())
def test_masked_positions_never_change_loss_or_gradient(
    pair: tuple[PolicyLossInputs, PolicyLossInputs],
) -> None:
    base, wild = pair
    off = ~base.action_mask.bool()
    for name, hp in VARIANTS:
        o1, o2 = _run(name, hp, base), _run(name, hp, wild)
        assert torch.equal(o1.loss, o2.loss), name
        assert torch.equal(o1.loss[off], torch.zeros_like(o1.loss[off])), name
        assert o1.diagnostics.keys() == o2.diagnostics.keys()
        for k in o1.diagnostics:
            assert torch.equal(o1.diagnostics[k], o2.diagnostics[k]), (name, k)
        g1, g2 = _grad(name, hp, base), _grad(name, hp, wild)
        assert torch.equal(g1, g2), name
        assert torch.equal(g1[off], torch.zeros_like(g1[off])), name
        assert bool(torch.isfinite(g2).all()), name


# ---------------------------------------------------------------- (3) hand cases


def _loss_grad(name: str, inputs: PolicyLossInputs, **hp: Any) -> tuple[float, float, PolicyLossOutputs]:
    out = _run(name, hp, inputs)
    (g,) = torch.autograd.grad(out.loss.sum(), inputs.logprob)
    # summed over tokens (single-token batches in most cases)
    return float(out.loss.detach().sum()), float(g.sum()), out


def test_ppo_clip_high_positive_advantage() -> None:
    # r = 1.5, A = +1, eps_high = 0.28: loss = -min(1.5, 1.28) = -1.28; the clip is active: no gradient
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(1.5), 0.0, 1.0), eps_high=0.28)
    assert loss == pytest.approx(-1.28, abs=1e-12)
    assert g == 0.0
    assert float(out.diagnostics["clipped_high"]) == 1.0 and float(out.diagnostics["clipped_low"]) == 0.0


def test_ppo_clip_low_negative_advantage() -> None:
    # r = 0.5, A = -1, eps_low = 0.2: loss = -min(-0.5, -0.8) = 0.8; clip active: no gradient
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(0.5), 0.0, -1.0), eps_low=0.2)
    assert loss == pytest.approx(0.8, abs=1e-12)
    assert g == 0.0
    assert float(out.diagnostics["clipped_low"]) == 1.0 and float(out.diagnostics["clipped_high"]) == 0.0


def test_ppo_clip_unclipped_and_clip_higher() -> None:
    # r = 1.25, A = +1: eps_high = 0.2 clips (loss -1.2, grad 0); eps_high = 0.28 does not:
    # loss = -1.25, d(-r A)/d logprob = -r A = -1.25
    loss, g, _ = _loss_grad("ppo_clip", _one(math.log(1.25), 0.0, 1.0))
    assert (loss, g) == (pytest.approx(-1.2, abs=1e-12), 0.0)
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(1.25), 0.0, 1.0), eps_high=0.28)
    assert loss == pytest.approx(-1.25, abs=1e-12) and g == pytest.approx(-1.25, abs=1e-12)
    assert float(out.diagnostics["clipped_high"]) == 0.0
    # r = 0.5, A = +1: the low side never clips a positive advantage: loss = -0.5, grad = -0.5
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(0.5), 0.0, 1.0))
    assert loss == pytest.approx(-0.5, abs=1e-12) and g == pytest.approx(-0.5, abs=1e-12)
    assert float(out.diagnostics["clipped_low"]) == 0.0


def test_ppo_dual_clip() -> None:
    # r = 4, A = -1, eps = 0.2: PPO loss = max(4, 1.2) = 4 with gradient -A r = 4;
    # dual clip c = 3 bounds it at -c A = 3 with no gradient
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(4.0), 0.0, -1.0))
    assert loss == pytest.approx(4.0, abs=1e-12) and g == pytest.approx(4.0, abs=1e-12)
    assert "dual_clipped" not in out.diagnostics
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(4.0), 0.0, -1.0), dual_clip=3.0)
    assert loss == pytest.approx(3.0, abs=1e-12) and g == 0.0
    assert float(out.diagnostics["dual_clipped"]) == 1.0
    # r = 2 < c: the dual bound is inactive: loss 2, gradient 2
    loss, g, out = _loss_grad("ppo_clip", _one(math.log(2.0), 0.0, -1.0), dual_clip=3.0)
    assert loss == pytest.approx(2.0, abs=1e-12) and g == pytest.approx(2.0, abs=1e-12)
    assert float(out.diagnostics["dual_clipped"]) == 0.0
    # positive advantages are never dual-clipped: r = 4, A = +1 -> clipped at 1.2
    loss, _, out = _loss_grad("ppo_clip", _one(math.log(4.0), 0.0, 1.0), dual_clip=3.0)
    assert loss == pytest.approx(-1.2, abs=1e-12) and float(out.diagnostics["dual_clipped"]) == 0.0


def _row(
    deltas: list[float], adv: list[float], behavior_shift: list[float] | None = None
) -> PolicyLossInputs:
    """One row with logprob = -1 + delta_t (old = -1): log r_t = delta_t."""
    lp = torch.tensor([[-1.0 + d for d in deltas]], dtype=D, requires_grad=True)
    old = torch.full((1, len(deltas)), -1.0, dtype=D)
    beh = None if behavior_shift is None else old - torch.tensor([behavior_shift], dtype=D)
    return PolicyLossInputs(lp, old, torch.tensor([adv], dtype=D), torch.ones(1, len(deltas), dtype=D), beh)


def test_gspo_sequence_ratio_hand() -> None:
    # log ratios [0.2, -0.1]: s = exp(0.05) = 1.0512711
    s = math.exp(0.05)
    out = _run("gspo", {}, _row([0.2, -0.1], [1.0, 1.0]))
    # A = +1 and s > 1 + 4e-4: clipped to 1.0004 on both tokens (same value across the row)
    assert torch.allclose(out.loss, torch.tensor([[-1.0004, -1.0004]], dtype=D), atol=1e-12)
    assert torch.equal(out.diagnostics["clipped_high"], torch.ones(1, 2, dtype=D))
    # A = -1: min(-s, -1.0004) = -s -> loss s on both tokens; d(sum)/d lp_u = 2 * s / 2 = s per token
    inp = _row([0.2, -0.1], [-1.0, -1.0])
    out = _run("gspo", {}, inp)
    assert torch.allclose(out.loss, torch.tensor([[s, s]], dtype=D), atol=1e-12)
    (g,) = torch.autograd.grad(out.loss.sum(), inp.logprob)
    assert torch.allclose(g, torch.tensor([[s, s]], dtype=D), atol=1e-12)
    assert torch.allclose(out.diagnostics["ratio"], torch.tensor([[s, s]], dtype=D), atol=1e-12)


def test_gspo_token_hand_and_equivalence() -> None:
    # token advantages [-1, -3], log ratios [0.2, -0.1], s = exp(0.05), eps default (not clipped for A < 0)
    s = math.exp(0.05)
    inp = _row([0.2, -0.1], [-1.0, -3.0])
    out = _run("gspo_token", {}, inp)
    # value: -A_t * s ; gradient: own token only, -A_t * s
    assert torch.allclose(out.loss, torch.tensor([[s, 3 * s]], dtype=D), atol=1e-12)
    (g,) = torch.autograd.grad(out.loss.sum(), inp.logprob)
    assert torch.allclose(g, torch.tensor([[s, 3 * s]], dtype=D), atol=1e-12)
    # GSPO would instead spread (1 + 3) * s / 2 = 2 s to every token
    inp2 = _row([0.2, -0.1], [-1.0, -3.0])
    (g2,) = torch.autograd.grad(_run("gspo", {}, inp2).loss.sum(), inp2.logprob)
    assert torch.allclose(g2, torch.tensor([[2 * s, 2 * s]], dtype=D), atol=1e-12)
    # with a row-constant advantage the two agree in value and gradient (GSPO paper, GSPO-token section)
    a, b = _row([0.2, -0.1, 0.05], [-2.0] * 3), _row([0.2, -0.1, 0.05], [-2.0] * 3)
    oa, ob = _run("gspo", {}, a), _run("gspo_token", {}, b)
    assert torch.allclose(oa.loss, ob.loss, atol=1e-12)
    (ga,) = torch.autograd.grad(oa.loss.sum(), a.logprob)
    (gb,) = torch.autograd.grad(ob.loss.sum(), b.logprob)
    assert torch.allclose(ga, gb, atol=1e-12)


def test_gspo_row_without_action_tokens() -> None:
    inp = PolicyLossInputs(
        torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=D, requires_grad=True),
        torch.tensor([[-1.0, -2.0], [-5.0, -5.0]], dtype=D),
        torch.ones(2, 2, dtype=D),
        torch.tensor([[1, 1], [0, 0]], dtype=D),
    )
    for name in ("gspo", "gspo_token"):
        out = _run(name, {}, inp)
        assert torch.equal(out.loss[1], torch.zeros(2, dtype=D))
        assert torch.allclose(out.loss[0], torch.tensor([-1.0, -1.0], dtype=D), atol=1e-12)


def test_cispo_hand() -> None:
    # r = 1.5, A = 1, logprob = -0.5, eps_high = 0.28: w = sg(1.28); loss = -1.28 * 1 * (-0.5) = 0.64;
    # gradient -w A = -1.28 (never zero, unlike PPO's clipped branch)
    loss, g, out = _loss_grad("cispo", _one(-0.5, -0.5 - math.log(1.5), 1.0), eps_high=0.28)
    assert loss == pytest.approx(0.64, abs=1e-12) and g == pytest.approx(-1.28, abs=1e-12)
    assert float(out.diagnostics["clipped_high"]) == 1.0
    # r = 0.5, A = -1, logprob = -2: no lower bound by default -> w = 0.5: loss = -0.5*(-1)*(-2) = -1, grad 0.5
    loss, g, out = _loss_grad("cispo", _one(-2.0, -2.0 - math.log(0.5), -1.0))
    assert loss == pytest.approx(-1.0, abs=1e-12) and g == pytest.approx(0.5, abs=1e-12)
    assert float(out.diagnostics["clipped_low"]) == 0.0
    # with eps_low = 0.2 the weight is 0.8: loss = -0.8*(-1)*(-2) = -1.6, grad 0.8
    loss, g, out = _loss_grad("cispo", _one(-2.0, -2.0 - math.log(0.5), -1.0), eps_low=0.2)
    assert loss == pytest.approx(-1.6, abs=1e-12) and g == pytest.approx(0.8, abs=1e-12)
    assert float(out.diagnostics["clipped_low"]) == 1.0


def test_topr_hand() -> None:
    # Sequence level. Row log ratios [0.3, -0.5], sum -0.2: w = min(e^-0.2, 1) = 0.8187308
    w = math.exp(-0.2)
    inp = _row([0.3, -0.5], [-1.0, -1.0])  # logprob = [-0.7, -1.5]
    loss, _, out = _loss_grad("topr", inp)
    # loss_t = -w * A * lp_t = w * lp_t: w * (-0.7 - 1.5) = -2.2 w
    assert loss == pytest.approx(-2.2 * w, abs=1e-12)
    assert torch.allclose(out.diagnostics["is_weight"], torch.tensor([[w, w]], dtype=D), atol=1e-12)
    assert torch.equal(out.diagnostics["negative"], torch.ones(1, 2, dtype=D))
    # sum +0.4 -> truncated at the cap 1
    out = _run("topr", {}, _row([0.3, 0.1], [-1.0, -1.0]))
    assert torch.equal(out.diagnostics["is_weight"], torch.ones(1, 2, dtype=D))
    # positive advantage: weight 1 whatever the ratio (plain SFT-like term): lp = [-4, -1.5], A = 2
    inp = _row([-3.0, -0.5], [2.0, 2.0])
    loss, _, out = _loss_grad("topr", inp)
    assert loss == pytest.approx(-2.0 * (-4.0 - 1.5), abs=1e-12)
    assert torch.equal(out.diagnostics["is_weight"], torch.ones(1, 2, dtype=D))
    # token level: weights min(e^0.3, 1) = 1 and e^-0.5 for the two negative tokens
    out = _run("topr", {"level": "token"}, _row([0.3, -0.5], [-1.0, -1.0]))
    assert torch.allclose(
        out.diagnostics["is_weight"], torch.tensor([[1.0, math.exp(-0.5)]], dtype=D), atol=1e-12
    )
    # a very long negative trajectory never overflows: sum of log ratios 400 -> weight 1 (cap)
    out = _run("topr", {}, _row([4.0] * 100, [-1.0] * 100))
    assert torch.equal(out.diagnostics["is_weight"], torch.ones(1, 100, dtype=D))


def test_topr_against_behavior() -> None:
    # old = -1 (delta 0 -> ratio vs old is 1), behavior = old - (-0.4) = -0.6: log pi/mu = -1 - (-0.6) = -0.4
    inp = _row([0.0, 0.0], [-1.0, -1.0], behavior_shift=[-0.4, -0.4])
    out = _run("topr", {"ratio_against": "behavior"}, inp)
    w = math.exp(-0.8)  # sequence: sum of two -0.4
    assert torch.allclose(out.diagnostics["is_weight"], torch.full((1, 2), w, dtype=D), atol=1e-12)
    out = _run("topr", {}, inp)  # against old: ratio 1
    assert torch.equal(out.diagnostics["is_weight"], torch.ones(1, 2, dtype=D))
    with pytest.raises(ValueError, match="behavior_logprob"):
        _run("topr", {"ratio_against": "behavior"}, _row([0.0], [-1.0]))


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_hand() -> None:
    # r = 1.5, A = +1, tau_pos = 1: loss = -(4/1) sigmoid(0.5) = -2.4898...;
    # d loss / d lp = -A * 4 s (1 - s) * r with s = sigmoid(0.5)
    s = _sig(0.5)
    loss, g, out = _loss_grad("sapo", _one(math.log(1.5), 0.0, 1.0))
    assert loss == pytest.approx(-4 * s, abs=1e-12)
    assert g == pytest.approx(-4 * s * (1 - s) * 1.5, abs=1e-12)
    assert float(out.diagnostics["gate_weight"]) == pytest.approx(4 * s * (1 - s), abs=1e-12)
    # A = -1 uses tau_neg = 1.05: loss = (4 / 1.05) sigmoid(1.05 * 0.5); grad = 4 s'(1 - s') * 1.5
    s2 = _sig(1.05 * 0.5)
    loss, g, _ = _loss_grad("sapo", _one(math.log(1.5), 0.0, -1.0))
    assert loss == pytest.approx(4 / 1.05 * s2, abs=1e-12)
    assert g == pytest.approx(4 * s2 * (1 - s2) * 1.5, abs=1e-12)
    # far off-policy, the gate (and so the gradient) decays smoothly towards 0 instead of a hard cut
    _, g_far, _ = _loss_grad("sapo", _one(math.log(8.0), 0.0, 1.0))
    assert 0.0 > g_far > -0.05


def test_reinforce_hand() -> None:
    # loss = -A lp = -(0.5)(-2) = 1; gradient -A = -0.5; no ratio involved
    loss, g, _ = _loss_grad("reinforce", _one(-2.0, -7.0, 0.5))
    assert loss == pytest.approx(1.0, abs=1e-12) and g == pytest.approx(-0.5, abs=1e-12)


def test_decoupled_ppo_hand() -> None:
    # u = pi/prox = e^0.2 = 1.2214 > 1.2, A = +1 -> surrogate -1.2 (clipped);
    # w = prox/mu = e^(-1.2 - (-1.1)) = e^-0.1 -> loss -1.2 e^-0.1 = -1.085805
    inp = _one(-1.0, -1.2, 1.0, behavior=-1.1)
    loss, g, out = _loss_grad("decoupled_ppo", inp)
    assert loss == pytest.approx(-1.2 * math.exp(-0.1), abs=1e-12) and g == 0.0
    assert float(out.diagnostics["behavior_weight"]) == pytest.approx(math.exp(-0.1), abs=1e-12)
    # unclipped: u = e^0.1, A = -1 -> surrogate max(u, 0.8) = u; w = e^0.5: loss e^0.6, grad w * u = e^0.6
    inp = _one(-1.0, -1.1, -1.0, behavior=-1.6)
    loss, g, _ = _loss_grad("decoupled_ppo", inp)
    assert loss == pytest.approx(math.exp(0.6), abs=1e-12) and g == pytest.approx(math.exp(0.6), abs=1e-12)
    # cap 1.5 < e^0.5 = 1.6487: truncate -> w = 1.5; mask -> token dropped
    loss, _, out = _loss_grad("decoupled_ppo", _one(-1.0, -1.1, -1.0, behavior=-1.6), behavior_weight_cap=1.5)
    assert loss == pytest.approx(1.5 * math.exp(0.1), abs=1e-12)
    loss, g, out = _loss_grad(
        "decoupled_ppo", _one(-1.0, -1.1, -1.0, behavior=-1.6), behavior_weight_cap=1.5, cap_mode="mask"
    )
    assert loss == 0.0 and g == 0.0 and float(out.diagnostics["behavior_masked"]) == 1.0
    with pytest.raises(ValueError, match="behavior_logprob"):
        _run("decoupled_ppo", {}, _one(-1.0, -1.0, 1.0))


def test_extreme_log_ratio_gives_finite_gradient() -> None:
    # log r = 100 would overflow exp; the clamp keeps the backward free of 0 * inf
    for name, hp in VARIANTS:
        inp = _one(-0.01, -100.01, -1.0, behavior=-0.01)
        out = _run(name, hp, inp)
        (g,) = torch.autograd.grad(out.loss.sum(), inp.logprob)
        assert bool(torch.isfinite(out.loss).all()) and bool(torch.isfinite(g).all()), name


def test_bad_inputs_raise() -> None:
    good = _one(-1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="advantages"):
        POLICY_LOSSES["ppo_clip"](
            PolicyLossInputs(good.logprob, good.old_logprob, torch.ones(1, 2, dtype=D), good.action_mask)
        )
    with pytest.raises(ValueError, match="0/1"):
        POLICY_LOSSES["ppo_clip"](
            PolicyLossInputs(
                good.logprob, good.old_logprob, good.advantages, torch.full((1, 1), 0.5, dtype=D)
            )
        )
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        POLICY_LOSSES["reinforce"](
            PolicyLossInputs(
                torch.zeros(3, dtype=D),
                torch.zeros(3, dtype=D),
                torch.zeros(3, dtype=D),
                torch.ones(3, dtype=D),
            )
        )
    with pytest.raises(ValueError, match="dual_clip"):
        POLICY_LOSSES["ppo_clip"](good, dual_clip=0.5)
    with pytest.raises(ValueError, match="eps_low"):
        POLICY_LOSSES["cispo"](good, eps_low=1.5)
    with pytest.raises(ValueError, match="level"):
        POLICY_LOSSES["topr"](good, level="episode")
    with pytest.raises(TypeError):
        POLICY_LOSSES["gspo"](good, epsilon=0.2)  # unknown hyperparameter names fail loudly
    with pytest.raises(KeyError, match="valid"):
        POLICY_LOSSES["ppo"]


# ---------------------------------------------------------------- (4) gradcheck (float64)

# log ratios away from every clip boundary (eps 0.2 / 0.28 -> boundaries at log 0.8, log 1.2, log 1.28)
_DELTAS = torch.tensor([[0.05, -0.6, 0.5, 0.1, -0.03], [0.4, -0.1, 0.02, -0.5, 0.07]], dtype=D)
_ADV = torch.tensor([[1.0, -0.5, 2.0, -1.5, 0.3], [-1.0, 0.8, -0.2, 1.2, -2.0]], dtype=D)
_GMASK = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 0, 1, 1]], dtype=D)
_BASE = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, -1.2, -2.5, -0.9, -1.1]], dtype=D)
_BEH_SHIFT = torch.tensor([[0.1, -0.2, 0.3, 0.0, 0.05], [-0.1, 0.2, 0.0, 0.15, -0.3]], dtype=D)

# losses without stop-gradient inside: check against finite differences of the loss itself
_PLAIN = [
    ("ppo_clip", {}),
    ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0}),
    ("gspo", {"eps_low": 0.2, "eps_high": 0.2}),
    ("gspo", {}),
    ("sapo", {}),
    ("reinforce", {}),
    ("decoupled_ppo", {}),
    ("decoupled_ppo", {"behavior_weight_cap": 1.2}),
    ("decoupled_ppo", {"behavior_weight_cap": 1.2, "cap_mode": "mask"}),
]


@pytest.mark.parametrize(("name", "hp"), _PLAIN)
def test_gradcheck_plain(name: str, hp: dict[str, Any]) -> None:
    lp = (_BASE + _DELTAS).clone().requires_grad_(True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return _run(name, hp, PolicyLossInputs(x, _BASE, _ADV, _GMASK, _BASE - _BEH_SHIFT)).loss

    assert torch.autograd.gradcheck(f, (lp,), eps=1e-6, atol=1e-7)


# losses with a stop-gradient weight sg(w(log r)): move old with logprob so log r (and so the
# weight) stays fixed; finite differences then see exactly the documented gradient -w A.
_SG = [
    ("cispo", {}),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.28}),
    ("topr", {}),
    ("topr", {"level": "token"}),
    ("topr", {"ratio_against": "behavior"}),
]


@pytest.mark.parametrize(("name", "hp"), _SG)
def test_gradcheck_stop_gradient_weight(name: str, hp: dict[str, Any]) -> None:
    lp = (_BASE + _DELTAS).clone().requires_grad_(True)

    def f(x: torch.Tensor) -> torch.Tensor:
        old = x - _DELTAS  # log r fixed at _DELTAS
        beh = old - _BEH_SHIFT
        return _run(name, hp, PolicyLossInputs(x, old, _ADV, _GMASK, beh)).loss

    assert torch.autograd.gradcheck(f, (lp,), eps=1e-6, atol=1e-7)


def test_gradcheck_gspo_token_via_gspo() -> None:
    # GSPO-token's stop-gradients make a direct finite-difference check meaningless; the paper's
    # claim is that with a sequence advantage its gradient equals GSPO's, which is gradchecked above.
    adv = _ADV[:, :1].expand_as(_ADV)
    lp1 = (_BASE + _DELTAS).clone().requires_grad_(True)
    lp2 = (_BASE + _DELTAS).clone().requires_grad_(True)
    hp = {"eps_low": 0.2, "eps_high": 0.2}
    (g1,) = torch.autograd.grad(_run("gspo", hp, PolicyLossInputs(lp1, _BASE, adv, _GMASK)).loss.sum(), lp1)
    (g2,) = torch.autograd.grad(
        _run("gspo_token", hp, PolicyLossInputs(lp2, _BASE, adv, _GMASK)).loss.sum(), lp2
    )
    assert torch.allclose(g1, g2, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: _run("gspo", hp, PolicyLossInputs(x, _BASE, adv, _GMASK)).loss, (lp1,), eps=1e-6, atol=1e-7
    )


def test_inputs_are_detached_except_logprob() -> None:
    # a caller who forgets to detach old_logprob / advantages does not get gradients through them
    old = torch.tensor([[-1.1]], dtype=D, requires_grad=True)
    adv = torch.tensor([[1.0]], dtype=D, requires_grad=True)
    lp = torch.tensor([[-1.0]], dtype=D, requires_grad=True)
    for name, hp in VARIANTS:
        beh = torch.tensor([[-1.2]], dtype=D, requires_grad=True)
        out = _run(name, hp, PolicyLossInputs(lp, old, adv, torch.ones(1, 1, dtype=D), beh))
        assert out.loss.requires_grad
        grads = torch.autograd.grad(out.loss.sum(), (old, adv, beh), allow_unused=True)
        assert all(g is None for g in grads), name
