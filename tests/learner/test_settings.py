"""Typed learner settings (posttrain/learner/settings.py): the flat keyword form maps onto them field for
field, so both forms build the same learner."""

from __future__ import annotations

import pytest
import torch

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.critic import CriticLearner, ValueModel
from posttrain.learner.settings import (
    BatchingSettings,
    LoraSettings,
    OptimizerSettings,
    PolicyLossSettings,
    PolicySettings,
    SamplerReplay,
    policy_settings,
)


def test_flat_names_land_in_their_groups():
    s = policy_settings(PolicySettings(), {"lr": 0.5, "ppo_epochs": 3, "seed": 7, "reduction": "seq_mean_token_mean",
                                           "policy_loss_kwargs": None, "top_p": 0.9, "lora_rank": 4})
    assert s.optim.lr == 0.5 and s.batching == BatchingSettings(epochs=3, seed=7)
    assert s.loss.reduction == "seq_mean_token_mean" and s.loss.policy_loss_kwargs == {}
    assert s.sampler == SamplerReplay(top_p=0.9) and s.lora == LoraSettings(rank=4)
    with pytest.raises(TypeError, match="epochs"):
        policy_settings(PolicySettings(), {"epochs": 2})  # type: ignore[typeddict-unknown-key]


def test_settings_validate_at_construction():
    with pytest.raises(ValueError, match="num_minibatches"):
        BatchingSettings(num_minibatches=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplerReplay(temperature=0.0)


def test_policy_learner_flat_and_typed_give_the_same_update(make_model, make_batch, make_advantages):
    batch = make_batch(n=8)
    adv = make_advantages(batch)
    flat = PolicyLearner(make_model(), lr=1e-2, num_minibatches=2, ppo_epochs=2, microbatch_tokens=30,
                         reduction="seq_mean_token_mean", entropy_coef=0.01, seed=3)
    typed = PolicyLearner(make_model(), optim=OptimizerSettings(lr=1e-2),
                          batching=BatchingSettings(epochs=2, num_minibatches=2, microbatch_tokens=30, seed=3),
                          loss=PolicyLossSettings(reduction="seq_mean_token_mean", entropy_coef=0.01))
    assert flat.settings == typed.settings
    # Equal settings build the same learner: the same ops on the same shapes in one process, so the
    # updates are bit-equal on any CPU (a tolerance would hide a setting mapped to the wrong field).
    assert flat.update(batch, adv) == typed.update(batch, adv)
    for (k, v), w in zip(flat.model.state_dict().items(), typed.model.state_dict().values(), strict=True):
        assert torch.equal(v, w), k


def test_critic_flat_and_typed_give_the_same_update(make_model, make_batch):
    batch = make_batch(n=6)
    returns = torch.ones(batch.input_ids.shape, dtype=torch.float64) * batch.action_mask
    flat = CriticLearner(ValueModel.from_actor(make_model(), seed=1), lr=1e-2, epochs=2, num_minibatches=3, seed=4)
    typed = CriticLearner(ValueModel.from_actor(make_model(), seed=1), optim=OptimizerSettings(lr=1e-2),
                          batching=BatchingSettings(epochs=2, num_minibatches=3, seed=4))
    assert flat.trainer.batching == typed.trainer.batching
    assert flat.update(batch, returns) == typed.update(batch, returns)
    with pytest.raises(TypeError, match="ppo_epochs"):
        CriticLearner(ValueModel.from_actor(make_model()), ppo_epochs=2)  # type: ignore[call-arg]


@pytest.mark.parametrize("flag", [False, True])
def test_optim_gradient_checkpointing_reaches_the_policy_learner(flag: bool) -> None:
    """``optim.gradient_checkpointing`` is the learner's ``compute.gradient_checkpointing`` (the recipe key
    that lowers a micro-batch's activation memory: docs/benchmarks.md, ``posttrain bench memory``)."""
    from posttrain.loop.builders import build_model, build_policy_learner
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config("grpo", ["model.path=builtin:micro", f"optim.gradient_checkpointing={str(flag).lower()}"])
    _, model = build_model(cfg)
    learner = build_policy_learner(cfg, model)
    assert learner.gradient_checkpointing is flag
