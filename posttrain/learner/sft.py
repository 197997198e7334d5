"""Supervised warm-up (SFT) on prompt -> reference-answer pairs before RL.

Loss: mean negative log-likelihood of the answer tokens (and the closing eos) given the prompt,
token-mean over the batch: ``L = -sum_{i,t} m_it log pi(y_it | x_i, y_i,<t) / sum m_it``.
Each step is one :class:`~posttrain.learner.trainer.Trainer` update of one mini-batch (the step's
pairs, in micro-batches of at most ``microbatch_tokens`` padded tokens: the run's
``optim.microbatch_tokens``, as every other update): the same AdamW, schedule and step rules as the
RL learners, with the warm-up's settings of :func:`sft_optimizer_settings`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from posttrain.learner.microbatch import split_by_token_budget
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import Trainer
from posttrain.trajectory import collate, make_trajectory

#: ``(prompt_ids, answer_ids_with_eos)``: one demonstration.
SFTPair = tuple[list[int], list[int]]


def sft_optimizer_settings(steps: int, lr: float) -> OptimizerSettings:
    """The warm-up's optimiser: AdamW(``lr``, weight decay 0.01), the learning rate decaying linearly to
    10% over ``steps`` optimiser steps, the gradient norm clipped to 1."""
    return OptimizerSettings(lr=lr, weight_decay=0.01, lr_schedule="linear", total_steps=max(steps, 1),
                             min_lr_ratio=0.1, max_grad_norm=1.0)


class AnswerNLL:
    """The SFT :class:`~posttrain.learner.trainer.MinibatchLoss` of one batch of ``pairs``: the answer
    tokens' summed negative log-likelihood over the mini-batch's answer-token count, accumulated over
    micro-batches of at most ``microbatch_tokens`` padded tokens (None: one forward). ``last_loss`` holds
    the value of the last backward."""

    def __init__(self, model: torch.nn.Module, pairs: Sequence[SFTPair], pad_token_id: int,
                 microbatch_tokens: int | None = None) -> None:
        trajs = [
            make_trajectory(
                traj_id=str(i), prompt_id=str(i), group_id=str(i), prompt_ids=p, action_ids=a,
                action_logprobs=[0.0] * len(a), action_versions=0, finish="terminal",
            )
            for i, (p, a) in enumerate(pairs)
        ]
        self.model, self.batch = model, collate(trajs, pad_token_id=pad_token_id)
        self.lengths = [t.length for t in trajs]
        self.microbatch_tokens = microbatch_tokens
        self.last_loss = 0.0

    def normaliser(self, rows: Sequence[int]) -> float:
        """Answer tokens (with their eos) of the rows."""
        return float(self.batch.action_mask[list(rows), 1:].sum())

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """Token-mean NLL of the rows' answers over ``normaliser`` (the mini-batch's answer tokens), one
        forward and backward per micro-batch (each trimmed to its longest row); gradients accumulate."""
        rows = list(rows)
        groups = ([list(range(len(rows)))] if self.microbatch_tokens is None
                  else split_by_token_budget([self.lengths[r] for r in rows], self.microbatch_tokens))
        total = 0.0
        for group in groups:
            sub = [rows[i] for i in group]
            idx = torch.as_tensor(sub, dtype=torch.long)
            width = max(self.lengths[r] for r in sub)  # right-padded: the columns after it are padding
            ids = self.batch.input_ids[idx, :width]
            logits = self.model(input_ids=ids, attention_mask=self.batch.attention_mask[idx, :width]).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            mask = self.batch.action_mask[idx, 1:width].to(lp.dtype)
            loss = -(lp * mask).sum() / torch.tensor(normaliser, dtype=lp.dtype)
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
        self.last_loss = total


def run_sft(
    model: torch.nn.Module,
    batches: Callable[[int], Sequence[SFTPair]],
    *,
    steps: int,
    lr: float,
    pad_token_id: int,
    on_step: Callable[[int, float], None] | None = None,
    microbatch_tokens: int | None = None,
) -> list[float]:
    """``steps`` optimiser steps (:func:`sft_optimizer_settings`) on ``batches(step)``, the model in train
    mode (eval mode after), each step's batch in micro-batches of at most ``microbatch_tokens`` padded
    tokens (None: one forward); returns the loss curve (one float per step) and calls ``on_step(step, loss)``."""
    trainer = Trainer(list(model.parameters()), sft_optimizer_settings(steps, lr), BatchingSettings())
    model.train()
    losses: list[float] = []
    for s in range(steps):
        pairs = batches(s)
        nll = AnswerNLL(model, pairs, pad_token_id, microbatch_tokens)
        trainer.train(len(pairs), nll)
        losses.append(nll.last_loss)
        if on_step is not None:
            on_step(s, losses[-1])
    model.eval()
    return losses
