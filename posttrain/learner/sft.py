"""Supervised warm-up (SFT) on prompt -> reference-answer pairs before RL, over the learner's primitives.

Loss: mean negative log-likelihood of the answer tokens (and the closing eos) given the prompt,
token-mean over the batch: ``L = -sum_{i,t} m_it log pi(y_it | x_i, y_i,<t) / sum m_it`` (the model's own
softmax at temperature 1, untruncated: :class:`AnswerNLL`, a
:class:`~posttrain.learner.primitives.TokenLoss`). Each step is one
:func:`~posttrain.learner.primitives.forward_backward` of the step's pairs on the learner's *driver copy*
(``learner.driver_context()``: micro-batches of at most the learner's ``microbatch_tokens`` padded tokens)
and one step of the warm-up's own :class:`~posttrain.learner.trainer.Trainer` (:func:`sft_optimizer_settings`:
the same AdamW, schedule and step rules as the RL learners, other settings). The warm-up keeps its own
optimiser because its AdamW moments and linear schedule belong to the phase: RL starts from a fresh optimiser
state, as every recorded run did (tests/loop/golden). Because that optimiser steps the driver's copy of the
model, the gradients must land there: the warm-up asks for the driver copy's context explicitly, and the
learner ranks' ``forward_backward`` (which trains the ranks' replicas) is never used here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from posttrain.learner.microbatch import Microbatch
from posttrain.learner.primitives import ForwardContext, ForwardSpec, LossBatch, LossTerms, forward_backward
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import Trainer
from posttrain.trajectory import collate, make_trajectory

#: ``(prompt_ids, answer_ids_with_eos)``: one demonstration.
SFTPair = tuple[list[int], list[int]]


class SupervisedLearner(Protocol):
    """What the warm-up needs of a learner: the forward context of the driver's copy of the model (met by
    :class:`~posttrain.learner.actor.PolicyLearner`, whose model is that copy, and by
    :class:`~posttrain.learner.ranks.LearnerRanks`, whose ranks then get the warmed weights)."""

    def driver_context(self) -> ForwardContext: ...


def sft_optimizer_settings(steps: int, lr: float) -> OptimizerSettings:
    """The warm-up's optimiser: AdamW(``lr``, weight decay 0.01), the learning rate decaying linearly to
    10% over ``steps`` optimiser steps, the gradient norm clipped to 1."""
    return OptimizerSettings(lr=lr, weight_decay=0.01, lr_schedule="linear", total_steps=max(steps, 1),
                             min_lr_ratio=0.1, max_grad_norm=1.0)


class AnswerNLL:
    """The SFT token loss: ``-sum(m * log pi) / N`` over a micro-batch's answer tokens ``m`` (action mask from
    column 1), ``N`` the mini-batch's answer-token count (so the micro-batch losses sum to the mean)."""

    spec = ForwardSpec(sampler_replay=False, autocast=False)

    def __call__(self, logprob: torch.Tensor, entropy: torch.Tensor | None, mb: Microbatch,
                 batch: LossBatch) -> LossTerms:
        """The micro-batch's share of the mean NLL (``logprob`` ``[b, t]``, 0 at column 0)."""
        mask = mb["action_mask"][:, 1:].to(logprob.dtype)
        return LossTerms(loss=-(logprob[:, 1:] * mask).sum() / torch.tensor(batch.num_tokens, dtype=logprob.dtype))

    def metric_keys(self) -> tuple[list[str], list[str], list[str]]:
        """No metrics besides the loss."""
        return [], [], []

    def rows_without_gradient(self, batch: LossBatch, rows: Sequence[int]) -> list[int]:
        """Every row is trained."""
        return []


def sft_batch(pairs: Sequence[SFTPair], pad_token_id: int, device: torch.device) -> LossBatch:
    """The pairs collated into one mini-batch (every row) on ``device``; ``num_tokens``: the answer tokens."""
    trajs = [make_trajectory(traj_id=str(i), prompt_id=str(i), group_id=str(i), prompt_ids=p, action_ids=a,
                             action_logprobs=[0.0] * len(a), action_versions=0, finish="terminal")
             for i, (p, a) in enumerate(pairs)]
    b = collate(trajs, pad_token_id=pad_token_id)
    tensors = {"input_ids": b.input_ids.to(device), "attention_mask": b.attention_mask.to(device),
               "action_mask": b.action_mask.to(device)}
    return LossBatch(tensors, list(range(len(pairs))), float(b.action_mask[:, 1:].sum()))


def run_sft(
    learner: SupervisedLearner,
    batches: Callable[[int], Sequence[SFTPair]],
    *,
    steps: int,
    lr: float,
    pad_token_id: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """``steps`` SFT steps on ``batches(step)``: :func:`~posttrain.learner.primitives.forward_backward` with
    :class:`AnswerNLL` on ``learner.driver_context()`` (the driver's copy of the model), then one step of the
    warm-up's optimiser (:func:`sft_optimizer_settings`) over that copy, in train mode (eval mode after);
    returns the loss curve (one float per step) and calls ``on_step(step, loss)``."""
    ctx = learner.driver_context()
    model = ctx.model
    trainer = Trainer(list(model.parameters()), sft_optimizer_settings(steps, lr), BatchingSettings())
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    for s in range(steps):
        batch = sft_batch(batches(s), pad_token_id, device)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(ctx, batch, AnswerNLL()).loss if batch.num_tokens else 0.0
        if batch.num_tokens:
            trainer.step()
        losses.append(loss)
        if on_step is not None:
            on_step(s, losses[-1])
    trainer.optimizer.zero_grad(set_to_none=True)
    model.eval()
    return losses


__all__ = ["AnswerNLL", "SupervisedLearner", "run_sft", "sft_batch", "sft_optimizer_settings"]
