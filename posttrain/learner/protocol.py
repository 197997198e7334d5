"""The learner as the training loop sees it: one Protocol, met by the in-process learner
(:class:`~posttrain.learner.actor.PolicyLearner`) and by the learner ranks
(:class:`~posttrain.learner.ranks.LearnerRanks`, ``learner.strategy=ddp|fsdp2``).

The members follow the few primitives post-training services have converged on (Thinking Machines'
Tinker API: ``forward`` / ``forward_backward`` / ``optim_step`` / ``save_weights_for_sampler`` /
``save_state`` / ``load_state``), so a remote or sharded learner is one more implementation:

==========================  =====================================================================
Tinker primitive            here
==========================  =====================================================================
``forward`` (log-probs)     :meth:`Learner.compute_logprobs` — pi_old / pi_theta of a batch, frozen
``forward_backward``        :meth:`Learner.forward_backward` — one mini-batch's gradients with a token loss
                            (:mod:`posttrain.learner.primitives`); returns its log-probs, loss, metrics
``optim_step``              :meth:`Learner.optim_step` — clip / skip / AdamW + schedule; ``version`` + 1
(the RL program)            :meth:`Learner.update` — epochs x mini-batches of the two above over the
                            policy objective; returns an :class:`~posttrain.learner.primitives.UpdateOutput`
``save_weights_for_sampler`` :meth:`Learner.weights_for_rollout` — the plain (LoRA-merged) weights
                            the engine loads under :attr:`Learner.version`
``save_state``/``load_state`` :meth:`Learner.state_dict` / :meth:`Learner.load_state_dict`
==========================  =====================================================================

:meth:`Learner.forward_backward` trains the learner's own weights (on learner ranks: the ranks' replicas,
whatever the driver does with its copy). A phase that trains the driver's copy :attr:`Learner.model` with its
own optimiser (the SFT warm-up, :func:`~posttrain.learner.sft.run_sft`) says so: it runs
:func:`~posttrain.learner.primitives.forward_backward` on :meth:`Learner.driver_context`. Every other write of
:attr:`Learner.model` says so too: :meth:`Learner.load_weights` (a rejected revision restoring the promoted
weights) or :meth:`Learner.mark_driver_written` after writing it in place (a resume's ``restore_actor``); the
learner ranks then push the driver copy to their replicas, the in-process learner has nothing to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from posttrain.learner.optim_step import StepOutcome
from posttrain.learner.primitives import (
    ForwardBackwardOutput,
    ForwardContext,
    LossBatch,
    TokenLoss,
    UpdateOutput,
)
from posttrain.learner.trainer import MinibatchLoss
from posttrain.trajectory import TrajectoryBatch


class KLCoefficient(Protocol):
    """A KL coefficient controller (``posttrain.algos.kl``): ``.value`` is the current beta."""

    @property
    def value(self) -> float: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: Mapping[str, float]) -> None: ...


@runtime_checkable
class Learner(Protocol):
    """What the loop calls on a policy learner (see the module docstring for the primitive each is).

    ``kl_coef``: beta, fixed or an adaptive controller (``builders.build_kl_coef``; the loss applies it,
    or the token rewards with ``credit.kl_in_reward``); ``model``: the driver's copy of the actor (checkpoints, SFT warm-up, promotion snapshots);
    ``temperature`` / ``top_k`` / ``top_p``: the sampler settings its log-probs replay (the reference
    model reads them).
    """

    model: torch.nn.Module
    version: int
    kl_coef: float | KLCoefficient
    temperature: float
    top_k: int
    top_p: float

    def compute_logprobs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """Frozen per-token log-probs ``[B, T]`` (float64, CPU, 0 off the action mask) under the current weights."""
        ...

    def forward_backward(self, batch: LossBatch, loss: TokenLoss) -> ForwardBackwardOutput:
        """One mini-batch's forward and backward with ``loss``; gradients accumulate until :meth:`optim_step`."""
        ...

    def driver_context(self) -> ForwardContext:
        """The forward context of the driver's copy :attr:`model` (the in-process learner's own context): its
        gradients land in :attr:`model`, for a phase that steps it with its own optimiser (the SFT warm-up)."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write ``state`` (a state dict of :attr:`model`) into the driver copy and the learner's own weights:
        afterwards the learner trains and samples from ``state`` (learner ranks: pushed to them now)."""
        ...

    def mark_driver_written(self) -> None:
        """The driver copy :attr:`model` was written in place outside the learner (a resume's ``restore_actor``):
        the learner takes those weights before its next call (the in-process learner: they are its weights)."""
        ...

    def forward_backward_custom(self, rows: list[int], loss: MinibatchLoss) -> ForwardBackwardOutput:
        """The gradients of a loss that runs its own forward (a pair loss), over ``rows``."""
        ...

    def minibatch_plan(self, num_rows: int) -> list[list[int]]:
        """The epochs x shuffled mini-batches of one update over ``num_rows`` rows (advances the generator)."""
        ...

    def optim_step(self, *, ends_update: bool = True) -> StepOutcome:
        """Step the optimiser over the accumulated gradients, zero them; ``ends_update``: ``version`` + 1."""
        ...

    def update(self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
               old_logprob: torch.Tensor | None = None, fuse_old: bool = False) -> UpdateOutput:
        """Train on one rollout batch (all its optimizer steps); ``version`` + 1; metrics, fused pi_old and
        the log-probs the update saw."""
        ...

    def can_fuse_old_logprob(self) -> bool:
        """Whether pi_old may come from the update's own forward (one optimizer step, one process)."""
        ...

    def current_kl_coef(self) -> float:
        """beta this step applies (a fixed coefficient or the adaptive controller's value)."""
        ...

    def weights_for_rollout(self) -> Mapping[str, torch.Tensor]:
        """The weights the engine loads, with plain parameter names (LoRA merged)."""
        ...

    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume exactly (optimizer, schedule, shuffle generator, version, KL controller)."""
        ...

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        ...

    def close(self) -> None:
        """Release processes or memory the learner holds (idempotent)."""
        ...


__all__ = ["KLCoefficient", "Learner"]
