"""One preference step's pieces, shared by the offline and the online trainer: the step's pairs with their
reference log-probs (:class:`PairBatch`), their loss as the learners' :class:`~posttrain.learner.trainer.Trainer`
takes it (:class:`PairBatchLoss`: the mean over pairs of the preference loss, micro-batched), and what a
preference run returns (:class:`PreferenceRunResult`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from posttrain.config import RunConfig
from posttrain.loop.preference_batch import EncodedPair, pair_chunks, sequence_logprobs
from posttrain.loop.preference_loss import PairLogprobs, kto_reference_point, preference_loss


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

    def logprobs(self, rows: Sequence[int], chosen: torch.Tensor, rejected: torch.Tensor) -> PairLogprobs:
        """:class:`PairLogprobs` of pairs ``rows`` given their policy log-probs."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        sub = [self.pairs[i] for i in rows]

        def ref(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx].to(chosen.dtype)

        lengths = [torch.tensor([float(len(getattr(p, side))) for p in sub], dtype=chosen.dtype)
                   for side in ("chosen", "rejected")]
        diffs = [p.score_diff for p in sub]
        score = None if any(d is None for d in diffs) else torch.tensor(diffs, dtype=chosen.dtype)
        return PairLogprobs(chosen, rejected, ref(self.ref_chosen), ref(self.ref_rejected), lengths[0], lengths[1],
                            score)


class PairBatchLoss:
    """The :class:`~posttrain.learner.trainer.MinibatchLoss` of one step's pairs: the mean over pairs of the
    preference loss (KTO: over its ``2B`` responses), accumulated over micro-batches of pairs. ``metrics``
    holds the loss and the mean of each diagnostic after :meth:`backward`."""

    def __init__(self, model: torch.nn.Module, batch: PairBatch, cfg: RunConfig, pad_id: int) -> None:
        self.model, self.batch, self.pad_id = model, batch, pad_id
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
        return self.batch.logprobs(rows, lp[: len(sub)], lp[len(sub):])

    def backward(self, rows: Sequence[int], normaliser: float) -> None:
        """Forward and backward of pairs ``rows`` in micro-batches; gradients accumulate."""
        rows = list(rows)
        z0: torch.Tensor | float = 0.0
        if self.loss == "kto":  # the batch's KL estimate, from a no-grad pass over all its pairs
            with torch.no_grad():
                z0 = kto_reference_point(self._policy(rows))
        sums: dict[str, float] = {}
        for chunk in pair_chunks([self.batch.pairs[i] for i in rows], self.microbatch_tokens):
            lp = self._policy([rows[i] for i in chunk])
            loss, diag = preference_loss(self.loss, self.kwargs, lp, kl_ref_point=z0)
            (loss.sum() / normaliser).backward()  # type: ignore[no-untyped-call]
            for k, v in {"loss": loss.detach(), **diag}.items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
        self.metrics = {k: v / normaliser for k, v in sums.items()}
