"""The run of a sampling trainer: its own state (:class:`Run`), opened in its locked run directory by
:func:`open_run` beside its :class:`~posttrain.loop.parts.Parts`.

``open_run`` builds the parts (tokenizer, actor, frozen reference, critic, engine, learner, task and
held-out set: :func:`~posttrain.loop.parts.build_parts`) and gives them to the run; with ``resume=true`` it
restores the latest atomic checkpoint (weights, optimizer, scheduler, RNG, data cursor, versions, adaptive-KL
state; :mod:`posttrain.loop.checkpointing`) and moves ledger steps written after that checkpoint to
``ledger/discarded/`` so the ledger continues without gaps or duplicates. ``Run`` keeps the run directory's
state (ledger, metrics log, checkpoints, promotion, run state and data cursor, clock); it delegates the
revision judgement to :mod:`posttrain.loop.promotion` and the SFT warm-up to :mod:`posttrain.loop.warmup`,
and records each step (ledger, metrics, checkpoint when due).

The RL step's last stages are functions here, over the run (``update_step`` calls them in this order after
the learner's): :func:`judge_update` (the step's data figures and the revision's first verdict),
:func:`sync_and_evaluate` (weight sync, the KL controller of :mod:`posttrain.loop.kl_control`, held-out
evaluation when due) and :func:`record_step` (guards, the ledger's records rebuilt once and judged,
:meth:`Run.finish_step`).

The run directory is protected (see :mod:`posttrain.loop.run_dir` and
:func:`~posttrain.loop.lifecycle.open_run_dir`, shared with every trainer): it is locked for the run's
lifetime; ``resume=true`` with no complete checkpoint is an error, as is a recipe that differs
from the run's ``config.yaml`` unless ``resume_force=true``; a checkpoint that cannot be read
falls back to the previous complete one (with a warning); ``metrics.jsonl`` lines after the
restored step are dropped so no step appears twice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.config import RunConfig
from posttrain.learner.fingerprint import weights_fingerprint
from posttrain.loop import checkpointing
from posttrain.loop.checkpointing import RunState
from posttrain.loop.guards import VerdictTally, check_guards
from posttrain.loop.kl_control import observe_kl
from posttrain.loop.lifecycle import RunClock, checkpoint_due, eval_due, open_run_dir, run_dir_of
from posttrain.loop.metrics_log import MetricsLog
from posttrain.loop.parts import Parts, build_parts, close_parts, sync_weights
from posttrain.loop.promotion import Promotion
from posttrain.loop.step_metrics import step_metrics
from posttrain.loop.warmup import sft_warmup
from posttrain.rewards.hidden import judge_trajectories
from posttrain.trajectory import Ledger, Status, Trajectory, TrajectoryBatch
from posttrain.trajectory.collate import with_update_record

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.envs.task import Task, TaskExample
    from posttrain.learner.primitives import UpdateOutput
    from posttrain.loop.producer import Producer
    from posttrain.loop.run_dir import RunDirLock
    from posttrain.loop.targets import Targets

log = logging.getLogger("posttrain")


#: A step's metrics by key: scalars (``revision`` and ``guards`` are strings; a missing figure is None).
StepMetrics = dict[str, float | int | str | bool | None]


class Run:
    """One run's own state in its run directory — data cursor, ledger, metrics, promotion, checkpoints, clock —
    beside its :class:`~posttrain.loop.parts.Parts` (``run.parts``, given, never copied; built by
    :func:`open_run`). Its operations take the parts they use explicitly (:meth:`next_prompts` the task); the
    stages of the step read ``run.parts`` and pass each callee the parts it needs. The rollout side reads the
    parts with the run's prompt stream and counters as one
    :class:`~posttrain.loop.sampling_lifecycle.SamplingSource`. ``logged_once``: the warnings this invocation
    logs once per run (:func:`~posttrain.loop.update.release_engine`)."""

    def __init__(self, cfg: RunConfig, parts: Parts, lock: RunDirLock | None = None) -> None:
        self.cfg = cfg
        self.dir = run_dir_of(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock  # a RunDirLock held by open_run; released by close()
        self._closed = False
        self.parts = parts  # the composition root's (loop/parts.py)
        # which teacher: recorded in each checkpoint, compared on resume (checkpointing.check_teacher)
        self.teacher_fingerprint = None if parts.teacher_model is None else weights_fingerprint(parts.teacher_model)
        self.step_examples: dict[str, TaskExample] = {}  # prompt_id -> TaskExample drawn this step (see next_prompts)
        self.ledger = Ledger(self.dir / "ledger")
        self.log = MetricsLog.for_run(self.dir, cfg)  # metrics.jsonl + the trackers of cfg.logging
        self.state = RunState()
        self.promotion = Promotion(parts.learner.model, self.state, reject_drop=cfg.eval.reject_drop,
                                   learner=parts.learner)
        self.verdicts = VerdictTally()  # this invocation's verifications: nothing judged at all -> an error
        self.inflight_count: Callable[[], int] | None = None  # set by the loop: samples queued / paused
        self.clock = RunClock()
        self.logged_once: set[str] = set()  # one-time warnings this invocation has logged

    # ------------------------------------------------------------------ data
    def next_prompts(self, task: Task, n: int) -> list[TaskExample]:
        """``n`` training prompts of ``task`` (the parts' task) at the data cursor, deterministic by seed and
        cursor: ``task.examples("train", n, seed=cfg.seed * 7919 + cursor)``, then ``cursor += n``. The
        rollout side draws them through :class:`~posttrain.loop.sampling_lifecycle.SamplingSource`."""
        seed = self.cfg.seed * 7_919 + self.state.cursor
        self.state.cursor += n
        out = list(task.examples("train", n, seed=seed))
        # ReMax's greedy baseline looks this step's prompts up by id (loop/targets.py run_baseline clears it).
        self.step_examples.update((ex.prompt_id, ex) for ex in out)
        return out

    # ------------------------------------------------------------------ evaluation and warm-up
    def evaluate_and_judge(self, step: int) -> dict[str, float | str]:
        """Evaluate the parts' engine on every held-out set; promote if best so far, reject (restore, and the
        engine gets the restored weights) on a collapse, else retain."""
        from posttrain.loop.heldout import heldout_metrics  # shared with `posttrain eval`

        res, metrics = heldout_metrics(self.parts, step=step, run_dir=self.dir)  # + heldout_outcomes.jsonl
        decision, reason = self.promotion.judge(step, res.accuracy)  # (:mod:`posttrain.loop.promotion`)
        if decision == "rejected":
            sync_weights(self.parts)
        self.state.last_heldout_accuracy = res.accuracy
        self.state.heldout_curve.append((step, res.accuracy, res.reward_mean))
        return {**metrics, "revision": decision, "revision_reason": reason}

    def warmup_and_baseline(self, progress: Progress | None = None) -> None:
        """SFT warm-up on reference answers (if ``sft.steps``, :func:`~posttrain.loop.warmup.sft_warmup`),
        then the step-0 held-out eval."""
        if self.cfg.sft.steps > 0:
            sft_warmup(self.parts, self.dir, progress)
        m = self.evaluate_and_judge(0)
        check_guards(self.cfg.guards, m)  # step 0: a breach (e.g. every verification failed) warns
        self.verdicts.add(m)
        self.log.log(0, m)

    # ------------------------------------------------------------------ bookkeeping
    def finish_step(self, step: int, trajs: list[Trajectory], metrics: StepMetrics, t_step: float) -> None:
        """Ledger + metrics for ``step``, advance the state, checkpoint when due
        (:func:`~posttrain.loop.lifecycle.checkpoint_due`)."""
        metrics["time/step_s"] = time.perf_counter() - t_step
        self.state.step = step
        reward = metrics.get("reward/mean")
        if reward is not None:
            self.state.reward_curve.append((step, float(reward)))
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}
        self.verdicts.add(scalars, trajs)
        self.ledger.write_trajectories(step, trajs)
        self.ledger.write_metrics(step, scalars)
        self.log.log(step, scalars)
        if checkpoint_due(self.cfg, step):
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Atomic checkpoint of everything needed to resume exactly (:mod:`posttrain.loop.checkpointing`)."""
        return checkpointing.write_checkpoint(self, self.parts)

    def resume(self) -> bool:
        """Restore the newest checkpoint that loads; False when there is no complete one
        (:func:`posttrain.loop.checkpointing.resume`)."""
        return checkpointing.resume(self, self.parts)

    def stop(self, reason: str) -> None:
        """Stop the run with a reason (logged, ledger-visible via metrics, checkpointed)."""
        self.state.stopped = reason
        self.log.log(self.state.step, {"stopped": reason})
        log.error("run stopped at step %d: %s", self.state.step, reason)
        self.checkpoint()

    def close(self) -> None:
        """Close the metrics and the parts (:func:`~posttrain.loop.parts.close_parts`: learner ranks, verifier
        pool, backend or engine), then release the run-directory lock (idempotent)."""
        self.state.wall_seconds = self.clock.seconds()
        if self._closed:
            return
        self._closed = True
        try:
            self.log.close()
            close_parts(self.parts)
        finally:
            if self._lock is not None:
                self._lock.release()


# ---------------------------------------------------------------------------------------------
# the RL step's last stages


def judge_update(run: Run, step: int, batch: TrajectoryBatch, tg: Targets, out: UpdateOutput,
                 trajs: list[Trajectory], metrics: StepMetrics) -> None:
    """After the update: the step's data figures (:func:`~posttrain.loop.step_metrics.step_metrics` of the
    trained batch and every trajectory, tokens sampled under ``batch.old_version`` counting as same-version),
    the Ray backend's placement (once) and step 6, the revision's first verdict: ``candidate``, or
    ``rejected`` with the promoted weights restored when the loss is NaN / inf."""
    metrics.update(step_metrics(batch, trajs, tg, learner_version=batch.old_version))
    parts = run.parts
    if parts.backend is not None:  # system.backend=ray: where the rollout / reward workers run (once)
        metrics.update(parts.backend.placement_once())
    if not math.isfinite(float(out.metrics.get("loss", 0.0))):
        run.promotion.reject(step, f"non-finite loss {out.metrics.get('loss')}")
        metrics["revision"] = "rejected"
    else:
        metrics["revision"] = "candidate"


def sync_and_evaluate(run: Run, producer: Producer, step: int, slept: bool, metrics: StepMetrics) -> None:
    """Inside ``producer.quiesce()`` (no rollout call starts): wake a slept engine, push the new weights (the
    engine's version + 1, :func:`~posttrain.loop.parts.sync_weights`), observe the KL controller
    (:func:`~posttrain.loop.kl_control.observe_kl` of the learner's ``kl_coef``) and (step 7) evaluate
    held-out every ``eval.every`` steps -> promote / retain / reject (:meth:`Run.evaluate_and_judge`). Adds
    ``time/quiesce_wait_s`` (entering the quiesce: one_step_off waits there for the call of the next step),
    ``time/weight_sync_s``, ``kl_coef(_next)``, the held-out figures and ``time/eval_s``."""
    t0 = time.perf_counter()
    with producer.quiesce():
        t1 = time.perf_counter()
        metrics["time/quiesce_wait_s"] = t1 - t0
        if slept:  # re-acquire; the sync below refills every weight
            from posttrain.rollout.engine import engine_wake

            engine_wake(run.parts.engine)
        sync_weights(run.parts)  # the engine gets the new weights with an incremented version
        metrics["time/weight_sync_s"] = time.perf_counter() - t1
        observe_kl(run.parts.learner.kl_coef, run.cfg, metrics)
        if eval_due(run.cfg, step):
            t2 = time.perf_counter()
            metrics.update(run.evaluate_and_judge(step))
            metrics["time/eval_s"] = time.perf_counter() - t2


def record_step(run: Run, step: int, batch: TrajectoryBatch, current_logprob: torch.Tensor | None, tg: Targets,
                trajs: list[Trajectory], metrics: StepMetrics, t_step: float) -> str | None:
    """The record stage; returns the guards' stop reason (:func:`~posttrain.loop.guards.check_guards` of the
    step's metrics, None: go on). The ledger records are rebuilt once from the batch
    (:func:`~posttrain.trajectory.collate.with_update_record`): pi_old / pi_ref and their versions, pi_theta
    per token as the update saw it (|log rho| audits) and the advantage it trained on, plus the step's infra
    errors and environment failures; ``eval.hidden_verifier`` re-judges every response after the update (so it
    cannot reach the reward); then ledger + metrics (+ checkpoint): :meth:`Run.finish_step`."""
    stop_reason = check_guards(run.cfg.guards, metrics)
    seen = with_update_record(batch, current_logprob, tg.advantages)
    ledger_trajs = seen + [t for t in trajs if t.status in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    ledger_trajs = judge_trajectories(ledger_trajs, run.parts.hidden_verifier, run.parts.verify_batch)
    run.finish_step(step, ledger_trajs, metrics, t_step)
    return stop_reason


def open_run(cfg: RunConfig) -> Run:
    """Build the parts and the run in its locked run directory (:func:`~posttrain.loop.lifecycle.open_run_dir`);
    resume from its latest checkpoint when ``cfg.resume``.

    The lock is held until :meth:`Run.close` (released, and a fresh directory removed, if building fails).
    ``config.yaml`` is written atomically; a forced resume with a changed recipe first keeps the old one as
    ``config.step_<N>.yaml``.
    """
    opened = open_run_dir(cfg)
    try:
        parts = build_parts(cfg, opened.path)
    except BaseException:
        opened.abandon()
        raise
    try:
        run = Run(cfg, parts, lock=opened.lock)
    except BaseException:
        close_parts(parts)
        opened.abandon()
        raise
    try:
        if cfg.resume:
            if not run.resume():  # the checkpoints vanished since check_resumable: still not a fresh start
                from posttrain.loop.run_dir import RunDirError

                raise RunDirError(f"resume=true but {run.dir / 'checkpoints'} holds no complete checkpoint")
            log.info("resumed %s at step %d", run.dir, run.state.step)
        opened.write_config(cfg, run.state.step)
    except BaseException:
        run.close()
        raise
    return run
