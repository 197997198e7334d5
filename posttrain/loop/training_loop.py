"""The audited RL iteration: one loop for every system mode (the mode is a knob, not a fork).

    snapshot -> rollout (G samples per prompt) -> validate statuses -> score
      -> freeze old / ref log-probs and targets -> update -> sync weights (version + 1)
      -> held-out eval every N steps -> promote / retain / reject the revision

``system.mode`` only decides how a step's trajectories are *produced*
(:mod:`posttrain.loop.producer`: inline in ``sync``, one step ahead in a worker thread in
``one_step_off``, streamed through a bounded queue in ``async``; partial rollout in sync and
one_step_off); :func:`update_step` — everything from the batch to the ledger — is the same code
in every mode. Trajectories with ``infra_error`` are excluded from the update and counted; stale
samples (``system.max_staleness``) are dropped and counted. Every step writes its trajectories
and metrics to the Parquet ledger and ``metrics.jsonl``; checkpoints are atomic and a sync run
resumes exactly (see :mod:`posttrain.loop.checkpointing`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from posttrain.config import RunConfig
from posttrain.loop.checkpointing import RunState
from posttrain.loop.guards import check_guards
from posttrain.loop.lifecycle import eval_due
from posttrain.loop.producer import Produced, Producer, consume
from posttrain.loop.run import Run, StepMetrics, judge_update, record_step, sync_and_evaluate
from posttrain.loop.sampling_lifecycle import SamplingProgram, SamplingStep, run_sampling
from posttrain.loop.step_metrics import status_counts
from posttrain.loop.targets import frozen_batch, step_targets
from posttrain.loop.update import train_batch
from posttrain.trajectory import Trajectory

if TYPE_CHECKING:
    from rich.progress import Progress


def train(cfg: RunConfig, *, progress: Progress | None = None) -> RunState:
    """Run ``cfg.steps`` RL steps (after optional SFT warm-up) in ``cfg.system.mode``; returns the final state.

    The sampling trainers' lifecycle (:func:`~posttrain.loop.sampling_lifecycle.run_sampling`) with
    :func:`update_step` as the step: the producer of the mode hands over each step's trajectories;
    :func:`update_step` trains on them and syncs the engine inside ``producer.quiesce()`` (no rollout call
    starts meanwhile). Samples generated but never consumed when the run ends are counted in
    ``RunState.unconsumed_samples``.

    Any exception (``KeyboardInterrupt`` included) propagates after the producer and the run are
    closed (run-directory lock released); the checkpoints already written are untouched, so
    ``resume=true`` continues from the last one (at most ``checkpoint_every`` steps are redone). An
    interrupt recorded by :func:`~posttrain.loop.interrupt.interrupt_flag` whose ``KeyboardInterrupt`` was
    swallowed (a finalizer's) raises one before the next step.
    """
    return run_sampling(cfg, RL_PROGRAM, progress)


def _rl_step(run: Run, fresh: bool) -> SamplingStep:
    """The RL step of every run: :func:`update_step`, looked up at each call (so a test may wrap it)."""
    return _update_step


def _update_step(run: Run, producer: Producer, step: int, produced: Produced,
                 t_step: float) -> tuple[StepMetrics, str | None]:
    """:func:`update_step` as this module holds it now."""
    return update_step(run, producer, step, produced, t_step)


def _rl_progress(step: int, metrics: StepMetrics, st: RunState) -> str:
    """The RL progress line: the step's mean reward and the last held-out accuracy."""
    reward = metrics.get("reward/mean", float("nan"))
    return f"RL step {step} reward {reward:.3f} held-out {st.last_heldout_accuracy:.3f}"


RL_PROGRAM = SamplingProgram("RL", _rl_step, _rl_progress)
"""``trainer: rl`` over the sampling trainers' lifecycle."""


def update_step(run: Run, producer: Producer, step: int, produced: Produced,
                t_step: float) -> tuple[StepMetrics, str | None]:
    """Train on one produced batch and record the step; the shared half of every mode. Returns
    ``(metrics, stop_reason)``.

    One pass, each stage one call into the file that owns it, in order (``python scripts/trace_step.py``
    follows it): the usable trajectories (:func:`~posttrain.loop.producer.consume`; none: :func:`skipped_step`)
    -> the batch, collated once with pi_old / pi_ref / the teacher's log-probs / the critic's values frozen onto
    it (:func:`~posttrain.loop.targets.frozen_batch`) -> its advantages and returns
    (:func:`~posttrain.loop.targets.step_targets`) -> the actor (and critic) update, the engine released
    meanwhile (:func:`~posttrain.loop.update.train_batch`) -> the step's figures and the revision's verdict
    (:func:`~posttrain.loop.run.judge_update`) -> weight sync and held-out evaluation every ``eval.every``
    steps, inside ``producer.quiesce()`` (:func:`~posttrain.loop.run.sync_and_evaluate`) -> guards, the
    ledger's records rebuilt once, ledger + metrics (+ checkpoint) (:func:`~posttrain.loop.run.record_step`).
    The targets and the update are given the run's parts (``run.parts``) and the run state they read: the
    prompts drawn this step (``run.step_examples``) and the warnings logged once (``run.logged_once``).
    """
    usable, info = consume(produced)
    metrics: StepMetrics = dict(info)
    if not usable:
        return skipped_step(run, producer, step, produced.trajectories, metrics, t_step)
    t0 = time.perf_counter()
    batch, fuse = frozen_batch(run.cfg, run.parts, usable, run.state.ref_version)
    batch, tg, target_metrics = step_targets(run.parts, run.step_examples, batch, step)
    metrics.update(target_metrics)
    batch, tg, out, slept = train_batch(run.parts, batch, tg, fuse, metrics, run.logged_once)
    metrics["time/learner_s"] = time.perf_counter() - t0
    judge_update(run, step, batch, tg, out, produced.trajectories, metrics)
    sync_and_evaluate(run, producer, step, slept, metrics)
    return metrics, record_step(run, step, batch, out.current_logprob, tg, produced.trajectories, metrics, t_step)


def skipped_step(run: Run, producer: Producer, step: int, trajs: list[Trajectory], metrics: StepMetrics,
                 t_step: float) -> tuple[StepMetrics, str | None]:
    """A step with nothing judged (every trajectory an infra error or environment failure): counted like any
    step (``status/*``, what the ledger holds), evaluated on schedule (the unchanged weights) and guarded."""
    metrics["skipped"] = 1.0
    metrics.update(status_counts(trajs))
    if eval_due(run.cfg, step):  # the schedule holds: the held-out figure of these (unchanged) weights
        with producer.quiesce():
            metrics.update(run.evaluate_and_judge(step))
    stop_reason = check_guards(run.cfg.guards, metrics)
    run.finish_step(step, trajs, metrics, t_step)
    return metrics, stop_reason


@dataclasses.dataclass(frozen=True)
class RLRunResult:
    """``trainer: rl``'s :class:`~posttrain.loop.trainer_program.TrainerResult`: the run's final
    :class:`~posttrain.loop.checkpointing.RunState` and its closing lines."""

    state: RunState

    @property
    def step(self) -> int:
        """The last step done."""
        return self.state.step

    @property
    def wall_seconds(self) -> float:
        """Wall-clock seconds of the run."""
        return self.state.wall_seconds

    def summary_lines(self) -> list[str]:
        """``done: N steps in S s; held-out accuracy by step s:a, ...`` and, after a guard stopped the run,
        ``stopped early: <reason>``."""
        curve = ", ".join(f"{s}:{a:.3f}" for s, a, _ in self.state.heldout_curve)
        lines = [f"done: {self.state.step} steps in {self.state.wall_seconds:.0f} s; held-out accuracy by step {curve}"]
        if self.state.stopped:
            lines.append(f"stopped early: {self.state.stopped}")
        return lines


class RLProgram:
    """``trainer: rl`` as a :class:`~posttrain.loop.trainer_program.TrainerProgram`: ``check`` is the preflight
    (:func:`~posttrain.loop.preflight.preflight`: one step's parts dry-built), ``train`` is :func:`train`."""

    def check(self, cfg: RunConfig) -> None:
        """:func:`~posttrain.loop.preflight.preflight` of ``cfg``."""
        from posttrain.loop.preflight import preflight

        preflight(cfg)

    def train(self, cfg: RunConfig, progress: Progress | None) -> RLRunResult:
        """:func:`train` with ``progress``, its final state wrapped for the command."""
        return RLRunResult(train(cfg, progress=progress))


PROGRAM = RLProgram()
"""The program ``trainer: rl`` names (posttrain/config/trainers.py)."""

__all__ = ["PROGRAM", "RLProgram", "RLRunResult", "RL_PROGRAM", "skipped_step", "train", "update_step"]
