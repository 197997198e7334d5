"""A run's checkpoints: what they hold, writing one, resuming from the newest that loads.

A checkpoint (written atomically by :func:`posttrain.learner.checkpoint.save_checkpoint`) holds the
actor, tokenizer and critic weights, the learner state (``learner``: optimizer, scheduler, KL
controller, or the learner ranks' shards; ``ref_model``; ``promoted``: the promoted snapshot;
``critic``), the RNG states and ``extra``: ``run_state`` (:class:`RunState`), ``engine_version`` and
``has_ref``, and with ``loss.distill`` ``teacher`` (its path and weights fingerprint, which a resume
checks: :func:`check_teacher`). :func:`resume` restores the newest checkpoint that loads (an unreadable one falls back
to the previous with a warning), moves ledger steps written after it to ``ledger/discarded/`` and
drops the later ``metrics.jsonl`` lines, so the run continues without gaps or duplicates.
The checkpoint walk (newest first, an unreadable one skipped) is every trainer's
(:func:`~posttrain.loop.lifecycle.restore_newest`), as is :func:`~posttrain.loop.lifecycle.check_resumable`,
which refuses, before anything is built, a ``resume=true`` that would start afresh or change the recipe.
The run's own state (:class:`CheckpointedRun`) and its :class:`~posttrain.loop.parts.Parts` are given
separately.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from posttrain.config import RunConfig
from posttrain.loop.lifecycle import RunClock, restore_newest
from posttrain.loop.promotion import Decision
from posttrain.loop.run_dir import RunDirError

if TYPE_CHECKING:
    from posttrain.learner.checkpoint import CheckpointState
    from posttrain.loop.metrics_log import MetricsLog
    from posttrain.loop.parts import Parts
    from posttrain.loop.promotion import Promotion
    from posttrain.trajectory import Ledger

log = logging.getLogger("posttrain")

#: The learner state of a checkpoint: state dicts (or the sharded learner's manifest) by part.
LearnerState = dict[str, object]


@dataclasses.dataclass
class RunState:
    """Everything that must survive a crash besides weights and optimizer state (``extra["run_state"]``)."""

    step: int = 0
    cursor: int = 0  # training prompts consumed
    ref_version: int = 0
    best_heldout_accuracy: float = -1.0
    last_heldout_accuracy: float = float("nan")
    promoted_step: int = 0
    heldout_curve: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # step, acc, reward
    reward_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    stopped: str | None = None
    wall_seconds: float = 0.0
    rollout_calls: int = 0  # rollout calls started (non-sync modes run ahead of ``step``)
    inflight_at_checkpoint: int = 0  # samples queued / paused when the checkpoint was written
    discarded_on_resume: int = 0  # in-flight samples of the checkpoint that a resume discarded (counted)
    unconsumed_samples: int = 0  # samples generated but never trained on when the run ended
    rollout_dropped: int = 0  # paused samples dropped before resuming (max_version_span / max_staleness)


class CheckpointedRun(Protocol):
    """What a checkpoint writes and a resume restores of a run's own state (its parts are given beside it):
    met by :class:`~posttrain.loop.run.Run` (a structural type, so this module does not import the run that
    calls it). ``state`` is replaced on resume; the rest is read."""

    state: RunState

    @property
    def cfg(self) -> RunConfig: ...

    @property
    def dir(self) -> Path: ...

    @property
    def teacher_fingerprint(self) -> str | None: ...

    @property
    def promotion(self) -> Promotion: ...

    @property
    def log(self) -> MetricsLog: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def inflight_count(self) -> Callable[[], int] | None: ...

    @property
    def clock(self) -> RunClock: ...


def write_checkpoint(run: CheckpointedRun, parts: Parts) -> Path:
    """Write ``run``'s checkpoint of its current step atomically (``checkpoints/step_<N>``) with its ``parts``'
    weights and states; returns its path.

    The run's wall time and its samples in flight (queued / paused, not in the checkpoint: a resume
    discards and counts them) are recorded in its state first.
    """
    from posttrain.learner.checkpoint import checkpoint_path, save_checkpoint

    run.state.wall_seconds = run.clock.seconds()
    run.state.inflight_at_checkpoint = int(run.inflight_count()) if run.inflight_count is not None else 0
    extra: dict[str, object] = {"run_state": dataclasses.asdict(run.state), "engine_version": parts.engine.version}
    if parts.ref_model is not None:
        extra["has_ref"] = True
    if run.teacher_fingerprint is not None and run.cfg.loss.distill is not None:
        extra["teacher"] = {"path": run.cfg.loss.distill.teacher, "fingerprint": run.teacher_fingerprint}

    def learner_state(directory: Path) -> LearnerState:
        return run_learner_state(run, parts, directory)

    return save_checkpoint(
        checkpoint_path(run.dir, run.state.step),
        step=run.state.step, actor=parts.learner.model, tokenizer=parts.tokenizer,
        critic=None if parts.critic is None else parts.critic.model,
        learner_state=learner_state, extra=extra,
    )


def run_learner_state(run: CheckpointedRun, parts: Parts, directory: Path) -> LearnerState:
    """The learner state of ``run``'s checkpoint in (temporary) ``directory``: ``learner`` (learner ranks
    write their model + optimizer shards into ``directory/learner_dcp/`` and give its manifest),
    ``ref_model``, ``promoted`` and ``critic`` when the run has them."""
    from posttrain.learner.sharded_checkpoint import SHARDED_DIR

    save_sharded = getattr(parts.learner, "save_sharded", None)
    s: LearnerState = {"learner": save_sharded(directory / SHARDED_DIR) if save_sharded is not None
                       else parts.learner.state_dict()}
    if parts.ref_model is not None:
        s["ref_model"] = parts.ref_model.state_dict()
    if run.promotion.snapshot is not None:
        s["promoted"] = run.promotion.snapshot
    if parts.critic is not None:
        s["critic"] = parts.critic.state_dict()
    return s


def resume(run: CheckpointedRun, parts: Parts) -> bool:
    """Restore the newest checkpoint of ``run`` that loads into it and its ``parts``
    (:func:`~posttrain.loop.lifecycle.restore_newest`: an unreadable one falls back to the previous with a
    warning; none loads: ``RunDirError``; another distillation teacher: :class:`TeacherChangedError`); False
    when there is no complete one. Ledger steps and ``metrics.jsonl`` lines after the restored step are set
    aside / dropped.
    """
    if restore_newest(run.dir, lambda path: restore(run, parts, path), fatal=(TeacherChangedError,)) is None:
        return False
    dropped = run.log.truncate_after(run.state.step)
    if dropped:
        log.warning("resume: dropped %d metrics.jsonl lines written after step %d", dropped, run.state.step)
    return True


def restore(run: CheckpointedRun, parts: Parts, path: Path) -> Path:
    """Load checkpoint ``path`` into ``parts``' learner, reference, critic and engine, ``run``'s promotion,
    state and clock, and the RNGs, and set aside the ledger steps written after it (raises if it is
    unreadable); returns ``path``."""
    from posttrain.learner.checkpoint import load_checkpoint, restore_actor, restore_rng

    ck = load_checkpoint(path)
    check_teacher(run, ck, path)
    restore_actor(parts.learner.model, ck)
    parts.learner.mark_driver_written()  # learner ranks: pushed before their next call, unless their shards load
    _restore_learners(parts, path, ck)
    snapshot = ck.learner_state.get("promoted")
    run.state = run_state_of(ck)
    run.promotion.record, run.promotion.snapshot = run.state, snapshot
    if run.state.inflight_at_checkpoint:
        run.state.discarded_on_resume += run.state.inflight_at_checkpoint
        log.warning("resume: %d samples that were queued or paused at the checkpoint are discarded (counted in "
                    "run_state.discarded_on_resume)", run.state.inflight_at_checkpoint)
        run.state.inflight_at_checkpoint = 0
    run.clock.restart(run.state.wall_seconds)
    parts.engine.update_weights(parts.learner.weights_for_rollout(), version=int(ck.extra["engine_version"]))
    restore_rng(ck.rng)
    moved = run.ledger.discard_after(run.state.step)
    if moved:
        log.warning("resume: moved %d ledger files written after step %d to ledger/discarded/",
                    len(moved), run.state.step)
    return path


class TeacherChangedError(RunDirError):
    """A resume whose distillation teacher is not the one the checkpoint was trained against."""


def check_teacher(run: CheckpointedRun, ck: CheckpointState, path: Path) -> None:
    """Refuse to resume a distillation run (``loss.distill``) from checkpoint ``ck`` at ``path`` when the teacher
    loaded now (:func:`~posttrain.learner.fingerprint.weights_fingerprint` of its weights) is not the one the
    checkpoint recorded: the reverse KL would change meaning mid-run. :class:`TeacherChangedError` (one line,
    naming ``loss.distill.teacher``) unless ``resume_force=true``, which goes on with one warning. A checkpoint
    written before teachers were recorded, or a run without a teacher, is not checked."""
    was = ck.extra.get("teacher")
    now = run.teacher_fingerprint
    if not isinstance(was, dict) or now is None or was.get("fingerprint") == now:
        return
    d = run.cfg.loss.distill
    teacher = d.teacher if d is not None else "?"
    what = (f"loss.distill.teacher={teacher}: its weights (fingerprint {now[:12]}) are not the teacher checkpoint "
            f"{path.name} was trained against ({was.get('path')}, fingerprint {str(was.get('fingerprint'))[:12]})")
    if not run.cfg.resume_force:
        raise TeacherChangedError(f"resume=true with another distillation teacher: {what}; resume with that teacher, "
                                  "or set resume_force=true to go on with this one")
    log.warning("resume (resume_force): %s; training goes on against the new teacher", what)


def _restore_learners(parts: Parts, path: Path, ck: CheckpointState) -> None:
    """The policy learner (its state dict, or the learner ranks' shards at any world size), the reference
    model and the critic of checkpoint ``ck`` at ``path``."""
    ls = ck.learner_state
    if "sharded" in ls["learner"]:  # learner ranks' DCP shards: any world size, or the embedded learner
        from posttrain.learner.sharded_checkpoint import load_sharded_into_learner

        load_sharded_into_learner(parts.learner, path / ls["learner"]["sharded"], ls["learner"])
    else:
        parts.learner.load_state_dict(ls["learner"])
    if parts.ref_model is not None and "ref_model" in ls:
        parts.ref_model.load_state_dict(ls["ref_model"])
    if parts.critic is not None:
        if ck.critic_dir is None:
            raise ValueError(f"{path}: checkpoint has no critic/ but this run has a critic")
        parts.critic.model.load(ck.critic_dir)
        parts.critic.load_state_dict(ls["critic"])


def run_state_of(ck: CheckpointState) -> RunState:
    """The :class:`RunState` recorded in checkpoint ``ck`` (its curves' JSON lists back to tuples)."""
    rs = dict(ck.extra["run_state"])
    rs["heldout_curve"] = [tuple(x) for x in rs["heldout_curve"]]
    rs["reward_curve"] = [tuple(x) for x in rs["reward_curve"]]
    return RunState(**rs)


__all__ = ["CheckpointedRun", "LearnerState", "RunState", "TeacherChangedError", "check_teacher", "restore", "resume",
           "run_learner_state", "run_state_of", "write_checkpoint"]
