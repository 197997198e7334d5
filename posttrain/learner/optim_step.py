"""One optimiser step over accumulated gradients, shared by every learner (actor, critic, SFT).

The :class:`~posttrain.learner.trainer.Trainer` accumulates a mini-batch's gradient over micro-batches
and then calls :meth:`OptimizerStepper.step`, which decides — the same way for every learner — whether
the step is taken:

1. clip the global L2 norm to ``max_grad_norm`` (``None``: measure only);
2. a non-finite norm (NaN / inf anywhere in the gradient) -> the gradient is dropped, no step,
   counted as ``nonfinite_steps``;
3. an exactly-zero norm -> no step, counted as ``zero_grad_steps``: AdamW's momentum and decoupled
   weight decay would otherwise move the weights on a mini-batch that carries no signal;
4. otherwise ``optimizer.step()`` then ``scheduler.step()`` (the LR used is recorded).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """One optimiser step: ``applied`` (AdamW and the schedule stepped), ``grad_norm`` the pre-clip global L2
    norm (None when not finite), ``lr`` the learning rate used (None when not applied), ``skipped``
    ``"nonfinite"`` / ``"zero_grad"`` / None."""

    applied: bool
    grad_norm: float | None
    lr: float | None
    skipped: str | None = None


@dataclasses.dataclass
class StepTally:
    """Outcomes of the optimiser steps of one ``update`` call (reset per call)."""

    steps: int = 0
    nonfinite: int = 0
    zero_grad: int = 0
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    lr: float | None = None  # LR of the last step taken; None when none was taken

    def record(self, outcome: StepOutcome) -> None:
        """Count one step's outcome (a finite norm joins ``grad_norms``; an applied step sets ``lr``)."""
        if outcome.grad_norm is not None:
            self.grad_norms.append(outcome.grad_norm)
        if outcome.skipped == "nonfinite":
            self.nonfinite += 1
        elif outcome.skipped == "zero_grad":
            self.zero_grad += 1
        if outcome.applied:
            self.steps += 1
            self.lr = outcome.lr

    def metrics(self) -> dict[str, float]:
        """``optimizer_steps``, ``nonfinite_steps``, ``zero_grad_steps``, ``grad_norm`` (mean of the
        finite pre-clip norms), ``grad_norm_max``."""
        n = self.grad_norms
        return {
            "optimizer_steps": float(self.steps),
            "nonfinite_steps": float(self.nonfinite),
            "zero_grad_steps": float(self.zero_grad),
            "grad_norm": sum(n) / len(n) if n else 0.0,
            "grad_norm_max": max(n) if n else 0.0,
        }


class OptimizerStepper:
    """Clip, guard and apply one optimiser step (module docstring for the rules).

    ``params`` are the trainable parameters whose ``.grad`` holds the accumulated mini-batch
    gradient; ``optimizer`` / ``scheduler`` are torch objects; ``max_grad_norm`` > 0 or ``None``.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.params = list(params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm

    def current_lr(self) -> float:
        """Learning rate the next step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def apply(self) -> StepOutcome:
        """Apply the rules to the current gradients (module docstring) and say what happened."""
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, self.max_grad_norm if self.max_grad_norm is not None else math.inf
        )
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return StepOutcome(applied=False, grad_norm=None, lr=None, skipped="nonfinite")
        if float(norm) == 0.0:
            return StepOutcome(applied=False, grad_norm=0.0, lr=None, skipped="zero_grad")
        lr = self.current_lr()
        self.optimizer.step()
        self.scheduler.step()
        return StepOutcome(applied=True, grad_norm=float(norm), lr=lr)

    def step(self, tally: StepTally) -> bool:
        """:meth:`apply`, recorded in ``tally``; True if stepped."""
        outcome = self.apply()
        tally.record(outcome)
        return outcome.applied

__all__ = ["OptimizerStepper", "StepOutcome", "StepTally"]
