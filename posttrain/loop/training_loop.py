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
import math
import time
from typing import TYPE_CHECKING

from posttrain.config import RunConfig
from posttrain.loop.checkpointing import RunState
from posttrain.loop.guards import check_guards
from posttrain.loop.lifecycle import eval_due
from posttrain.loop.parts import Parts, frozen_logprobs, sync_weights
from posttrain.loop.producer import Produced, Producer
from posttrain.loop.run import Run, StepMetrics
from posttrain.loop.sampling_lifecycle import SamplingProgram, SamplingStep, run_sampling
from posttrain.loop.step_metrics import status_counts, step_metrics
from posttrain.loop.targets import Targets, build_targets, distill_metrics, ref_token_kl, run_baseline
from posttrain.rewards.hidden import judge_trajectories
from posttrain.trajectory import Status, Trajectory, TrajectoryBatch, collate
from posttrain.trajectory.collate import with_update_record

if TYPE_CHECKING:
    import torch
    from rich.progress import Progress

    from posttrain.learner.primitives import UpdateOutput


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
    """Train on one produced batch and record the step; the shared half of every mode.

    Collates the usable trajectories once into one :class:`~posttrain.trajectory.TrajectoryBatch`;
    pi_old / pi_ref log-probs, critic values, advantages and returns are attached to it as tensors
    (``freeze`` / ``with_targets``: :func:`frozen_batch`, :func:`step_targets`) and the actor and critic
    updates read them from it (:func:`train_batch`), all over the run's parts (``run.parts``). Then judges
    the revision, syncs the engine's weights (inside ``producer.quiesce()``) and evaluates every
    ``eval.every`` steps (:func:`sync_and_evaluate`), checks the guards, rebuilds the records once
    (``with_update_record``) and writes ledger + metrics (+ checkpoint) (:func:`record_step`). Returns
    ``(metrics, stop_reason)``.
    """
    cfg = run.cfg
    trajs = produced.trajectories
    # No reward to learn from: infra errors and environment failures (multi-turn) are counted, never trained.
    usable = [t for t in trajs if t.status not in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    metrics: StepMetrics = dict(produced.info)
    metrics.update(consumption_metrics(trajs, produced.dropped))
    if not usable:
        return skipped_step(run, producer, step, trajs, metrics, t_step)
    parts = run.parts
    t0 = time.perf_counter()
    old_version = parts.learner.version
    # One optimizer step per update and nothing before it that reads pi_old (no KL in the reward):
    # pi_old comes from the update's own forward, detached (no redundant no-grad forward).
    fuse = (cfg.optim.fuse_old_logprob and parts.learner.can_fuse_old_logprob() and not cfg.credit.kl_in_reward
            and cfg.loss.distill is None)
    batch = frozen_batch(parts, usable, fuse, old_version, run.state.ref_version)
    batch, tg = step_targets(run, batch, step, metrics)
    slept = run.release_engine()  # system.engine_sleep: the engine frees its weights while the learner updates
    batch, tg, out = train_batch(parts, batch, tg, fuse, old_version, metrics)
    metrics["time/learner_s"] = time.perf_counter() - t0
    metrics.update(step_metrics(batch, trajs, tg, learner_version=old_version))
    metrics.update(distill_metrics(tg, batch))
    if parts.backend is not None:  # system.backend=ray: where the rollout / reward workers run (once)
        metrics.update(parts.backend.placement_once())
    # 6. judge the revision; a NaN/inf loss is rejected and the promoted weights restored
    if not math.isfinite(float(out.metrics.get("loss", 0.0))):
        run.promotion.reject(step, f"non-finite loss {out.metrics.get('loss')}")
        metrics["revision"] = "rejected"
    else:
        metrics["revision"] = "candidate"
    sync_and_evaluate(run, producer, step, slept, metrics)
    stop_reason = check_guards(cfg.guards, metrics)
    record_step(run, step, batch, out.current_logprob, tg, trajs, metrics, t_step)
    return metrics, stop_reason


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


def frozen_batch(parts: Parts, usable: list[Trajectory], fuse: bool, old_version: int,
                 ref_version: int) -> TrajectoryBatch:
    """Step 4: the usable trajectories collated once, with pi_old (unless the update fuses it), pi_ref (at
    ``ref_version``), the teacher's log-probs (``loss.distill``) and the critic's values frozen onto the batch.
    Each recorded prompt is re-rendered first: pi_old must be computed on the ids the engine sampled from (a
    changed template / system prompt is an error)."""
    parts.renderer.verify(usable)
    batch = collate(usable, pad_token_id=parts.pad_token_id)
    if not fuse:
        batch = batch.freeze("old", parts.learner.compute_logprobs(batch), old_version)
    if parts.ref_model is not None:
        batch = batch.freeze("ref", frozen_logprobs(parts, parts.ref_model, batch), ref_version)
    if parts.teacher_model is not None:  # loss.distill: the frozen teacher scores the student's own tokens
        batch = batch.freeze("teacher", frozen_logprobs(parts, parts.teacher_model, batch))
    if parts.critic is not None:
        values, final_values = parts.critic.compute_values(batch)
        batch = batch.with_targets(values=values, final_values=final_values)
    return batch


def step_targets(run: Run, batch: TrajectoryBatch, step: int, metrics: StepMetrics
                 ) -> tuple[TrajectoryBatch, Targets]:
    """The step's advantages and returns (:func:`~posttrain.loop.targets.build_targets` with the recipe's
    estimator, KL placement, ReMax baseline and distillation), attached to the batch. Fused: the advantages
    need no pi_old (no KL in the reward); the KL metric waits for pi_old."""
    cfg = run.cfg
    baseline, baseline_metrics = run_baseline(run, batch, step)  # ReMax: one greedy rollout per prompt
    metrics.update(baseline_metrics)
    tg = build_targets(
        batch, estimator=cfg.credit.estimator, estimator_kwargs=cfg.credit.kwargs,
        kl_in_reward=cfg.credit.kl_in_reward, kl_estimator=cfg.loss.kl_estimator,
        kl_coef=run.kl_coef_value(), baseline=baseline,
        distill_coef=None if cfg.loss.distill is None else cfg.loss.distill.coef,
        distill_only=cfg.loss.distill is not None and cfg.loss.distill.only,
    )
    return batch.with_targets(advantages=tg.advantages, returns=tg.returns), tg


def train_batch(parts: Parts, batch: TrajectoryBatch, tg: Targets, fuse: bool, old_version: int,
                metrics: StepMetrics) -> tuple[TrajectoryBatch, Targets, UpdateOutput]:
    """Step 5: the actor (and critic) update under the recipe's reduction (correction: CORRECTIONS / decoupled
    PPO against the recorded behaviour log-probs, whatever the mode); both read the batch's tensors. A fused
    pi_old is frozen onto the batch afterwards, and the targets' KL recomputed from it."""
    out = parts.learner.update(batch, fuse_old=fuse)
    upd = dict(out.metrics)
    if fuse:
        assert out.old_logprob is not None
        batch = batch.freeze("old", out.old_logprob, old_version)
        tg = dataclasses.replace(tg, old_logprob=batch.old_logprob, ref_logprob=batch.ref_logprob, token_kl=ref_token_kl(
            batch.old_logprob, batch.ref_logprob, batch.action_mask, parts.cfg.loss.kl_estimator))
    metrics["update/fused_old_logprob"] = float(fuse)
    if parts.critic is not None and batch.returns is not None:
        upd.update({f"critic/{k}": v for k, v in parts.critic.update(batch).items()})
    metrics.update(upd)
    return batch, tg, out


def sync_and_evaluate(run: Run, producer: Producer, step: int, slept: bool, metrics: StepMetrics) -> None:
    """Inside ``producer.quiesce()``: wake a slept engine, push the new weights (the engine's version + 1),
    observe the KL controller and (step 7) evaluate held-out every ``eval.every`` steps -> promote / retain /
    reject."""
    with producer.quiesce():
        t1 = time.perf_counter()
        if slept:  # re-acquire; the sync below refills every weight
            from posttrain.rollout.engine import engine_wake

            engine_wake(run.parts.engine)
        sync_weights(run.parts)  # the engine gets the new weights with an incremented version
        metrics["time/weight_sync_s"] = time.perf_counter() - t1
        run.observe_kl(metrics)
        if eval_due(run.cfg, step):
            t2 = time.perf_counter()
            metrics.update(run.evaluate_and_judge(step))
            metrics["time/eval_s"] = time.perf_counter() - t2


def record_step(run: Run, step: int, batch: TrajectoryBatch, current_logprob: torch.Tensor | None, tg: Targets,
                trajs: list[Trajectory], metrics: StepMetrics, t_step: float) -> None:
    """The ledger records, rebuilt once from the batch: pi_old / pi_ref and their versions, pi_theta per
    token as the update saw it (|log rho| audits) and the advantage it trained on, plus the step's infra
    errors and environment failures; ``eval.hidden_verifier`` re-judges every response after the update (so
    it cannot reach the reward); then ledger + metrics (+ checkpoint)."""
    seen = with_update_record(batch, current_logprob, tg.advantages)
    ledger_trajs = seen + [t for t in trajs if t.status in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    ledger_trajs = judge_trajectories(ledger_trajs, run.parts.hidden_verifier, run.parts.verify_batch)
    run.finish_step(step, ledger_trajs, metrics, t_step)


def consumption_metrics(trajs: list[Trajectory], dropped: list[Trajectory]) -> dict[str, float]:
    """Policy lag, version span and staleness drops of one consumed batch.

    ``lag/mean|max`` and ``lag/count_0|1|2|3plus`` (histogram of ``policy_lag`` = learner version
    at consumption - oldest behaviour version of the sample); ``version_span/mean|max``
    (newest - oldest behaviour version within a sample); ``staleness/dropped_samples`` and
    ``staleness/dropped_tokens`` (samples over ``max_staleness``, not trained);
    ``staleness/accepted_token_frac`` = consumed action tokens / (consumed + dropped).
    """
    import numpy as np

    lags = [int(t.policy_lag or 0) for t in trajs]
    spans = []
    for t in trajs:
        v = t.behavior_version[t.action_mask.astype(bool)]
        spans.append(int(v.max() - v.min()) if v.size else 0)
    m: dict[str, float] = {
        "lag/mean": float(np.mean(lags)) if lags else 0.0,
        "lag/max": float(max(lags)) if lags else 0.0,
        "lag/count_0": float(sum(x == 0 for x in lags)),
        "lag/count_1": float(sum(x == 1 for x in lags)),
        "lag/count_2": float(sum(x == 2 for x in lags)),
        "lag/count_3plus": float(sum(x >= 3 for x in lags)),
        "version_span/mean": float(np.mean(spans)) if spans else 0.0,
        "version_span/max": float(max(spans)) if spans else 0.0,
    }
    kept_tok = sum(t.num_actions for t in trajs)
    drop_tok = sum(t.num_actions for t in dropped)
    m["staleness/dropped_samples"] = float(len(dropped))
    m["staleness/dropped_tokens"] = float(drop_tok)
    m["staleness/accepted_token_frac"] = kept_tok / (kept_tok + drop_tok) if kept_tok + drop_tok else 1.0
    return m


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

__all__ = ["PROGRAM", "RLProgram", "RLRunResult", "RL_PROGRAM", "consumption_metrics", "frozen_batch", "record_step",
           "skipped_step", "step_targets", "sync_and_evaluate", "train", "train_batch", "update_step"]
