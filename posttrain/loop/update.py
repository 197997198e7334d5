"""The learner stage of the RL step (``update_step``): the actor (and critic) trained on the prepared batch.

Between the targets (:mod:`posttrain.loop.targets`) and the weight sync (:mod:`posttrain.loop.run`):
``system.engine_sleep`` first releases the engine's memory (:func:`release_engine`), then the learner's one
``update`` call runs every epoch x mini-batch over the batch's tensors (:mod:`posttrain.learner.actor`; a
pi_old fused into it is frozen onto the batch afterwards), then the critic's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from posttrain.loop.targets import Targets, with_fused_old
from posttrain.trajectory import TrajectoryBatch

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.learner.primitives import UpdateOutput
    from posttrain.loop.parts import Parts
    from posttrain.loop.run import StepMetrics

log = logging.getLogger("posttrain")

_NO_SLEEP = "engine_sleep"
"""The key of :func:`release_engine`'s warning in a run's ``logged_once`` set."""


def release_engine(engine: object, cfg: RunConfig, logged_once: set[str]) -> bool:
    """``system.engine_sleep``: the engine's ``sleep()`` before an update (colocation,
    :func:`~posttrain.rollout.engine.engine_sleep`); True when it released its memory (the weight sync wakes
    it). False when the setting is off, or when the engine cannot: then it keeps its memory, and that is
    logged once per run (``logged_once``: the run's set of warnings already logged, which this adds to)."""
    from posttrain.rollout.engine import engine_sleep

    if not cfg.system.engine_sleep:
        return False
    why = engine_sleep(engine)
    if why is not None and _NO_SLEEP not in logged_once:
        log.warning("system.engine_sleep: the engine keeps its memory during updates (%s)", why)
        logged_once.add(_NO_SLEEP)
    return why is None


def train_batch(parts: Parts, batch: TrajectoryBatch, tg: Targets, fuse: bool, metrics: StepMetrics,
                logged_once: set[str]) -> tuple[TrajectoryBatch, Targets, UpdateOutput, bool]:
    """Step 5: ``(batch, targets, update output, slept)``. The parts' engine released
    (``system.engine_sleep``, :func:`release_engine` with the run's ``logged_once``; ``slept``: it freed its
    weights, the sync wakes it), the actor's update under the recipe's reduction (correction: CORRECTIONS /
    decoupled PPO against the recorded behaviour log-probs, whatever the mode) and the critic's, both reading
    the batch's tensors.
    ``fuse``: pi_old is the update's own forward, frozen onto the batch and the targets afterwards
    (:func:`~posttrain.loop.targets.with_fused_old`, at the version before the update). Adds
    ``update/fused_old_logprob``, the learner's metrics and ``critic/*``."""
    slept = release_engine(parts.engine, parts.cfg, logged_once)  # the engine frees its weights meanwhile
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


__all__ = ["release_engine", "train_batch"]
