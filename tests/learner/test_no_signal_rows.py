"""Rows without signal (advantage 0 on every token) skip the backward: same gradient, same records."""

import sys
from pathlib import Path

import pytest
import torch

from posttrain.algos.policy_losses import PolicyLossOutputs
from posttrain.algos.registry import POLICY_LOSSES
from posttrain.learner.actor import PolicyLearner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, scaled_maxdiff, shape_rtol, update_rel_diff  # noqa: E402

KW = dict(policy_loss="ppo_clip", policy_loss_kwargs={"eps_low": 0.2, "eps_high": 0.28},
          reduction="seq_mean_token_mean", microbatch_tokens=40)


def _advantages(batch, quiet_groups=(0, 2)):
    """Per-row advantages, exactly 0 on every row of the groups in ``quiet_groups`` (4 rows a group)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(batch.size, generator=g, dtype=torch.float64)
    for q in quiet_groups:
        a[4 * q: 4 * q + 4] = 0.0
    return a[:, None] * batch.action_mask.to(torch.float64)


def _old(learner, batch):
    """pi_old != pi_theta, so ratios and clipping are exercised on the quiet rows too."""
    g = torch.Generator().manual_seed(5)
    old = learner.compute_logprobs(batch)
    return (old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3) \
        * batch.action_mask.to(torch.float64)


def test_gradient_and_metrics_equal_with_and_without_the_skip(make_model, make_batch):
    batch = make_batch(n=16)
    adv = _advantages(batch)
    res = {}
    for skip in (False, True):
        learner = PolicyLearner(make_model(), lr=1e-3, skip_no_signal_rows=skip, **KW)
        assert learner.no_signal_rows_skippable() is skip
        res[skip] = learner.compute_gradients(batch, adv, old_logprob=_old(learner, batch))
    (loss0, g0), (loss1, g1) = res[False], res[True]
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-4
    rtol = shape_rtol(int(batch.lengths.max()))
    assert loss1 == pytest.approx(loss0, rel=rtol, abs=1e-12)
    assert_grads_close(g1, g0, rtol, msg="skip vs no skip")


def test_tolerance_catches_a_signal_row_left_out(make_model, make_batch):
    """The bug this guards against: a row WITH signal treated as quiet (its gradient lost)."""
    batch = make_batch(n=16)
    adv = _advantages(batch)
    wrong = adv.clone()
    wrong[4] = 0.0  # row 4 (group 1) has signal; dropping it is what a wrong row test would do
    grads = []
    for a in (adv, wrong):
        learner = PolicyLearner(make_model(), lr=1e-3, **KW)
        grads.append(learner.compute_gradients(batch, a, old_logprob=_old(learner, batch))[1])
    rtol = shape_rtol(int(batch.lengths.max()))
    with pytest.raises(AssertionError):
        assert_grads_close(grads[1], grads[0], rtol)


def test_update_records_and_weights_match_and_rows_are_counted(make_model, make_batch):
    """The fused update (pi_old from its own forward): weights after the step, the recorded pi_old and
    pi_theta agree with the unskipped update; the quiet rows are counted."""
    batch = make_batch(n=16)
    adv = _advantages(batch)
    out = {}
    for skip in (False, True):
        learner = PolicyLearner(make_model(), lr=1e-2, skip_no_signal_rows=skip, **KW)
        m = learner.update(batch, adv, fuse_old=True)
        out[skip] = (m, {k: v.detach().clone() for k, v in learner.model.state_dict().items()},
                     m.old_logprob, m.current_logprob)
    (m0, w0, old0, cur0), (m1, w1, old1, cur1) = out[False], out[True]
    assert m0["no_signal_rows"] == 0.0 and m1["no_signal_rows"] == 8.0
    assert m1["optimizer_steps"] == 1.0
    rtol = shape_rtol(int(batch.lengths.max()))
    # log-probs of quiet rows come from a forward of another micro-batch shape: close, not bitwise
    assert old0 is not None and old1 is not None and cur0 is not None and cur1 is not None
    assert (old1[8:12] != 0).any() and (old1[0:4] != 0).any()  # quiet rows are recorded, not left at 0
    assert scaled_maxdiff(old1, old0) <= rtol and scaled_maxdiff(cur1, cur0) <= rtol
    assert m1["ratio_mean"] == pytest.approx(m0["ratio_mean"], abs=rtol)
    # Whole updates compared as in test_actor (Adam amplifies rounding on near-eps elements: 100x)
    start = make_model().state_dict()
    assert update_rel_diff(w1, w0, start) <= 100 * rtol


def test_all_rows_quiet_takes_no_step(make_model, make_batch):
    batch = make_batch(n=8)
    learner = PolicyLearner(make_model(), lr=1e-2, **KW)
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    m = learner.update(batch, torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float64), fuse_old=True)
    assert m["no_signal_rows"] == 8.0 and m["optimizer_steps"] == 0.0 and m["zero_grad_steps"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in learner.model.state_dict().items())
    assert m.old_logprob is not None and (m.old_logprob != 0).any()


@pytest.mark.parametrize("extra", [dict(entropy_coef=0.01), dict(kl_estimator="k3", kl_coef=0.1)])
def test_not_skipped_when_another_term_has_a_gradient(make_model, extra):
    assert not PolicyLearner(make_model(), **KW, **extra).no_signal_rows_skippable()


def test_not_skipped_for_a_loss_that_does_not_vanish_at_zero_advantage(make_model):
    name = "_test_length_penalty_loss"

    @POLICY_LOSSES.register(name)
    def length_penalty(inputs, *, coef: float = 0.01):
        """A loss with a term independent of A (pushes log-probs up on every token)."""
        loss = (-inputs.advantages * inputs.logprob - coef * inputs.logprob) * inputs.action_mask
        return PolicyLossOutputs(loss=loss, diagnostics={})

    try:
        learner = PolicyLearner(make_model(), policy_loss=name, reduction="token_mean")
        assert not learner.no_signal_rows_skippable()
    finally:
        POLICY_LOSSES.unregister(name)


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "reinforce", "sapo", "topr", "decoupled_ppo",
                                  "gspo_token"])
def test_builtin_losses_vanish_at_zero_advantage(make_model, loss):
    assert PolicyLearner(make_model(), policy_loss=loss).no_signal_rows_skippable()
