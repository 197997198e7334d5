"""The revision judgement: promote, retain or reject the weights after a held-out evaluation.

A revision whose held-out accuracy is the best so far is *promoted* (its weights are kept as the
snapshot to fall back to); one that drops more than ``eval.reject_drop`` below the best is *rejected*
(the promoted weights are restored); anything else is *retained*. A non-finite loss rejects the
revision the same way. The figures (best accuracy, promoted step, decisions) live in the run's
checkpointed :class:`~posttrain.loop.run.RunState`; the snapshot goes into the checkpoint's learner
state as ``promoted``. A restore goes through the learner that owns the weights
(:meth:`~posttrain.learner.protocol.Learner.load_weights`), so learner ranks take the restored weights too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Protocol

import torch

log = logging.getLogger("posttrain")

#: One entry of ``RunState.decisions``: ``step``, ``decision`` and ``accuracy`` or ``reason``.
Decision = dict[str, int | float | str]


class RevisionRecord(Protocol):
    """The checkpointed figures of the judgement (met by :class:`~posttrain.loop.run.RunState`)."""

    best_heldout_accuracy: float
    promoted_step: int
    decisions: list[Decision]


class LoadsWeights(Protocol):
    """The learner whose driver copy is judged (:class:`~posttrain.learner.protocol.Learner`): a restore writes
    the driver copy and the learner's own weights (learner ranks: their replicas) at once."""

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...


@dataclasses.dataclass
class Promotion:
    """The judge of a run's revisions: ``model``'s weights, the ``record`` it keeps its figures in,
    the drop below the best accuracy that rejects (``reject_drop``) and the promoted ``snapshot``.
    ``learner``: the learner whose driver copy ``model`` is; a rejection restores through its
    ``load_weights`` (learner ranks get the weights pushed); ``None``: a bare model, restored in place."""

    model: torch.nn.Module
    record: RevisionRecord
    reject_drop: float
    snapshot: dict[str, torch.Tensor] | None = None
    learner: LoadsWeights | None = None

    def judge(self, step: int, accuracy: float) -> tuple[str, str]:
        """Judge the weights evaluated after ``step`` at held-out ``accuracy``; returns ``(decision, reason)``.

        Rejected (a collapse: ``accuracy`` below best - ``reject_drop``, once there is a best) restores
        the snapshot (the caller syncs the engine); promoted (``accuracy`` >= best) snapshots the weights;
        else retained. Every decision is appended to ``record.decisions``.
        """
        rec = self.record
        if rec.best_heldout_accuracy >= 0 and accuracy < rec.best_heldout_accuracy - self.reject_drop:
            reason = f"held-out accuracy {accuracy:.3f} collapsed below best {rec.best_heldout_accuracy:.3f}"
            self.reject(step, reason)
            return "rejected", reason
        decision = "retained"
        if accuracy >= rec.best_heldout_accuracy:
            decision = "promoted"
            rec.best_heldout_accuracy, rec.promoted_step = accuracy, step
            self.snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        rec.decisions.append({"step": step, "decision": decision, "accuracy": accuracy})
        return decision, ""

    def reject(self, step: int, reason: str) -> None:
        """Restore the promoted weights (if any) into ``model`` — through ``learner.load_weights`` when there is a
        learner, so that its ranks hold them too — and record the rejection and ``reason``."""
        if self.snapshot is not None and self.learner is not None:
            self.learner.load_weights(self.snapshot)
        elif self.snapshot is not None:
            self.model.load_state_dict(self.snapshot)
        self.record.decisions.append({"step": step, "decision": "rejected", "reason": reason})
        log.warning("step %d: revision rejected: %s", step, reason)


__all__ = ["Decision", "LoadsWeights", "Promotion", "RevisionRecord"]
