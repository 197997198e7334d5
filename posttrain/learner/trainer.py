"""The one training skeleton of every learner (policy, critic, SFT), and its resumable state.

One :meth:`Trainer.train` call is::

    for epoch in range(epochs):
        for rows in minibatch_rows(num_rows, num_minibatches, generator):  # one shuffle draw per epoch
            zero the gradients
            n = loss.normaliser(rows)           # the mini-batch's loss-token count
            if n == 0: count an empty mini-batch, next
            loss.backward(rows, n)              # token-budget micro-batches, gradients accumulate
            OptimizerStepper.step               # clip; skip a non-finite or zero gradient; AdamW + schedule
    zero the gradients

A learner supplies only its :class:`MinibatchLoss`: the policy's clipped surrogate
(:mod:`posttrain.learner.actor`), the critic's clipped value loss (:mod:`posttrain.learner.critic`), the
SFT negative log-likelihood (:mod:`posttrain.learner.sft`). The loss of a mini-batch is reduced with the
*mini-batch's* counts (the normaliser), so it is the same however :func:`~posttrain.learner.microbatch.microbatches`
splits the rows. :meth:`Trainer.state_dict` holds everything the skeleton owns under one set of keys
(:data:`TRAINER_STATE_KEYS`), so a resumed run draws the same shuffles and schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from posttrain.learner.microbatch import minibatch_rows
from posttrain.learner.optim_step import OptimizerStepper, StepOutcome, StepTally
from posttrain.learner.schedule import (
    build_optimizer,
    build_scheduler,
    load_schedule_state,
    recipe_hyperparameters,
)
from posttrain.learner.settings import BatchingSettings, OptimizerSettings

#: The keys of :meth:`Trainer.state_dict` (a learner may add its own beside them).
TRAINER_STATE_KEYS = ("optimizer", "scheduler", "generator", "optimizer_steps")


class MinibatchLoss(Protocol):
    """What a learner gives the :class:`Trainer`: the loss of one mini-batch, as gradients."""

    def normaliser(self, rows: Sequence[int]) -> float:
        """The mini-batch's loss-token count (the reductions' ``num_tokens``); 0 skips the mini-batch."""
        ...

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """Forward and backward of mini-batch ``rows`` (in micro-batches), reduced with the mini-batch's
        ``normaliser``: the gradients accumulate in the parameters' ``.grad``; metrics are the loss's own."""
        ...


@dataclasses.dataclass
class TrainTally:
    """What one :meth:`Trainer.train` call did: mini-batches visited, how many were empty (no loss
    token: skipped without a step), and the optimiser steps' outcomes."""

    minibatches: int = 0
    empty: int = 0
    steps: StepTally = dataclasses.field(default_factory=StepTally)

    @property
    def trained(self) -> int:
        """Mini-batches that had a loss (``minibatches - empty``)."""
        return self.minibatches - self.empty


class Trainer:
    """Epochs x mini-batches x micro-batches x optimiser step over ``params`` (module docstring).

    Owns AdamW and its schedule (:mod:`posttrain.learner.schedule`, from ``optim``), the
    :class:`~posttrain.learner.optim_step.OptimizerStepper`, the mini-batch shuffle generator (seeded by
    ``batching.seed``) and the count of optimiser steps taken.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], optim: OptimizerSettings,
                 batching: BatchingSettings) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.batching = batching
        self.optimizer = build_optimizer(
            self.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, eps=optim.adam_eps
        )
        self.scheduler = build_scheduler(
            self.optimizer, optim.lr_schedule, warmup_steps=optim.warmup_steps,
            total_steps=optim.total_steps, min_lr_ratio=optim.min_lr_ratio,
        )
        self.stepper = OptimizerStepper(self.params, self.optimizer, self.scheduler, optim.max_grad_norm)
        self.generator = torch.Generator().manual_seed(batching.seed)
        self.optimizer_steps = 0

    @property
    def microbatch_tokens(self) -> int | None:
        """Padded-token budget of one micro-batch (``None``: the whole mini-batch)."""
        return self.batching.microbatch_tokens

    def current_lr(self) -> float:
        """Learning rate the next optimiser step will use."""
        return self.stepper.current_lr()

    def train(self, num_rows: int, loss: MinibatchLoss) -> TrainTally:
        """One update over rows ``0..num_rows-1``: ``batching.epochs`` x ``batching.num_minibatches``
        mini-batches, each accumulated by ``loss`` and stepped once (module docstring)."""
        tally = TrainTally()
        for _ in range(self.batching.epochs):
            for rows in minibatch_rows(num_rows, self.batching.num_minibatches, self.generator):
                tally.minibatches += 1
                if not self.accumulate(rows, loss):
                    tally.empty += 1
                    continue
                tally.steps.record(self.step())
        self.optimizer.zero_grad(set_to_none=True)
        return tally

    def step(self) -> StepOutcome:
        """One optimiser step over the accumulated gradients (:meth:`OptimizerStepper.apply`: clip, skip a
        non-finite or zero gradient, AdamW + schedule); counts an applied step in :attr:`optimizer_steps`."""
        outcome = self.stepper.apply()
        if outcome.applied:
            self.optimizer_steps += 1
        return outcome

    def accumulate(self, rows: Sequence[int], loss: MinibatchLoss) -> bool:
        """Zero the gradients, then leave mini-batch ``rows``' gradient in ``.grad`` (no step); False
        (and no forward) when the mini-batch has no loss token."""
        self.optimizer.zero_grad(set_to_none=True)
        n = loss.normaliser(rows)
        if n == 0:
            return False
        loss.backward(rows, n)
        return True

    def state_dict(self) -> dict[str, object]:
        """Optimizer, scheduler, shuffle generator and optimiser-step count (:data:`TRAINER_STATE_KEYS`)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: Mapping[str, object], *, owner: str,
                        also_needs: Sequence[str] = ()) -> None:
        """Inverse of :meth:`state_dict`. ``ValueError`` naming ``owner`` when ``state`` lacks one of
        :data:`TRAINER_STATE_KEYS` or of the owner's own keys ``also_needs``."""
        missing = set(TRAINER_STATE_KEYS).union(also_needs) - set(state)
        if missing:
            raise ValueError(f"{owner} state is missing {sorted(missing)}")
        with recipe_hyperparameters(self.optimizer):  # a forced resume's changed optim.* takes effect
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        load_schedule_state(self.scheduler, state["scheduler"])  # type: ignore[arg-type]
        generator_state = state["generator"]
        assert isinstance(generator_state, torch.Tensor)
        self.generator.set_state(generator_state)
        self.optimizer_steps = int(state["optimizer_steps"])  # type: ignore[call-overload]


__all__ = ["TRAINER_STATE_KEYS", "MinibatchLoss", "Trainer", "TrainTally"]
