"""posttrain/algos/policy_objective.py: the composed objective sum w (c l_pg + beta kl - alpha H), its loss
mask (correction keep x DAPO truncation) and the log-kappa audit, against values computed by hand."""

from __future__ import annotations

import math

import torch

from posttrain.algos.policy_losses import PolicyLossInputs, PolicyLossOutputs
from posttrain.algos.policy_objective import (
    PolicyObjective,
    PolicyObjectiveInputs,
    logkappa_metrics,
    loss_mask,
    policy_objective,
)
from posttrain.algos.registry import KL_ESTIMATORS, REDUCTIONS


def _neg_lp_times_adv(x: PolicyLossInputs) -> PolicyLossOutputs:
    return PolicyLossOutputs(loss=-x.logprob * x.advantages, diagnostics={"tok": torch.ones_like(x.logprob)})


def test_objective_is_the_hand_computed_sum() -> None:
    # two rows, two tokens; row 1's second token is off the mask
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0], [-0.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    c = torch.tensor([[1.0, 0.5], [2.0, 1.0]], dtype=torch.float64)
    ent = torch.tensor([[0.2, 0.4], [0.6, 0.8]], dtype=torch.float64)
    obj = PolicyObjective(policy_loss=_neg_lp_times_adv, reduction=REDUCTIONS["token_mean"], kl=KL_ESTIMATORS["k1"],
                          beta=0.1, entropy_coef=0.01)
    out = policy_objective(PolicyObjectiveInputs(logprob=lp, old_logprob=lp.detach(), behavior_logprob=lp.detach(),
                                                 advantages=adv, loss_mask=mask, correction_weight=c, num_sequences=2,
                                                 num_tokens=4.0, ref_logprob=ref, entropy=ent), obj)
    # token_mean with N = 4 (the mini-batch's count, not these rows' 3): w = mask / 4
    pg = (1.0 * 1 * 1.0 + 0.5 * 2.0 * 1 + 2.0 * (-0.5 * 2.0)) / 4  # c * (-lp * A): 1 + 1 - 2 = 0
    kl = ((-1.0 + 1.5) + 0.0 + 0.0) / 4  # k1 = lp - ref
    h = (0.2 + 0.4 + 0.6) / 4
    assert math.isclose(float(out.pg), pg, abs_tol=1e-12)
    assert math.isclose(float(out.kl), kl, abs_tol=1e-12)
    assert math.isclose(float(out.entropy), h, abs_tol=1e-12)
    assert math.isclose(float(out.loss), pg + 0.1 * kl - 0.01 * h, abs_tol=1e-12)
    out.loss.backward()
    # d/d lp[0,0] = w * (c * -A + beta * 1) = (1 * -1 + 0.1) / 4
    assert math.isclose(float(lp.grad[0, 0]), (-1.0 + 0.1) / 4, abs_tol=1e-12)
    assert float(lp.grad[1, 1]) == 0.0  # off the mask


def test_no_kl_and_zero_entropy_coef_leave_only_the_policy_term() -> None:
    lp = torch.tensor([[-1.0]], dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    out = policy_objective(PolicyObjectiveInputs(logprob=lp, old_logprob=lp, behavior_logprob=lp, advantages=one,
                                                 loss_mask=one, correction_weight=one, num_sequences=1,
                                                 num_tokens=1.0, entropy=one),
                           PolicyObjective(policy_loss=_neg_lp_times_adv, reduction=REDUCTIONS["token_mean"]))
    assert out.kl is None and out.kl_token is None and out.entropy is None
    assert float(out.loss) == 1.0 and float(out.entropy_token.sum()) == 1.0  # H reported, not in the loss


def test_loss_mask_drops_truncated_rows_and_applies_the_correction() -> None:
    am = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    beh = torch.zeros(3, 2, dtype=torch.float64)

    class Out:
        weights = torch.full((3, 2), 0.5)
        keep = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
        diagnostics = {"w": torch.full((3, 2), 2.0)}

    lm = loss_mask(am, beh, beh, correction=lambda b, o, m: Out(), truncated=torch.tensor([False, False, True]))
    assert lm.mask.tolist() == [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]
    assert lm.weight.tolist() == [[0.5, 0.5]] * 3
    assert lm.info == {"correction/w": 2.0, "correction/kept_token_frac": 4 / 5, "truncated_rows_masked": 1.0}


def test_logkappa_splits_own_version_from_lagging_tokens() -> None:
    beh = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -1.0]])
    m = logkappa_metrics(beh, old, torch.ones(1, 3), torch.tensor([[4, 4, 3]]), version=4)
    assert m == {"logkappa/tokens": 2.0, "lag/tokens": 1.0, "logkappa_abs_mean": 0.25, "logkappa_abs_max": 0.5,
                 "lag/logratio_abs_mean": 2.0, "lag/logratio_abs_max": 2.0}
