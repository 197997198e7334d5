"""A run's parts and its resumable state: what a checkpoint holds and how a step is recorded.

``open_run`` builds the tokenizer, actor, frozen reference, engine, learner, task and held-out
set; with ``resume=true`` it restores the latest atomic checkpoint (weights, optimizer,
scheduler, RNG, data cursor, versions, adaptive-KL state) and moves ledger steps written after
that checkpoint to ``ledger/discarded/`` so the ledger continues without gaps or duplicates.

The run directory is protected (see :mod:`posttrain.loop.run_dir`): it is locked for the run's
lifetime; ``resume=true`` with no complete checkpoint is an error, as is a recipe that differs
from the run's ``config.yaml`` unless ``resume_force=true``; a checkpoint that cannot be read
falls back to the previous complete one (with a warning); ``metrics.jsonl`` lines after the
restored step are dropped so no step appears twice.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config import RunConfig, dump_config
from posttrain.loop.builders import build_engine, build_learner, build_model, build_renderer, build_task
from posttrain.loop.guards import VerdictTally, check_guards
from posttrain.loop.metrics_log import MetricsLog
from posttrain.trajectory import Ledger, Trajectory

log = logging.getLogger("posttrain")


@dataclasses.dataclass
class RunState:
    """Everything that must survive a crash besides weights and optimizer state."""

    step: int = 0
    cursor: int = 0  # training prompts consumed
    ref_version: int = 0
    best_heldout_accuracy: float = -1.0
    last_heldout_accuracy: float = float("nan")
    promoted_step: int = 0
    heldout_curve: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # step, acc, reward
    reward_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    stopped: str | None = None
    wall_seconds: float = 0.0
    rollout_calls: int = 0  # rollout calls started (non-sync modes run ahead of ``step``)
    inflight_at_checkpoint: int = 0  # samples queued / paused when the checkpoint was written
    discarded_on_resume: int = 0  # in-flight samples of the checkpoint that a resume discarded (counted)
    unconsumed_samples: int = 0  # samples generated but never trained on when the run ended
    rollout_dropped: int = 0  # paused samples dropped before resuming (max_version_span / max_staleness)


def reference_answer(task: Any, ex: Any) -> str:
    """The model-free reference response of an example (``meta['answer']``), for SFT warm-up."""
    ans = ex.meta.get("answer")
    if ans is None:
        raise ValueError(f"task {task.name!r}: example {ex.prompt_id!r} has no meta['answer'] for the SFT warm-up")
    return str(ans)


class Run:
    """The composed parts of one run (built by :func:`open_run`)."""

    def __init__(self, cfg: RunConfig, lock: Any = None) -> None:
        self.cfg = cfg
        self.dir = run_dir_of(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock  # a RunDirLock held by open_run; released by close()
        torch.manual_seed(cfg.seed)
        self.tokenizer, actor = build_model(cfg)
        self.pad_token_id = int(self.tokenizer.pad_token_id or 0)
        # One renderer for every single-turn prompt (rollout, learner check, eval, SFT): task.chat_template.
        self.renderer = build_renderer(cfg, self.tokenizer)
        self.task = build_task(cfg)
        # LoRA wraps the actor in place (peft): the engine, the reference and the critic need the
        # plain architecture, so they are built from a copy taken before the wrap.
        plain = copy.deepcopy(actor) if cfg.lora.rank > 0 else None
        self.learner = build_learner(cfg, actor)
        self.plain_model: torch.nn.Module = plain if plain is not None else self.learner.model
        # The rollout side: an in-process engine, or Ray rollout (and reward) workers behind the same calls.
        self.backend: Any = None
        self.verify_batch: Any = None  # None: verify in this process; set by a pool or reward actors
        if cfg.system.backend == "ray":
            self._open_ray_backend()
        else:
            self.engine = build_engine(self.plain_model, self.tokenizer, cfg, self.dir)
        self.ref_model: torch.nn.Module | None = None
        if cfg.loss.kl_estimator is not None:
            self.ref_model = copy.deepcopy(self.plain_model).eval().requires_grad_(False)
        self.critic = None
        if cfg.critic.enabled:
            from posttrain.learner.critic import CriticLearner, ValueModel

            vm = ValueModel.from_actor(self.plain_model, shared_backbone=cfg.critic.shared_backbone, seed=cfg.seed)
            self.critic = CriticLearner(vm, lr=cfg.critic.lr, clip_eps=cfg.critic.value_clip,
                                        microbatch_tokens=cfg.optim.microbatch_tokens,
                                        max_grad_norm=cfg.optim.max_grad_norm, epochs=cfg.optim.ppo_epochs,
                                        num_minibatches=cfg.optim.num_minibatches, seed=cfg.seed)
        self.heldout = self.task.examples("heldout", cfg.eval.size, seed=cfg.seed)
        self.hidden_verifier: Any = None  # eval.hidden_verifier: judges beside the task's, never rewards
        if cfg.eval.hidden_verifier is not None:
            from posttrain.rewards.hidden import build_hidden_verifier

            self.hidden_verifier = build_hidden_verifier(cfg.eval.hidden_verifier, cfg.eval.hidden_verifier_kwargs)
        # Every row of a file task (else the held-out prompts) must encode and fit the model's context,
        # checked by length before tokenizing: one error naming the file and row, before any rollout.
        from posttrain.envs.task import check_prompts, task_rows

        check_prompts(task_rows(self.task) or self.heldout, self.tokenizer,
                      max_context=getattr(getattr(self.plain_model, "config", None), "max_position_embeddings", None),
                      max_new_tokens=cfg.sampling.max_new_tokens, renderer=self.renderer)
        self.step_examples: dict[str, Any] = {}  # prompt_id -> TaskExample drawn this step (see next_prompts)
        self.ledger = Ledger(self.dir / "ledger")
        self.log = MetricsLog.for_run(self.dir, cfg)  # metrics.jsonl + the trackers of cfg.logging
        self.state = RunState()
        self._pool = None
        if self.verify_batch is None:
            from posttrain.rewards import VerifierPool

            # workers=0 too: the in-process pool applies reward.timeout_s / retries (a daemon thread per
            # call), and training and held-out evaluation both verify through this one guarded path.
            self._pool = VerifierPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s,
                                      retries=cfg.reward.retries)
            self.verify_batch = self._pool.verify_batch
        self._promoted: dict[str, torch.Tensor] | None = None
        self.verdicts = VerdictTally()  # this invocation's verifications: nothing judged at all -> an error
        self.inflight_count: Any = None  # set by the loop: samples queued / paused in the producer
        self._t_start = time.perf_counter()
        self._wall_before = 0.0

    def _open_ray_backend(self) -> None:
        """Rollout (and reward) workers as Ray actors behind the same calls the loop already makes.

        The actors get a copy of the actor model; ``run.engine`` becomes the worker pool (a
        ``RolloutEngine`` whose ``generate_detailed`` reports failed requests as infra errors) and,
        with reward workers, ``run.verify_batch`` their ``verify_batch``. See docs/distributed.md.
        """
        from posttrain.loop.backends import build_ray_backend
        from posttrain.loop.builders import engine_factory

        factory = engine_factory(self.cfg, self.plain_model, self.tokenizer, self.dir)  # rollout.engine
        self.backend = build_ray_backend(factory, self.cfg.system.ray)
        self.engine = self.backend.rollout
        # Verification on the reward actors; with none, the driver verifies (reward.workers as locally).
        self.verify_batch = self.backend.reward.verify_batch if self.cfg.system.ray.num_reward_workers > 0 else None

    # ------------------------------------------------------------------ data
    def next_prompts(self, n: int) -> list[Any]:
        """``n`` training prompts at the data cursor (deterministic by seed and cursor)."""
        seed = self.cfg.seed * 7_919 + self.state.cursor
        self.state.cursor += n
        out = list(self.task.examples("train", n, seed=seed))
        # ReMax's greedy baseline looks this step's prompts up by id (loop/targets.py run_baseline clears it).
        self.step_examples.update((ex.prompt_id, ex) for ex in out)
        return out

    # ------------------------------------------------------------------ policy
    def ref_logprobs(self, batch: Any) -> torch.Tensor:
        """Reference log-probs (frozen model, the learner's temperature and replayed truncation)."""
        from posttrain.learner.logprobs import token_logprobs

        assert self.ref_model is not None
        lp, _ = token_logprobs(self.ref_model, batch.input_ids, batch.attention_mask,
                               temperature=self.learner.temperature,
                               top_k=self.learner.top_k, top_p=self.learner.top_p,
                               microbatch_tokens=self.cfg.optim.microbatch_tokens, action_mask=batch.action_mask)
        return lp * batch.action_mask.to(lp.dtype)

    def kl_coef_value(self) -> float:
        """beta for this step: ``loss.kl_coef`` or the adaptive controller's current value. The learner
        holds the coefficient in both placements (``builders.build_kl_coef``): this step's loss reads it,
        or with ``credit.kl_in_reward`` the token rewards (``build_targets(kl_coef=...)``) do."""
        c = self.learner.kl_coef
        return float(getattr(c, "value", c))

    def observe_kl(self, metrics: dict[str, Any]) -> None:
        """Feed this step's observed KL to an adaptive controller (Ziegler et al. 2019; bounded update,
        :class:`~posttrain.algos.kl.AdaptiveKLController`) with the step's sample count
        (``prompts_per_step * group_size``, the unit of ``loss.kl_horizon``).

        The observed KL is the one the coefficient multiplied: the mean token KL to the reference
        in the reward (``kl/ref_mean``, pi_old vs pi_ref) with ``credit.kl_in_reward``, else the
        loss's ``kl``. ``metrics["kl_coef"]`` is set to the beta this step applied (read before the
        update); the updated one, which the next step applies, goes to ``kl_coef_next``."""
        ctl = self.learner.kl_coef
        metrics["kl_coef"] = float(getattr(ctl, "value", ctl))  # what this step applied (the learner's too)
        key = "kl/ref_mean" if self.cfg.credit.kl_in_reward else "kl"
        if hasattr(ctl, "update") and metrics.get(key) is not None:
            ctl.update(float(metrics[key]), self.cfg.sampling.prompts_per_step * self.cfg.sampling.group_size)
            metrics["kl_coef_next"] = float(ctl.value)

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

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.learner.model.state_dict().items()}

    def reject(self, step: int, reason: str) -> None:
        """Restore the last promoted weights and log why (the revision is rejected)."""
        if self._promoted is not None:
            self.learner.model.load_state_dict(self._promoted)
        self.state.decisions.append({"step": step, "decision": "rejected", "reason": reason})
        log.warning("step %d: revision rejected: %s", step, reason)

    def evaluate(self, temperature: float | None = None, samples: int = 1) -> Any:
        """Held-out evaluation of the engine's current weights (default: ``eval.temperature``);
        ``samples`` > 1 draws that many responses per prompt for pass@``eval.k``."""
        from posttrain.loop.heldout import evaluate_run  # one path, shared with `posttrain eval`

        return evaluate_run(self, temperature, samples=samples)

    def evaluate_episodes(self, temperature: float | None = None, env_overrides: dict[str, Any] | None = None,
                          samples: int = 1) -> Any:
        """Held-out evaluation of an ``env.name`` run: ``samples`` episodes per held-out start (default
        temperature ``eval.temperature``; ``env_overrides`` e.g. ``{"use_tools": False}``)."""
        from posttrain.loop.heldout import evaluate_run

        return evaluate_run(self, temperature, samples=samples, env_overrides=env_overrides)

    def evaluate_and_judge(self, step: int) -> dict[str, float | str]:
        """Evaluate; promote if best so far, reject (restore) on a collapse, else retain."""
        from posttrain.loop.heldout import heldout_metrics  # shared with `posttrain eval`

        res, metrics = heldout_metrics(self)
        st = self.state
        acc = res.accuracy
        decision, reason = "retained", ""
        if st.best_heldout_accuracy >= 0 and acc < st.best_heldout_accuracy - self.cfg.eval.reject_drop:
            decision = "rejected"
            reason = f"held-out accuracy {acc:.3f} collapsed below best {st.best_heldout_accuracy:.3f}"
            self.reject(step, reason)
            self.sync_weights()
        elif acc >= st.best_heldout_accuracy:
            decision = "promoted"
            st.best_heldout_accuracy, st.promoted_step = acc, step
            self._promoted = self._snapshot()
        if decision != "rejected":
            st.decisions.append({"step": step, "decision": decision, "accuracy": acc})
        st.last_heldout_accuracy = acc
        st.heldout_curve.append((step, acc, res.reward_mean))
        return {**metrics, "revision": decision, "revision_reason": reason}

    # ------------------------------------------------------------------ warm-up
    def warmup_and_baseline(self, progress: Any = None) -> None:
        """SFT warm-up on reference answers (if ``sft.steps``), then the step-0 held-out eval."""
        cfg = self.cfg
        if cfg.sft.steps > 0:
            from posttrain.learner.sft import run_sft

            pool = self.task.examples("train", cfg.sft.examples, seed=cfg.seed + 12_345)
            tok = self.tokenizer
            eos = tok.eos_token_id
            if cfg.env.name is not None:  # multi-turn: the environment's demonstrations, one pair per turn
                from posttrain.loop.episode_rollout import EpisodeRollout, sft_pairs
                from posttrain.loop.rollout_stage import RolloutStage

                pairs = sft_pairs(EpisodeRollout(cfg, self, RolloutStage.from_config(cfg)), pool)
            else:
                pairs = [(self.renderer.ids(ex), tok(reference_answer(self.task, ex)).input_ids + [eos]) for ex in pool]
            g = torch.Generator().manual_seed(cfg.seed)
            bar = progress.add_task("SFT warm-up", total=cfg.sft.steps) if progress else None

            def batches(s: int) -> list[tuple[list[int], list[int]]]:
                idx = torch.randint(len(pairs), (cfg.sft.batch_size,), generator=g).tolist()
                return [pairs[i] for i in idx]

            def on_step(s: int, loss: float) -> None:
                if progress is not None:
                    progress.update(bar, advance=1, description=f"SFT warm-up loss {loss:.3f}")

            losses = run_sft(self.learner.model, batches, steps=cfg.sft.steps, lr=cfg.sft.lr,
                             pad_token_id=self.pad_token_id, on_step=on_step)
            self.learner.model.eval()
            (self.dir / "sft_losses.json").write_text(json.dumps(losses))
            if self.ref_model is not None:
                self.ref_model.load_state_dict(self.learner.weights_for_rollout())  # plain names (LoRA merged)
            self.sync_weights()
        m = self.evaluate_and_judge(0)
        check_guards(self.cfg.guards, m)  # step 0: a breach (e.g. every verification failed) warns
        self.verdicts.add(m)
        self.log.log(0, m)

    # ------------------------------------------------------------------ bookkeeping
    def finish_step(self, step: int, trajs: list[Trajectory], metrics: dict[str, Any], t_step: float) -> None:
        """Ledger + metrics for ``step``, advance the state, checkpoint when due."""
        metrics["time/step_s"] = time.perf_counter() - t_step
        self.state.step = step
        if "reward/mean" in metrics:
            self.state.reward_curve.append((step, float(metrics["reward/mean"])))
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None}
        self.verdicts.add(scalars, trajs)
        self.ledger.write_trajectories(step, trajs)
        self.ledger.write_metrics(step, scalars)
        self.log.log(step, scalars)
        every = self.cfg.checkpoint_every
        if (every and step % every == 0) or step == self.cfg.steps:
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Atomic checkpoint of everything needed to resume exactly."""
        from posttrain.learner.checkpoint import save_checkpoint

        self.state.wall_seconds = self._wall_before + time.perf_counter() - self._t_start
        # Queued / paused samples are not in the checkpoint: a resume discards them and counts them.
        self.state.inflight_at_checkpoint = int(self.inflight_count()) if self.inflight_count is not None else 0
        extra = {"run_state": dataclasses.asdict(self.state), "engine_version": self.engine.version}
        if self.ref_model is not None:
            extra["has_ref"] = True
        return save_checkpoint(
            self.dir / "checkpoints" / f"step_{self.state.step:06d}",
            step=self.state.step, actor=self.learner.model, tokenizer=self.tokenizer,
            critic=None if self.critic is None else self.critic.model,
            learner_state=self._learner_state, extra=extra,
        )

    def _learner_state(self, directory: Path) -> dict[str, Any]:
        # Learner ranks write their model + optimizer shards into the checkpoint (learner_dcp/).
        from posttrain.learner.sharded_checkpoint import SHARDED_DIR

        save_sharded = getattr(self.learner, "save_sharded", None)
        s: dict[str, Any] = {"learner": save_sharded(directory / SHARDED_DIR) if save_sharded is not None
                             else self.learner.state_dict()}
        if self.ref_model is not None:
            s["ref_model"] = self.ref_model.state_dict()
        if self._promoted is not None:
            s["promoted"] = self._promoted
        if self.critic is not None:
            s["critic"] = self.critic.state_dict()
        return s

    def resume(self) -> bool:
        """Restore the newest checkpoint that loads; returns False when there is no complete one.

        A checkpoint that fails to load (truncated or corrupt file) is skipped with a warning and
        the previous complete one is used; when none loads, ``UserError`` names the newest and why.
        Ledger steps and ``metrics.jsonl`` lines after the restored step are set aside / dropped.
        """
        from posttrain.learner.checkpoint import complete_checkpoints

        paths = complete_checkpoints(self.dir / "checkpoints")
        if not paths:
            return False
        first_err: str | None = None
        for path in reversed(paths):
            try:
                self._restore(path)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
                why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                first_err = first_err or f"{path}: {why}"
                log.warning("resume: checkpoint %s cannot be loaded (%s); falling back to the previous one", path, why)
                continue
            break
        else:
            from posttrain.loop.run_dir import RunDirError

            raise RunDirError(f"resume: no checkpoint under {self.dir / 'checkpoints'} can be loaded ({first_err})")
        dropped = self.log.truncate_after(self.state.step)
        if dropped:
            log.warning("resume: dropped %d metrics.jsonl lines written after step %d", dropped, self.state.step)
        return True

    def _restore(self, path: Path) -> None:
        """Load checkpoint ``path`` into the learner, engine, state and RNGs (raises if it is unreadable)."""
        from posttrain.learner.checkpoint import load_checkpoint, restore_actor, restore_rng

        ck = load_checkpoint(path)
        restore_actor(self.learner.model, ck)
        ls = ck.learner_state
        if "sharded" in ls["learner"]:  # learner ranks' DCP shards: any world size, or the embedded learner
            from posttrain.learner.sharded_checkpoint import load_sharded_into_learner

            load_sharded_into_learner(self.learner, path / ls["learner"]["sharded"], ls["learner"])
        else:
            self.learner.load_state_dict(ls["learner"])
        if self.ref_model is not None and "ref_model" in ls:
            self.ref_model.load_state_dict(ls["ref_model"])
        if self.critic is not None:
            if ck.critic_dir is None:
                raise ValueError(f"{path}: checkpoint has no critic/ but this run has a critic")
            self.critic.model.load(ck.critic_dir)
            self.critic.load_state_dict(ls["critic"])
        self._promoted = ls.get("promoted")
        rs = dict(ck.extra["run_state"])
        rs["heldout_curve"] = [tuple(x) for x in rs["heldout_curve"]]
        rs["reward_curve"] = [tuple(x) for x in rs["reward_curve"]]
        self.state = RunState(**rs)
        self._wall_before = self.state.wall_seconds
        if self.state.inflight_at_checkpoint:
            self.state.discarded_on_resume += self.state.inflight_at_checkpoint
            log.warning("resume: %d samples that were queued or paused at the checkpoint are discarded (counted in "
                        "run_state.discarded_on_resume)", self.state.inflight_at_checkpoint)
            self.state.inflight_at_checkpoint = 0
        self.engine.update_weights(self.learner.weights_for_rollout(), version=int(ck.extra["engine_version"]))
        restore_rng(ck.rng)
        moved = self.ledger.discard_after(self.state.step)
        if moved:
            log.warning("resume: moved %d ledger files written after step %d to ledger/discarded/",
                        len(moved), self.state.step)

    def stop(self, reason: str) -> None:
        """Stop the run with a reason (logged, ledger-visible via metrics, checkpointed)."""
        self.state.stopped = reason
        self.log.log(self.state.step, {"stopped": reason})
        log.error("run stopped at step %d: %s", self.state.step, reason)
        self.checkpoint()

    def close(self) -> None:
        """Close the sinks, verifier pool, backend and learner ranks, then release the run-directory lock
        (idempotent)."""
        self.state.wall_seconds = self._wall_before + time.perf_counter() - self._t_start
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


def check_resumable(cfg: RunConfig, run_dir: Path) -> str | None:
    """Before building anything: refuse a ``resume=true`` that would start afresh or change the recipe.

    Raises ``UserError`` when there is no complete checkpoint, or when the resolved config differs
    from the run's ``config.yaml`` outside :data:`~posttrain.loop.run_dir.RESUME_MAY_CHANGE` and
    ``resume_force`` is off (the message lists ``key: old -> new``). Returns a one-line summary
    of the differences a forced resume accepts, else None.
    """
    from posttrain.learner.checkpoint import complete_checkpoints
    from posttrain.loop.run_dir import RunDirError, placement_changes, read_config_yaml, recipe_diff

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
    moved = placement_changes(old, new)  # change no arithmetic: resumed as is, config.yaml gets the new values
    if moved:
        log.warning("resume: placement-only keys changed (%s); config.yaml records the new values", "; ".join(moved))
    return "; ".join(diff) if diff else None


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
