"""The one trainer skeleton (posttrain/learner/trainer.py): the walk over epochs x mini-batches, the
optimiser steps it takes, and the state that resumes it."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch

from posttrain.learner.microbatch import minibatch_rows
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import TRAINER_STATE_KEYS, Trainer


class _Quadratic:
    """Loss ``sum_{r in rows} w[r] * (x - target[r])^2 / normaliser``; rows whose ``tokens`` are 0
    carry no loss token. Records every call."""

    def __init__(self, x: torch.nn.Parameter, target: torch.Tensor, tokens: Sequence[int]) -> None:
        self.x, self.target, self.tokens = x, target, list(tokens)
        self.calls: list[tuple[list[int], float]] = []

    def normaliser(self, rows: Sequence[int]) -> float:
        return float(sum(self.tokens[r] for r in rows))

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        self.calls.append((list(rows), normaliser))
        idx = torch.as_tensor(list(rows))
        w = torch.as_tensor(self.tokens, dtype=torch.float64)[idx]
        ((w * (self.x - self.target[idx]) ** 2).sum() / normaliser).backward()


def _trainer(x: torch.nn.Parameter, *, epochs: int = 2, minibatches: int = 3, seed: int = 5) -> Trainer:
    return Trainer([x], OptimizerSettings(lr=0.1, max_grad_norm=None),
                   BatchingSettings(epochs=epochs, num_minibatches=minibatches, seed=seed))


def test_walks_each_epochs_shuffle_and_steps_once_per_minibatch():
    """The mini-batches are minibatch_rows' draws of the seeded generator, one draw per epoch, each
    reduced with its own token count; one AdamW step each, and the step equals a hand-run AdamW."""
    x = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    target, tokens = torch.arange(7, dtype=torch.float64), [1, 2, 1, 3, 1, 1, 2]
    loss = _Quadratic(x, target, tokens)
    tally = _trainer(x).train(7, loss)

    g = torch.Generator().manual_seed(5)
    expected = [rows for _ in range(2) for rows in minibatch_rows(7, 3, g)]
    assert [rows for rows, _ in loss.calls] == expected
    assert [n for _, n in loss.calls] == [float(sum(tokens[r] for r in rows)) for rows in expected]
    assert (tally.minibatches, tally.empty, tally.steps.steps) == (6, 0, 6)

    y = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = torch.optim.AdamW([y], lr=0.1, weight_decay=0.0)
    for rows in expected:
        opt.zero_grad()
        w = torch.as_tensor(tokens, dtype=torch.float64)[rows]
        ((w * (y - target[rows]) ** 2).sum() / w.sum()).backward()
        opt.step()
    assert float(x.detach()) == float(y.detach())


def test_a_minibatch_without_loss_tokens_is_counted_and_not_stepped():
    x = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    loss = _Quadratic(x, torch.ones(2, dtype=torch.float64), [0, 1])
    trainer = _trainer(x, epochs=1, minibatches=2)
    tally = trainer.train(2, loss)
    assert (tally.minibatches, tally.empty, tally.trained, trainer.optimizer_steps) == (2, 1, 1, 1)
    assert [rows for rows, _ in loss.calls] == [[1]]  # the empty mini-batch never runs a forward


def test_state_dict_resumes_the_same_shuffles_and_steps():
    x = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    target, tokens = torch.arange(5, dtype=torch.float64), [1] * 5
    a = _trainer(x)
    a.train(5, _Quadratic(x, target, tokens))
    state = copy.deepcopy(a.state_dict())  # as a checkpoint holds it (the live dict aliases AdamW's buffers)
    assert tuple(state) == TRAINER_STATE_KEYS

    y = torch.nn.Parameter(x.detach().clone())
    b = _trainer(y, seed=99)
    b.load_state_dict(state, owner="test")
    assert b.optimizer_steps == a.optimizer_steps == 6
    la, lb = _Quadratic(x, target, tokens), _Quadratic(y, target, tokens)
    a.train(5, la)
    b.train(5, lb)
    assert la.calls == lb.calls and float(x.detach()) == float(y.detach())


def test_load_state_dict_names_the_owner_and_the_missing_keys():
    x = torch.nn.Parameter(torch.zeros(()))
    state = _trainer(x).state_dict()
    del state["generator"]
    with pytest.raises(ValueError, match=r"critic learner state is missing \['generator', 'version'\]"):
        _trainer(x).load_state_dict(state, owner="critic learner", also_needs=("version",))


def test_learner_state_keys_are_the_checkpoints_keys(make_model):
    """Checkpoints written before the trainer skeleton hold exactly these keys: they must still resume."""
    from posttrain.algos.kl import AdaptiveKLController
    from posttrain.learner.actor import PolicyLearner
    from posttrain.learner.critic import CriticLearner, ValueModel

    pre = {"optimizer", "scheduler", "generator", "version", "optimizer_steps"}
    assert set(PolicyLearner(make_model()).state_dict()) == pre
    controlled = PolicyLearner(make_model(), kl_coef=AdaptiveKLController(0.1, 0.05, 100))
    assert set(controlled.state_dict()) == pre | {"kl_controller"}
    assert set(CriticLearner(ValueModel.from_actor(make_model())).state_dict()) == pre - {"version"}
