"""The run: its parts (:mod:`posttrain.loop.parts`) and its own state (:class:`Run`), built and locked
in its run directory by :func:`open_run`.

``open_run`` builds the parts (tokenizer, actor, frozen reference, critic, engine, learner, task and
held-out set: :func:`~posttrain.loop.parts.build_parts`); with ``resume=true`` it restores the latest atomic checkpoint (weights, optimizer, scheduler,
RNG, data cursor, versions, adaptive-KL state; :mod:`posttrain.loop.checkpointing`) and moves ledger
steps written after that checkpoint to ``ledger/discarded/`` so the ledger continues without gaps or
duplicates. ``Run`` delegates the revision judgement to :mod:`posttrain.loop.promotion` and the SFT
warm-up to :mod:`posttrain.loop.warmup`; it records each step (ledger, metrics, checkpoint when due).

The run directory is protected (see :mod:`posttrain.loop.run_dir`): it is locked for the run's
lifetime; ``resume=true`` with no complete checkpoint is an error, as is a recipe that differs
from the run's ``config.yaml`` unless ``resume_force=true``; a checkpoint that cannot be read
falls back to the previous complete one (with a warning); ``metrics.jsonl`` lines after the
restored step are dropped so no step appears twice.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.algos.kl import AdaptiveKLController
from posttrain.config import RunConfig, dump_config
from posttrain.learner.fingerprint import weights_fingerprint
from posttrain.learner.protocol import KLCoefficient
from posttrain.loop import checkpointing
from posttrain.loop.checkpointing import RunState, check_resumable
from posttrain.loop.guards import VerdictTally, check_guards
from posttrain.loop.metrics_log import MetricsLog
from posttrain.loop.parts import build_parts
from posttrain.loop.promotion import Promotion
from posttrain.loop.warmup import sft_warmup
from posttrain.trajectory import Ledger, Trajectory, TrajectoryBatch
from posttrain.trajectory.record import JSONScalar

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.envs.task import TaskExample
    from posttrain.loop.heldout import EvalResult
    from posttrain.loop.run_dir import RunDirLock
    from posttrain.models.tokenizer_protocol import Tokenizer

log = logging.getLogger("posttrain")


#: A step's metrics by key: scalars (``revision`` and ``guards`` are strings; a missing figure is None).
StepMetrics = dict[str, float | int | str | bool | None]


def kl_coef_of(coef: float | KLCoefficient) -> float:
    """beta of a learner's ``kl_coef``: the fixed float, or the controller's current ``value``."""
    return float(coef) if isinstance(coef, (int, float)) else float(coef.value)


class Run:
    """One run: its :class:`~posttrain.loop.parts.Parts` (``run.parts``, also reachable by name:
    ``run.learner``, ``run.engine``, ...) and its own state — data cursor, ledger, metrics, promotion,
    checkpoints (built by :func:`open_run`)."""

    def __init__(self, cfg: RunConfig, lock: RunDirLock | None = None) -> None:
        self.cfg = cfg
        self.dir = run_dir_of(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock  # a RunDirLock held by open_run; released by close()
        self.parts = parts = build_parts(cfg, self.dir)  # the composition root (loop/parts.py)
        self.tokenizer: Tokenizer = parts.tokenizer  # a Hugging Face tokenizer (scoring reads it as a Decoder)
        self.renderer, self.task, self.heldout = parts.renderer, parts.task, parts.heldout
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        self.learner, self.plain_model, self.critic, self.ref_model = (parts.learner, parts.plain_model, parts.critic,
                                                                       parts.ref_model)
        self.teacher_model = parts.teacher_model  # loss.distill's frozen teacher, else None
        # which teacher: recorded in each checkpoint, compared on resume (checkpointing.check_teacher)
        self.teacher_fingerprint = None if parts.teacher_model is None else weights_fingerprint(parts.teacher_model)
        self.engine, self.backend = parts.engine, parts.backend
        self.verify_batch, self._pool, self.hidden_verifier = parts.verify_batch, parts.pool, parts.hidden_verifier
        self.step_examples: dict[str, TaskExample] = {}  # prompt_id -> TaskExample drawn this step (see next_prompts)
        self.ledger = Ledger(self.dir / "ledger")
        self.log = MetricsLog.for_run(self.dir, cfg)  # metrics.jsonl + the trackers of cfg.logging
        self.state = RunState()
        self.promotion = Promotion(self.learner.model, self.state, reject_drop=cfg.eval.reject_drop)
        self.verdicts = VerdictTally()  # this invocation's verifications: nothing judged at all -> an error
        self.inflight_count: Callable[[], int] | None = None  # set by the loop: samples queued / paused
        self.restart_clock(0.0)

    # ------------------------------------------------------------------ data
    def next_prompts(self, n: int) -> list[TaskExample]:
        """``n`` training prompts at the data cursor (deterministic by seed and cursor)."""
        seed = self.cfg.seed * 7_919 + self.state.cursor
        self.state.cursor += n
        out = list(self.task.examples("train", n, seed=seed))
        # ReMax's greedy baseline looks this step's prompts up by id (loop/targets.py run_baseline clears it).
        self.step_examples.update((ex.prompt_id, ex) for ex in out)
        return out

    # ------------------------------------------------------------------ policy
    def ref_logprobs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """Reference log-probs (frozen model, the learner's temperature and replayed truncation)."""
        assert self.ref_model is not None
        return self._frozen_logprobs(self.ref_model, batch)

    def teacher_logprobs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """The distillation teacher's log-probs of ``batch``'s tokens (``loss.distill``), computed exactly
        like the reference's: the learner's temperature and replayed truncation, 0 off the action mask."""
        assert self.teacher_model is not None, "teacher_logprobs needs loss.distill"
        return self._frozen_logprobs(self.teacher_model, batch)

    def _frozen_logprobs(self, model: torch.nn.Module, batch: TrajectoryBatch) -> torch.Tensor:
        from posttrain.learner.logprobs import token_logprobs

        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask,
                               temperature=self.learner.temperature,
                               top_k=self.learner.top_k, top_p=self.learner.top_p,
                               microbatch_tokens=self.cfg.optim.microbatch_tokens, action_mask=batch.action_mask)
        masked: torch.Tensor = lp * batch.action_mask.to(lp.dtype)
        return masked

    def kl_coef_value(self) -> float:
        """beta for this step: ``loss.kl_coef`` or the adaptive controller's current value. The learner
        holds the coefficient in both placements (``builders.build_kl_coef``): this step's loss reads it,
        or with ``credit.kl_in_reward`` the token rewards (``build_targets(kl_coef=...)``) do."""
        return kl_coef_of(self.learner.kl_coef)

    def observe_kl(self, metrics: StepMetrics) -> None:
        """Feed this step's observed KL to an adaptive controller (Ziegler et al. 2019; bounded update,
        :class:`~posttrain.algos.kl.AdaptiveKLController`) with the step's sample count
        (``prompts_per_step * group_size``, the unit of ``loss.kl_horizon``).

        The observed KL is the one the coefficient multiplied: the mean token KL to the reference
        in the reward (``kl/ref_mean``, pi_old vs pi_ref) with ``credit.kl_in_reward``, else the
        loss's ``kl``. ``metrics["kl_coef"]`` is set to the beta this step applied (read before the
        update); the updated one, which the next step applies, goes to ``kl_coef_next``."""
        ctl = self.learner.kl_coef
        metrics["kl_coef"] = kl_coef_of(ctl)  # what this step applied (the learner's too)
        key = "kl/ref_mean" if self.cfg.credit.kl_in_reward else "kl"
        observed = metrics.get(key)
        if isinstance(ctl, AdaptiveKLController) and observed is not None:
            ctl.update(float(observed), self.cfg.sampling.prompts_per_step * self.cfg.sampling.group_size)
            metrics["kl_coef_next"] = ctl.value

    def release_engine(self) -> bool:
        """``system.engine_sleep``: the engine's ``sleep()`` before an update (colocation); True when it
        released its memory. An engine that cannot is logged once and keeps it (returns False)."""
        from posttrain.rollout.engine import engine_sleep

        if not self.cfg.system.engine_sleep:
            return False
        why = engine_sleep(self.engine)
        if why is not None and not getattr(self, "_sleep_skip_logged", False):
            log.warning("system.engine_sleep: the engine keeps its memory during updates (%s)", why)
            self._sleep_skip_logged = True
        return why is None

    def sync_weights(self) -> None:
        """Push the learner's weights to the engine under the learner's version."""
        self.engine.update_weights(self.learner.weights_for_rollout(), version=self.learner.version)

    def reject(self, step: int, reason: str) -> None:
        """Reject the revision of ``step``: restore the promoted weights and record ``reason``
        (:meth:`Promotion.reject <posttrain.loop.promotion.Promotion.reject>`)."""
        self.promotion.reject(step, reason)

    def evaluate(self, temperature: float | None = None, samples: int = 1) -> EvalResult:
        """Held-out evaluation of the engine's current weights (default: ``eval.temperature``);
        ``samples`` > 1 draws that many responses per prompt for pass@``eval.k``."""
        from posttrain.loop.heldout import evaluate_run  # one path, shared with `posttrain eval`

        return evaluate_run(self, temperature, samples=samples)

    def evaluate_episodes(self, temperature: float | None = None, env_overrides: dict[str, JSONScalar] | None = None,
                          samples: int = 1) -> EvalResult:
        """Held-out evaluation of an ``env.name`` run: ``samples`` episodes per held-out start (default
        temperature ``eval.temperature``; ``env_overrides`` e.g. ``{"use_tools": False}``)."""
        from posttrain.loop.heldout import evaluate_run

        return evaluate_run(self, temperature, samples=samples, env_overrides=env_overrides)

    def evaluate_and_judge(self, step: int) -> dict[str, float | str]:
        """Evaluate; promote if best so far, reject (restore) on a collapse, else retain."""
        from posttrain.loop.heldout import heldout_metrics  # shared with `posttrain eval`

        res, metrics = heldout_metrics(self, step=step, run_dir=self.dir)  # + heldout_outcomes.jsonl
        decision, reason = self.promotion.judge(step, res.accuracy)  # (:mod:`posttrain.loop.promotion`)
        if decision == "rejected":
            self.sync_weights()  # the engine gets the restored weights
        self.state.last_heldout_accuracy = res.accuracy
        self.state.heldout_curve.append((step, res.accuracy, res.reward_mean))
        return {**metrics, "revision": decision, "revision_reason": reason}

    # ------------------------------------------------------------------ warm-up
    def warmup_and_baseline(self, progress: Progress | None = None) -> None:
        """SFT warm-up on reference answers (if ``sft.steps``, :func:`~posttrain.loop.warmup.sft_warmup`),
        then the step-0 held-out eval."""
        if self.cfg.sft.steps > 0:
            sft_warmup(self, progress)
        m = self.evaluate_and_judge(0)
        check_guards(self.cfg.guards, m)  # step 0: a breach (e.g. every verification failed) warns
        self.verdicts.add(m)
        self.log.log(0, m)

    # ------------------------------------------------------------------ bookkeeping
    def finish_step(self, step: int, trajs: list[Trajectory], metrics: StepMetrics, t_step: float) -> None:
        """Ledger + metrics for ``step``, advance the state, checkpoint when due."""
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
        every = self.cfg.checkpoint_every
        if (every and step % every == 0) or step == self.cfg.steps:
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Atomic checkpoint of everything needed to resume exactly (:mod:`posttrain.loop.checkpointing`)."""
        return checkpointing.write_checkpoint(self)

    def resume(self) -> bool:
        """Restore the newest checkpoint that loads; False when there is no complete one
        (:func:`posttrain.loop.checkpointing.resume`)."""
        return checkpointing.resume(self)

    def restart_clock(self, wall_before: float) -> None:
        """Count this invocation's wall time from now, on top of ``wall_before`` seconds of earlier ones."""
        self._t_start = time.perf_counter()
        self._wall_before = wall_before

    def wall_seconds(self) -> float:
        """Wall time of the run: earlier invocations (restored from a checkpoint) plus this one."""
        return self._wall_before + time.perf_counter() - self._t_start

    def stop(self, reason: str) -> None:
        """Stop the run with a reason (logged, ledger-visible via metrics, checkpointed)."""
        self.state.stopped = reason
        self.log.log(self.state.step, {"stopped": reason})
        log.error("run stopped at step %d: %s", self.state.step, reason)
        self.checkpoint()

    def close(self) -> None:
        """Close the sinks, verifier pool, backend and learner ranks, then release the run-directory lock
        (idempotent)."""
        self.state.wall_seconds = self.wall_seconds()
        try:
            if hasattr(self.learner, "close"):  # learner rank processes (learner.strategy ddp / fsdp2)
                self.learner.close()
            self.log.close()
            if self._pool is not None:
                self._pool.close()
            if self.backend is not None:
                self.backend.close()
                self.backend = None
            elif hasattr(self.engine, "close"):  # an engine server process (rollout.engine=vllm)
                self.engine.close()
        finally:
            if self._lock is not None:
                self._lock.release()


def run_dir_of(cfg: RunConfig) -> Path:
    """The run directory of ``cfg``: ``run_dir``, default ``runs/<name>``."""
    return Path(cfg.run_dir or f"runs/{cfg.name}")


def open_run(cfg: RunConfig) -> Run:
    """Build the run in its locked run directory; resume from its latest checkpoint when ``cfg.resume``.

    The lock is held until :meth:`Run.close` (released here if building fails). ``config.yaml``
    is written atomically; a forced resume with a changed recipe first keeps the old one as
    ``config.step_<N>.yaml``.
    """
    from posttrain.loop.run_dir import RunDirLock, prepare_run_dir, refuse_to_overwrite, write_text_atomic

    fresh = not run_dir_of(cfg).exists()
    run_dir = prepare_run_dir(run_dir_of(cfg))
    lock = RunDirLock(run_dir)
    try:
        forced = check_resumable(cfg, run_dir) if cfg.resume else None
        if not cfg.resume:
            refuse_to_overwrite(run_dir)
        run = Run(cfg, lock=lock)
    except BaseException:
        lock.release()
        if fresh:  # a run that never started (bad data, model, ...) leaves no directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        if cfg.resume:
            if not run.resume():  # the checkpoints vanished since check_resumable: still not a fresh start
                from posttrain.loop.run_dir import RunDirError

                raise RunDirError(f"resume=true but {run_dir / 'checkpoints'} holds no complete checkpoint")
            log.info("resumed %s at step %d", run.dir, run.state.step)
            if forced:
                keep = run.dir / f"config.step_{run.state.step:06d}.yaml"
                os.replace(run.dir / "config.yaml", keep)
                log.warning("resume_force: recipe changed (%s); the previous config is kept as %s", forced, keep)
        write_text_atomic(run.dir / "config.yaml", dump_config(cfg))
    except BaseException:
        run.close()
        raise
    return run
