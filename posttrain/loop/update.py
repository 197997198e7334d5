"""The learner stage of the RL step (``update_step``): the actor (and critic) trained on the prepared batch.

Between the targets (:mod:`posttrain.loop.targets`) and the weight sync (:mod:`posttrain.loop.run`):
``system.engine_sleep`` first releases the engine's memory, then the learner's one ``update`` call runs every
epoch x mini-batch over the batch's tensors (:mod:`posttrain.learner.actor`; a pi_old fused into it is frozen
onto the batch afterwards), then the critic's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.loop.targets import Targets, with_fused_old
from posttrain.trajectory import TrajectoryBatch

if TYPE_CHECKING:
    from posttrain.learner.primitives import UpdateOutput
    from posttrain.loop.run import Run, StepMetrics


def train_batch(run: Run, batch: TrajectoryBatch, tg: Targets, fuse: bool, metrics: StepMetrics
                ) -> tuple[TrajectoryBatch, Targets, UpdateOutput, bool]:
    """Step 5: ``(batch, targets, update output, slept)``. The engine released (``system.engine_sleep``;
    ``slept``: it freed its weights, the sync wakes it), the actor's update under the recipe's reduction
    (correction: CORRECTIONS / decoupled PPO against the recorded behaviour log-probs, whatever the mode) and
    the critic's, both reading the batch's tensors. ``fuse``: pi_old is the update's own forward, frozen onto
    the batch and the targets afterwards (:func:`~posttrain.loop.targets.with_fused_old`, at the version
    before the update). Adds ``update/fused_old_logprob``, the learner's metrics and ``critic/*``."""
    slept = run.release_engine()  # the engine frees its weights while the learner updates
    parts = run.parts
    old_version = parts.learner.version
    out = parts.learner.update(batch, fuse_old=fuse)
    upd = dict(out.metrics)
    if fuse:
        assert out.old_logprob is not None
        batch, tg = with_fused_old(batch, tg, out.old_logprob, old_version, parts.cfg.loss.kl_estimator)
    metrics["update/fused_old_logprob"] = float(fuse)
    if parts.critic is not None and batch.returns is not None:
        upd.update({f"critic/{k}": v for k, v in parts.critic.update(batch).items()})
    metrics.update(upd)
    return batch, tg, out, slept


__all__ = ["train_batch"]
