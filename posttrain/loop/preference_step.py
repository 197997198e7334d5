"""One preference step's pieces, shared by the offline and the online trainer: the step's pairs with their
reference log-probs (:class:`PairBatch`), their loss as the learners' :class:`~posttrain.learner.trainer.Trainer`
takes it (:class:`PairBatchLoss`: the mean over pairs of the preference loss, micro-batched), the step loop of
both pairwise trainers (:func:`run_pair_steps`, also the reward-model trainer's) and what a preference run
returns (:class:`PreferenceRunResult`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import torch

from posttrain.config import RunConfig
from posttrain.diagnostics.tolerance import compute_dtype, shape_rtol
from posttrain.learner.trainer import MinibatchLoss, Trainer
from posttrain.loop.interrupt import raise_if_interrupted
from posttrain.loop.metrics_log import MetricsLog
from posttrain.loop.preference_batch import EncodedPair, pair_chunks, sequence_logprobs
from posttrain.loop.preference_loss import PairLogprobs, kto_reference_point, preference_loss

if TYPE_CHECKING:
    from rich.progress import Progress


class PairStepLoss(MinibatchLoss, Protocol):
    """A pairwise trainer's loss of one step's pairs: a :class:`~posttrain.learner.trainer.MinibatchLoss` whose
    ``metrics`` (``loss`` ...) are filled by the step's backward passes."""

    metrics: dict[str, float]


def batch_indices(n: int, batch_size: int, cursor: int, seed: int) -> list[int]:
    """Indices of the ``batch_size`` training pairs at data cursor ``cursor`` (of ``n`` pairs): pass
    ``k = cursor // n`` walks ``torch.randperm(n)`` seeded by ``(seed, k)``; a batch may span two passes."""
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(cursor, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        take = perm[offset: offset + batch_size - len(out)]
        out.extend(take)
        cursor += len(take)
    return out


def run_pair_steps(cfg: RunConfig, *, step: int, cursor: int, num_train: int,
                   step_loss: Callable[[list[int]], PairStepLoss], trainer: Trainer, metrics: MetricsLog,
                   evaluate: Callable[[int], None], checkpoint: Callable[[int, int], None],
                   progress: Progress | None, label: str) -> tuple[int, int]:
    """Steps ``step + 1 .. cfg.steps`` of a pairwise trainer (preference optimisation, the reward model);
    returns the final ``(step, cursor)``.

    Contract: each step takes ``preference.batch_size`` training pairs from ``cursor`` on
    (:func:`batch_indices`, a seeded pass over ``num_train`` pairs),
    builds their loss with ``step_loss(rows)``, takes one ``trainer.train`` update, and logs the loss's metrics
    with the optimiser's, ``lr``, ``pairs_seen`` and ``step_seconds``; ``evaluate(step)`` runs every
    ``eval.every`` steps and at the last, ``checkpoint(step, cursor)`` every ``checkpoint_every`` steps and at
    the last (and once at step 0 when there are no steps). An interrupt that
    :func:`~posttrain.loop.interrupt.interrupt_flag` recorded and a finalizer swallowed raises
    ``KeyboardInterrupt`` before the next step."""
    bar = progress.add_task(label, total=cfg.steps, completed=step) if progress is not None else None
    while step < cfg.steps:
        raise_if_interrupted()  # a Ctrl-C a finalizer swallowed stops the run here, between steps
        t0 = time.perf_counter()
        rows = batch_indices(num_train, cfg.preference.batch_size, cursor, cfg.seed)
        loss = step_loss(rows)
        tally = trainer.train(len(rows), loss)
        step, cursor = step + 1, cursor + len(rows)
        metrics.log(step, {**loss.metrics, **tally.steps.metrics(), "lr": tally.steps.lr, "pairs_seen": cursor,
                           "step_seconds": time.perf_counter() - t0})
        if step % cfg.eval.every == 0 or step == cfg.steps:
            evaluate(step)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
            checkpoint(step, cursor)
        if progress is not None and bar is not None:
            progress.update(bar, completed=step, description=f"{label} loss {loss.metrics['loss']:.3f}")
    if step == 0:
        checkpoint(step, cursor)
    return step, cursor


@dataclasses.dataclass
class PreferenceRunResult:
    """What a preference run did: ``step`` (steps done), ``wall_seconds``, the held-out ``curve``
    (``(step, value)`` of ``curve_name``) and ``stopped`` (a reason, or None)."""

    step: int
    wall_seconds: float
    curve_name: str
    curve: list[tuple[int, float]]
    stopped: str | None = None

    def summary_lines(self) -> list[str]:
        """The lines ``posttrain train`` prints at the end."""
        pts = ", ".join(f"{s}:{v:.3f}" for s, v in self.curve)
        lines = [f"done: {self.step} steps in {self.wall_seconds:.0f} s; {self.curve_name} by step {pts}"]
        if len(self.curve) >= 2:
            lines.append(f"  {self.curve_name}: {self.curve[0][1]:.3f} -> {self.curve[-1][1]:.3f}")
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}")
        return lines


@dataclasses.dataclass(frozen=True)
class PairBatch:
    """Encoded pairs with their reference log-probs (``ref_*`` ``[B]``, None without a reference)."""

    pairs: Sequence[EncodedPair]
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None

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
