"""One preference step's pieces, shared by the offline and the online trainer: the step's pairs with their
reference log-probs (:class:`PairBatch`, :func:`reference_batch`), their loss as the learners'
:class:`~posttrain.learner.trainer.Trainer` takes it (:class:`PairBatchLoss`: the mean over pairs of the
preference loss, micro-batched), the step of both offline pairwise trainers over the shared run lifecycle
(:func:`pair_step`, :data:`PAIR_CURVE`; also the reward-model trainer's) and what a preference run returns
(:data:`PreferenceRunResult`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from posttrain.config import RunConfig
from posttrain.diagnostics.tolerance import compute_dtype, shape_rtol
from posttrain.learner.trainer import MinibatchLoss, Trainer
from posttrain.loop.lifecycle import Curve, RunResult, StepOutput, data_rows
from posttrain.loop.preference_batch import EncodedPair, pair_chunks, pair_logprobs, sequence_logprobs
from posttrain.loop.preference_loss import PairLogprobs, kto_reference_point, preference_loss


class PairStepLoss(MinibatchLoss, Protocol):
    """A pairwise trainer's loss of one step's pairs: a :class:`~posttrain.learner.trainer.MinibatchLoss` whose
    ``metrics`` (``loss`` ...) are filled by the step's backward passes."""

    metrics: dict[str, float]


def pair_step(cfg: RunConfig, trainer: Trainer, num_train: int,
              step_loss: Callable[[list[int]], PairStepLoss]) -> Callable[[int, int], StepOutput]:
    """The step function (:meth:`~posttrain.loop.lifecycle.RunLifecycle.run`) of an offline pairwise trainer
    (preference optimisation, the reward model).

    Contract: step ``(step, cursor)`` takes ``preference.batch_size`` training pairs from ``cursor`` on
    (:func:`~posttrain.loop.lifecycle.data_rows`, a seeded pass over ``num_train`` pairs), builds their loss
    with ``step_loss(rows)``, takes one ``trainer.train`` update and returns the cursor after them with the
    loss's metrics, the optimiser's and ``lr`` (the lifecycle adds ``pairs_seen`` and ``step_seconds``)."""
    def step(at: int, cursor: int) -> StepOutput:
        rows = data_rows(num_train, cfg.preference.batch_size, cursor, cfg.seed)
        loss = step_loss(rows)
        tally = trainer.train(len(rows), loss)
        return StepOutput(cursor + len(rows), {**loss.metrics, **tally.steps.metrics(), "lr": tally.steps.lr})

    return step


PAIR_CURVE = Curve("heldout/pair_accuracy", "held-out pair accuracy", cursor_key="pairs_seen")
"""The held-out curve of the offline pairwise trainers; their data cursor is logged as ``pairs_seen``."""

PreferenceRunResult = RunResult
"""What a preference run returns (offline, online and the reward model's): the lifecycle's
:class:`~posttrain.loop.lifecycle.RunResult`."""


@dataclasses.dataclass(frozen=True)
class PairBatch:
    """Encoded pairs with their reference log-probs (``ref_*`` ``[B]``, None without a reference)."""

    pairs: Sequence[EncodedPair]
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None

    def take(self, rows: Sequence[int]) -> PairBatch:
        """The pairs ``rows`` with their reference log-probs, in that order."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        return PairBatch([self.pairs[i] for i in rows],
                         *(None if t is None else t[idx] for t in (self.ref_chosen, self.ref_rejected)))

    def logprobs(self, rows: Sequence[int], chosen: torch.Tensor, rejected: torch.Tensor,
                 model_dtype: torch.dtype | None = None) -> PairLogprobs:
        """:class:`PairLogprobs` of pairs ``rows`` given their policy log-probs. With ``model_dtype`` (the
        policy's parameter dtype) each pair gets ``rtol = shape_rtol(n, compute_dtype(model_dtype))``, ``n`` its
        longer row (prompt + response: the most terms an attention softmax of that row sums), the rounding
        within which its policy and reference log-probs, computed in other batch shapes, agree
        (:mod:`posttrain.diagnostics.tolerance`); None: no tie band."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        sub = [self.pairs[i] for i in rows]
        rtol = None if model_dtype is None else torch.tensor(
            [shape_rtol(len(p.prompt) + max(len(p.chosen), len(p.rejected)), compute_dtype(model_dtype)) for p in sub],
            dtype=chosen.dtype)

        def ref(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx].to(chosen.dtype)

        lengths = [torch.tensor([float(len(getattr(p, side))) for p in sub], dtype=chosen.dtype)
                   for side in ("chosen", "rejected")]
        diffs = [p.score_diff for p in sub]
        score = None if any(d is None for d in diffs) else torch.tensor(diffs, dtype=chosen.dtype)
        return PairLogprobs(chosen, rejected, ref(self.ref_chosen), ref(self.ref_rejected), lengths[0], lengths[1],
                            score, rtol)


def reference_batch(ref: torch.nn.Module | None, pairs: Sequence[EncodedPair], *, pad_id: int,
                    microbatch_tokens: int) -> PairBatch:
    """``pairs`` with ``ref``'s sequence log-probs (:func:`~posttrain.loop.preference_batch.pair_logprobs` in
    micro-batches of ``microbatch_tokens``; None for a reference-free loss)."""
    if ref is None:
        return PairBatch(list(pairs), None, None)
    c, r = pair_logprobs(ref, pairs, pad_id=pad_id, microbatch_tokens=microbatch_tokens)
    return PairBatch(list(pairs), c, r)


class PairBatchLoss:
    """The :class:`~posttrain.learner.trainer.MinibatchLoss` of one step's pairs: the mean over pairs of the
    preference loss (KTO: over its ``2B`` responses), accumulated over micro-batches of pairs. ``metrics``
    holds the loss and the mean of each diagnostic after :meth:`backward`. ``grad_mode`` wraps each
    micro-batch's forward and backward (the policy learner's :meth:`~posttrain.learner.actor.PolicyLearner.grad_mode`
    online, so its activation checkpointing acts; offline none)."""

    def __init__(self, model: torch.nn.Module, batch: PairBatch, cfg: RunConfig, pad_id: int,
                 grad_mode: Callable[[], AbstractContextManager[object]] = nullcontext) -> None:
        self.model, self.batch, self.pad_id, self.grad_mode = model, batch, pad_id, grad_mode
        self.loss, self.kwargs = cfg.preference.loss, cfg.preference.kwargs
        self.microbatch_tokens = cfg.optim.microbatch_tokens
        self.metrics: dict[str, float] = {}

    def normaliser(self, rows: Sequence[int]) -> float:
        """Pairs of the mini-batch (KTO: responses, two per pair)."""
        return float(len(rows) * (2 if self.loss == "kto" else 1))

    def _policy(self, rows: Sequence[int]) -> PairLogprobs:
        sub = [self.batch.pairs[i] for i in rows]
        lp = sequence_logprobs(self.model, [(p.prompt, p.chosen) for p in sub] + [(p.prompt, p.rejected) for p in sub],
                               pad_id=self.pad_id)
        dtype = next(self.model.parameters()).dtype
        return self.batch.logprobs(rows, lp[: len(sub)], lp[len(sub):], model_dtype=dtype)

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """Forward and backward of pairs ``rows`` in micro-batches; gradients accumulate."""
        rows = list(rows)
        z0: torch.Tensor | float = 0.0
        if self.loss == "kto":  # the batch's KL estimate, from a no-grad pass over all its pairs
            with torch.no_grad():
                z0 = kto_reference_point(self._policy(rows))
        sums: dict[str, float] = {}
        for chunk in pair_chunks([self.batch.pairs[i] for i in rows], self.microbatch_tokens):
            with self.grad_mode():  # the policy learner's: train mode when it checkpoints activations
                lp = self._policy([rows[i] for i in chunk])
                loss, diag = preference_loss(self.loss, self.kwargs, lp, kl_ref_point=z0)
                (loss.sum() / normaliser).backward()  # type: ignore[no-untyped-call]
            for k, v in {"loss": loss.detach(), **diag}.items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
        self.metrics = {k: v / normaliser for k, v in sums.items()}
