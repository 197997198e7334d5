"""The critic: value alignment V(s_t) = head(h[t-1]), value regression, save/load."""

import pytest
import torch

from posttrain.learner.critic import CriticLearner, ValueModel


@pytest.mark.parametrize("shared", [False, True])
def test_values_are_aligned_to_the_state_before_each_token(make_model, make_batch, shared):
    lm, b = make_model(), make_batch(n=4)
    vm = ValueModel.from_actor(lm, shared_backbone=shared, seed=1)
    with torch.no_grad():
        values, final = vm(b.input_ids, b.attention_mask)
        h = vm.body(input_ids=b.input_ids, attention_mask=b.attention_mask).last_hidden_state
    w, c = vm.head.weight[0].detach(), vm.head.bias[0].detach()
    for i, n in enumerate(b.lengths.tolist()):
        assert values[i, 0] == 0.0
        for t in range(1, n):  # V(s_t) = w . h[t-1] + c: the prefix tokens_<t
            assert float(values[i, t]) == pytest.approx(float(h[i, t - 1] @ w + c), abs=1e-12)
        assert (values[i, n:] == 0).all()  # padding
        assert float(final[i]) == pytest.approx(float(h[i, n - 1] @ w + c), abs=1e-12)  # bootstrap


def test_shared_backbone_trains_only_the_head(make_model, make_batch):
    lm, b = make_model(), make_batch(n=4)
    own = ValueModel.from_actor(lm, shared_backbone=False)
    shared = ValueModel.from_actor(lm, shared_backbone=True)
    assert [n for n, _ in shared.named_parameters()] == ["head.weight", "head.bias"]
    assert sum(p.numel() for p in own.parameters()) > 100 * sum(p.numel() for p in shared.parameters())
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    returns = torch.ones(b.input_ids.shape, dtype=torch.float64) * b.action_mask
    CriticLearner(shared, lr=1e-2).update(b, returns)
    CriticLearner(own, lr=1e-2).update(b, returns)
    for k, v in lm.state_dict().items():  # the actor is untouched by either critic
        assert torch.equal(v, before[k])


def test_value_loss_decreases_on_a_fixed_target(make_model, make_batch):
    b = make_batch(n=8)
    g = torch.Generator().manual_seed(4)
    returns = torch.randn(b.input_ids.shape, generator=g, dtype=torch.float64) * b.action_mask
    critic = CriticLearner(
        ValueModel.from_actor(make_model(dtype=torch.float32)), lr=2e-2, microbatch_tokens=60
    )
    first = critic.update(b, returns)
    for _ in range(12):
        last = critic.update(b, returns)
    assert last["value_loss"] < 0.3 * first["value_loss"], (first, last)
    assert last["explained_variance"] > 0.5
    values, _ = critic.compute_values(b)
    assert (values[b.action_mask == 0] == 0).all()


def test_clipped_value_loss_reports_clipping(make_model, make_batch):
    b = make_batch(n=4)
    critic = CriticLearner(ValueModel.from_actor(make_model()), lr=0.0, clip_eps=0.1)
    old, _ = critic.compute_values(b)
    # V == V_old and R = V_old + 1: the clipped branch equals the unclipped one -> no clipping.
    m = critic.update(b, (old + 1.0) * b.action_mask, old_values=old)
    assert m["value_clip_frac"] == 0.0
    # V_old far from V (by 1.0, eps = 0.1) and R = V: the clipped branch is larger everywhere.
    m = critic.update(b, old, old_values=(old + 1.0) * b.action_mask)
    assert m["value_clip_frac"] == pytest.approx(1.0)


@pytest.mark.parametrize("shared", [False, True])
def test_save_load_round_trip(make_model, make_batch, tmp_path, shared):
    lm, b = make_model(), make_batch(n=3)
    vm = ValueModel.from_actor(lm, shared_backbone=shared, seed=1)
    vm.save(tmp_path / "critic")
    other = ValueModel.from_actor(lm if shared else make_model(seed=5), shared_backbone=shared, seed=2)
    other.load(tmp_path / "critic")
    with torch.no_grad():
        assert torch.equal(vm(b.input_ids, b.attention_mask)[0], other(b.input_ids, b.attention_mask)[0])
    with pytest.raises(ValueError, match="shared_backbone"):
        ValueModel.from_actor(lm, shared_backbone=not shared).load(tmp_path / "critic")


def test_critic_shares_the_actor_step_guards(make_model, make_batch):
    """The critic steps through the actor's OptimizerStepper: a zero gradient takes no step (AdamW
    decay would move the weights), a non-finite one is dropped and counted."""
    b = make_batch(n=4)
    critic = CriticLearner(ValueModel.from_actor(make_model(), shared_backbone=False, seed=1), lr=1e-2,
                           weight_decay=0.1)
    values, _ = critic.compute_values(b)
    before = {k: v.clone() for k, v in critic.model.state_dict().items()}
    m = critic.update(b, values.clone(), old_values=values)  # returns == values: zero loss, zero grad
    assert m["zero_grad_steps"] == 1.0 and m["optimizer_steps"] == 0.0 and m["nonfinite_steps"] == 0.0
    for k, v in critic.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    bad = values.clone()
    bad[b.action_mask > 0] = float("nan")
    m = critic.update(b, bad, old_values=values)
    assert m["nonfinite_steps"] == 1.0 and m["optimizer_steps"] == 0.0
    for k, v in critic.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    m = critic.update(b, values + b.action_mask.to(values.dtype), old_values=values)  # a real signal
    assert m["optimizer_steps"] == 1.0 and m["grad_norm"] > 0
