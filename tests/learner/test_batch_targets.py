"""The actor and critic updates read pi_old, advantages, returns and old values from the batch
(issue 12): passing them explicitly or attaching them to the batch is the same update."""

from __future__ import annotations

import pytest
import torch

from posttrain.learner import CriticLearner, PolicyLearner, ValueModel


def test_actor_update_reads_advantages_and_pi_old_from_the_batch(make_model, make_batch, make_advantages):
    batch = make_batch()
    adv = make_advantages(batch)
    a, b = PolicyLearner(make_model(), lr=1e-2), PolicyLearner(make_model(), lr=1e-2)
    # pi_old deliberately off the current policy, so a silent on-policy recompute would change the ratio
    old = a.compute_logprobs(batch) - 0.2 * batch.action_mask
    ma = a.update(batch, adv, old_logprob=old)
    mb = b.update(batch.freeze("old", old, 0).with_targets(advantages=adv))
    assert ma["loss"] == mb["loss"] and ma["optimizer_steps"] == mb["optimizer_steps"] == 1.0
    assert ma["ratio_mean"] > 1.1  # the shifted pi_old was used
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_actor_update_without_advantages_names_the_fix(make_model, make_batch):
    with pytest.raises(ValueError, match="with_targets"):
        PolicyLearner(make_model()).update(make_batch())


def test_critic_update_reads_returns_and_old_values_from_the_batch(make_model, make_batch):
    batch = make_batch()
    g = torch.Generator().manual_seed(3)
    returns = torch.randn(tuple(batch.input_ids.shape), generator=g, dtype=torch.float64) * batch.action_mask
    ca = CriticLearner(ValueModel.from_actor(make_model(), seed=1), lr=1e-2, clip_eps=0.2)
    cb = CriticLearner(ValueModel.from_actor(make_model(), seed=1), lr=1e-2, clip_eps=0.2)
    values, final = ca.compute_values(batch)
    # old values deliberately off the current ones, so a silent recompute would change the clipping
    ma = ca.update(batch, returns, old_values=values + 0.3 * batch.action_mask)
    mb = cb.update(batch.with_targets(returns=returns, values=values + 0.3 * batch.action_mask, final_values=final))
    assert ma == mb and ma["value_clip_frac"] > 0
    for p, q in zip(ca.model.parameters(), cb.model.parameters(), strict=True):
        assert torch.equal(p, q)
