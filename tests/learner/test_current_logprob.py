"""``PolicyLearner.update(...).current_logprob``: pi_theta per token as the update saw it (issue 15, part 1).

Each row's value comes from the forward of the last optimiser step that included it, taken before
that step: with one step per update it is pi_old; with two epochs it is the policy after the first
step, and ``exp(current - old)`` is the ratio the second step clipped."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from posttrain.learner.actor import PolicyLearner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol  # noqa: E402


def test_one_step_update_records_pi_old_as_current(make_model, make_batch, make_advantages):
    batch = make_batch(n=8)
    adv = make_advantages(batch)
    learner = PolicyLearner(make_model(), lr=1e-2, microbatch_tokens=30)
    old = learner.compute_logprobs(batch)
    cur = learner.update(batch, adv, old_logprob=old).current_logprob
    assert cur is not None and cur.shape == old.shape and cur.dtype == torch.float64
    assert (cur[batch.action_mask == 0] == 0).all()
    assert torch.isfinite(cur).all()
    tol = shape_rtol(int(batch.lengths.max())) * float(old.abs().max())
    torch.testing.assert_close(cur, old, rtol=0, atol=tol)


def test_two_epochs_record_the_policy_after_the_first_step(make_model, make_batch, make_advantages):
    batch = make_batch(n=8)
    adv = make_advantages(batch)
    two = PolicyLearner(make_model(), lr=5e-2, ppo_epochs=2)
    old = two.compute_logprobs(batch)
    m = two.update(batch, adv, old_logprob=old)
    # The same first step on a twin learner, then a no-grad forward: the policy epoch 2 saw.
    one = PolicyLearner(make_model(), lr=5e-2, ppo_epochs=1)
    one.update(batch, adv, old_logprob=old)
    after_first = one.compute_logprobs(batch)
    cur = m.current_logprob
    assert cur is not None
    tol = 10 * shape_rtol(int(batch.lengths.max())) * float(old.abs().max())
    torch.testing.assert_close(cur, after_first, rtol=0, atol=tol)
    on = batch.action_mask > 0
    assert float((cur - old)[on].abs().max()) > 100 * tol  # the step moved the policy: not pi_old again
    # ratio_max is over both epochs: epoch 1's ratios are 1, epoch 2's are exp(current - old).
    expected = max(1.0, float(torch.exp(cur - old)[on].max()))
    assert abs(m["ratio_max"] - expected) <= 1e-6 * expected


def test_fused_update_records_current_equal_to_its_pi_old(make_model, make_batch, make_advantages):
    batch = make_batch(n=6)
    learner = PolicyLearner(make_model(), lr=1e-2)
    out = learner.update(batch, make_advantages(batch), fuse_old=True)
    assert out.old_logprob is not None and out.current_logprob is not None
    # The same forward supplies both: identical, not merely close.
    assert torch.equal(out.current_logprob, out.old_logprob)
