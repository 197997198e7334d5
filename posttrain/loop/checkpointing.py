"""A run's checkpoints: what they hold, writing one, resuming from the newest that loads.

A checkpoint (written atomically by :func:`posttrain.learner.checkpoint.save_checkpoint`) holds the
actor, tokenizer and critic weights, the learner state (``learner``: optimizer, scheduler, KL
controller, or the learner ranks' shards; ``ref_model``; ``promoted``: the promoted snapshot;
``critic``), the RNG states and ``extra``: ``run_state`` (:class:`RunState`), ``engine_version`` and
``has_ref``, and with ``loss.distill`` ``teacher`` (its path and weights fingerprint, which a resume
checks: :func:`check_teacher`). :func:`resume` restores the newest checkpoint that loads (an unreadable one falls back
to the previous with a warning), moves ledger steps written after it to ``ledger/discarded/`` and
drops the later ``metrics.jsonl`` lines, so the run continues without gaps or duplicates.
:func:`check_resumable` refuses, before anything is built, a ``resume=true`` that would start afresh
or change the recipe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from posttrain.config import RunConfig
from posttrain.loop.promotion import Decision
from posttrain.loop.run_dir import RunDirError

if TYPE_CHECKING:
    import torch

    from posttrain.learner.checkpoint import CheckpointState
    from posttrain.learner.critic import CriticLearner
    from posttrain.learner.protocol import Learner
    from posttrain.loop.metrics_log import MetricsLog
    from posttrain.loop.promotion import Promotion
    from posttrain.models.tokenizer_protocol import Tokenizer
    from posttrain.rollout.engine import RolloutEngine
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
    """What a checkpoint writes and a resume restores of a run: met by :class:`~posttrain.loop.run.Run`
    (a structural type, so this module does not import the run that calls it). ``state`` is replaced on
    resume; the rest is read (the parts' own state is loaded in place)."""

    state: RunState

    @property
    def cfg(self) -> RunConfig: ...

    @property
    def dir(self) -> Path: ...

    @property
    def learner(self) -> Learner: ...

    @property
    def engine(self) -> RolloutEngine: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def critic(self) -> CriticLearner | None: ...

    @property
    def ref_model(self) -> torch.nn.Module | None: ...

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

    def wall_seconds(self) -> float:
        """Seconds of wall time of the run so far, every invocation counted."""

    def restart_clock(self, wall_before: float) -> None:
        """Count wall time from now, on top of ``wall_before`` seconds of earlier invocations."""


def write_checkpoint(run: CheckpointedRun) -> Path:
    """Write ``run``'s checkpoint of its current step atomically (``checkpoints/step_<N>``); returns its path.

    The run's wall time and its samples in flight (queued / paused, not in the checkpoint: a resume
    discards and counts them) are recorded in its state first.
    """
    from posttrain.learner.checkpoint import checkpoint_path, save_checkpoint

    run.state.wall_seconds = run.wall_seconds()
    run.state.inflight_at_checkpoint = int(run.inflight_count()) if run.inflight_count is not None else 0
    extra: dict[str, object] = {"run_state": dataclasses.asdict(run.state), "engine_version": run.engine.version}
    if run.ref_model is not None:
        extra["has_ref"] = True
    if run.teacher_fingerprint is not None and run.cfg.loss.distill is not None:
        extra["teacher"] = {"path": run.cfg.loss.distill.teacher, "fingerprint": run.teacher_fingerprint}

    def learner_state(directory: Path) -> LearnerState:
        return run_learner_state(run, directory)

    return save_checkpoint(
        checkpoint_path(run.dir, run.state.step),
        step=run.state.step, actor=run.learner.model, tokenizer=run.tokenizer,
        critic=None if run.critic is None else run.critic.model,
        learner_state=learner_state, extra=extra,
    )


def run_learner_state(run: CheckpointedRun, directory: Path) -> LearnerState:
    """The learner state of ``run``'s checkpoint in (temporary) ``directory``: ``learner`` (learner ranks
    write their model + optimizer shards into ``directory/learner_dcp/`` and give its manifest),
    ``ref_model``, ``promoted`` and ``critic`` when the run has them."""
    from posttrain.learner.sharded_checkpoint import SHARDED_DIR

    save_sharded = getattr(run.learner, "save_sharded", None)
    s: LearnerState = {"learner": save_sharded(directory / SHARDED_DIR) if save_sharded is not None
                       else run.learner.state_dict()}
    if run.ref_model is not None:
        s["ref_model"] = run.ref_model.state_dict()
    if run.promotion.snapshot is not None:
        s["promoted"] = run.promotion.snapshot
    if run.critic is not None:
        s["critic"] = run.critic.state_dict()
    return s


def resume(run: CheckpointedRun) -> bool:
    """Restore the newest checkpoint of ``run`` that loads; returns False when there is no complete one.

    A checkpoint that fails to load (truncated or corrupt file) is skipped with a warning and the
    previous complete one is used; when none loads, ``RunDirError`` names the newest and why.
    Ledger steps and ``metrics.jsonl`` lines after the restored step are set aside / dropped.
    """
    from posttrain.learner.checkpoint import complete_checkpoints

    paths = complete_checkpoints(run.dir / "checkpoints")
    if not paths:
        return False
    first_err: str | None = None
    for path in reversed(paths):
        try:
            restore(run, path)
        except TeacherChangedError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            first_err = first_err or f"{path}: {why}"
            log.warning("resume: checkpoint %s cannot be loaded (%s); falling back to the previous one", path, why)
            continue
        break
    else:
        from posttrain.loop.run_dir import RunDirError

        raise RunDirError(f"resume: no checkpoint under {run.dir / 'checkpoints'} can be loaded ({first_err})")
    dropped = run.log.truncate_after(run.state.step)
    if dropped:
        log.warning("resume: dropped %d metrics.jsonl lines written after step %d", dropped, run.state.step)
    return True


def restore(run: CheckpointedRun, path: Path) -> None:
    """Load checkpoint ``path`` into ``run``'s learner, reference, critic, promotion, engine, state and the
    RNGs, and set aside the ledger steps written after it (raises if it is unreadable)."""
    from posttrain.learner.checkpoint import load_checkpoint, restore_actor, restore_rng

    ck = load_checkpoint(path)
    check_teacher(run, ck, path)
    restore_actor(run.learner.model, ck)
    _restore_learners(run, path, ck)
    snapshot = ck.learner_state.get("promoted")
    run.state = run_state_of(ck)
    run.promotion.record, run.promotion.snapshot = run.state, snapshot
    if run.state.inflight_at_checkpoint:
        run.state.discarded_on_resume += run.state.inflight_at_checkpoint
        log.warning("resume: %d samples that were queued or paused at the checkpoint are discarded (counted in "
                    "run_state.discarded_on_resume)", run.state.inflight_at_checkpoint)
        run.state.inflight_at_checkpoint = 0
    run.restart_clock(run.state.wall_seconds)
    run.engine.update_weights(run.learner.weights_for_rollout(), version=int(ck.extra["engine_version"]))
    restore_rng(ck.rng)
    moved = run.ledger.discard_after(run.state.step)
    if moved:
        log.warning("resume: moved %d ledger files written after step %d to ledger/discarded/",
                    len(moved), run.state.step)


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


def _restore_learners(run: CheckpointedRun, path: Path, ck: CheckpointState) -> None:
    """The policy learner (its state dict, or the learner ranks' shards at any world size), the reference
    model and the critic of checkpoint ``ck`` at ``path``."""
    ls = ck.learner_state
    if "sharded" in ls["learner"]:  # learner ranks' DCP shards: any world size, or the embedded learner
        from posttrain.learner.sharded_checkpoint import load_sharded_into_learner

        load_sharded_into_learner(run.learner, path / ls["learner"]["sharded"], ls["learner"])
    else:
        run.learner.load_state_dict(ls["learner"])
    if run.ref_model is not None and "ref_model" in ls:
        run.ref_model.load_state_dict(ls["ref_model"])
    if run.critic is not None:
        if ck.critic_dir is None:
            raise ValueError(f"{path}: checkpoint has no critic/ but this run has a critic")
        run.critic.model.load(ck.critic_dir)
        run.critic.load_state_dict(ls["critic"])


def run_state_of(ck: CheckpointState) -> RunState:
    """The :class:`RunState` recorded in checkpoint ``ck`` (its curves' JSON lists back to tuples)."""
    rs = dict(ck.extra["run_state"])
    rs["heldout_curve"] = [tuple(x) for x in rs["heldout_curve"]]
    rs["reward_curve"] = [tuple(x) for x in rs["reward_curve"]]
    return RunState(**rs)


def check_resumable(cfg: RunConfig, run_dir: Path) -> str | None:
    """Before building anything: refuse a ``resume=true`` that would start afresh or change the recipe.

    Raises ``RunDirError`` (a ``UserError``) when there is no complete checkpoint, or when the resolved
    config differs from the run's ``config.yaml`` outside :data:`~posttrain.loop.run_dir.RESUME_MAY_CHANGE`
    and ``resume_force`` is off (the message lists ``key: old -> new``), and so does another ``steps`` with
    a decaying learning-rate schedule (:func:`~posttrain.loop.run_dir.schedule_horizon_change`). Returns a
    one-line summary of the differences a forced resume accepts, else None.
    """
    from posttrain.learner.checkpoint import complete_checkpoints
    from posttrain.loop.run_dir import (
        RunDirError,
        placement_changes,
        read_config_yaml,
        recipe_diff,
        schedule_horizon_change,
    )

    if not complete_checkpoints(run_dir / "checkpoints"):
        raise RunDirError(f"resume=true but {run_dir / 'checkpoints'} holds no complete checkpoint; "
                          "drop resume=true to start a new run there")
    old = read_config_yaml(run_dir / "config.yaml")
    if old is None:
        log.warning("resume: %s is missing or unreadable; the recipe cannot be compared", run_dir / "config.yaml")
        return None
    new = cfg.model_dump(mode="json")
    diff = recipe_diff(old, new)
    if diff and not cfg.resume_force:
        raise RunDirError(f"resume=true with a recipe that differs from {run_dir / 'config.yaml'}: "
                          f"{'; '.join(diff)} (set resume_force=true to resume anyway)")
    horizon = schedule_horizon_change(old, new)
    if horizon is not None:
        if not cfg.resume_force:
            raise RunDirError(f"resume=true with {horizon} ({run_dir / 'config.yaml'}): the learning rate decays over "
                              "steps, so the resumed steps would follow another curve than the steps already taken "
                              "(its rate changes at the resumed step); keep steps as recorded, or set "
                              "resume_force=true to decay over the new steps from there")
        diff.append(f"{horizon} (the learning rate decays over the new steps from the resumed step)")
    moved = placement_changes(old, new)  # change no arithmetic: resumed as is, config.yaml gets the new values
    if moved:
        log.warning("resume: placement-only keys changed (%s); config.yaml records the new values", "; ".join(moved))
    return "; ".join(diff) if diff else None


__all__ = ["LearnerState", "RunState", "TeacherChangedError", "check_resumable", "check_teacher", "restore", "resume", "run_learner_state",
           "run_state_of", "write_checkpoint"]
