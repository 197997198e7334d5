"""The parts of one run, built once from its config: :class:`Parts` and :func:`build_parts`.

The composition root of a run: tokenizer, prompt renderer, task and held-out set, the policy
:class:`~posttrain.learner.protocol.Learner` (in process or learner ranks), the rollout engine (in
process, or the Ray worker pool of ``system.backend=ray`` behind the same calls), the frozen
reference, the frozen distillation teacher, the critic, the guarded verification path and the evaluation-only verifier. Each member
is typed by what the loop calls on it. The parts carry their config, so they are what a held-out
evaluation, the rollout players and the warm-up read (:class:`~posttrain.loop.heldout.EvaluatedRun`);
:class:`~posttrain.loop.run.Run` is given them and keeps only the run directory's state (ledger, metrics,
checkpoints, promotion, cursor). The operations on parts alone are functions here: the frozen reference's /
teacher's log-probs (:func:`frozen_logprobs`), the weight sync (:func:`sync_weights`) and :func:`close_parts`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.config import RunConfig
from posttrain.learner.critic import CriticLearner, ValueModel
from posttrain.learner.protocol import Learner
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.loop.builders import (
    build_engine,
    build_learner,
    build_model,
    build_renderer,
    build_task,
    build_teacher,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.envs.task import Task, TaskExample
    from posttrain.loop.backends import Backend
    from posttrain.rewards import VerifierPool
    from posttrain.rewards.scoring import VerifyBatch
    from posttrain.rewards.verifier import Verifier
    from posttrain.rollout.engine import RolloutEngine
    from posttrain.trajectory import TrajectoryBatch


@dataclasses.dataclass(frozen=True)
class Parts:
    """The built parts of a run (see the module docstring).

    ``plain_model``: the actor's architecture without LoRA (the engine, reference and critic are built
    from it); ``backend``: the Ray workers (None with the local backend); ``verify_batch``: the one
    guarded verification path (reward actors, or ``pool`` in this process); ``teacher_model``: the frozen
    teacher of ``loss.distill`` (None without it), same tokenizer as the actor; ``cfg``: the config they were
    built from."""

    cfg: RunConfig
    tokenizer: PreTrainedTokenizerBase
    renderer: PromptRenderer
    task: Task
    heldout: list[TaskExample]
    learner: Learner
    plain_model: torch.nn.Module
    engine: RolloutEngine
    backend: Backend | None
    ref_model: torch.nn.Module | None
    teacher_model: torch.nn.Module | None
    critic: CriticLearner | None
    hidden_verifier: Verifier | None
    verify_batch: VerifyBatch
    pool: VerifierPool | None

    @property
    def pad_token_id(self) -> int:
        """The tokenizer's pad id (0 when it has none): what collation pads with."""
        return int(self.tokenizer.pad_token_id or 0)


def frozen_logprobs(parts: Parts, model: torch.nn.Module, batch: TrajectoryBatch) -> torch.Tensor:
    """Per-token log-probs of ``batch`` under a frozen ``model`` (the reference, or ``loss.distill``'s teacher),
    computed as the learner computes pi_old: its sampling temperature and replayed top-k / top-p truncation,
    micro-batches of ``optim.microbatch_tokens``; 0 off the action mask."""
    from posttrain.learner.logprobs import token_logprobs

    learner = parts.learner
    lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=learner.temperature,
                           top_k=learner.top_k, top_p=learner.top_p,
                           microbatch_tokens=parts.cfg.optim.microbatch_tokens, action_mask=batch.action_mask)
    masked: torch.Tensor = lp * batch.action_mask.to(lp.dtype)
    return masked


def sync_weights(parts: Parts) -> None:
    """Push the learner's weights to the engine under the learner's version."""
    parts.engine.update_weights(parts.learner.weights_for_rollout(), version=parts.learner.version)


def close_parts(parts: Parts) -> None:
    """Stop what the parts started: the learner ranks, the verifier pool, then the Ray workers (and the Ray
    session they started) or an engine server process (``rollout.engine=vllm``)."""
    if hasattr(parts.learner, "close"):  # learner rank processes (learner.strategy ddp / fsdp2)
        parts.learner.close()
    if parts.pool is not None:
        parts.pool.close()
    if parts.backend is not None:
        parts.backend.close()
    elif hasattr(parts.engine, "close"):
        parts.engine.close()


def check_run_prompts(cfg: RunConfig, task: Task, heldout: Sequence[TaskExample], tokenizer: PreTrainedTokenizerBase,
                      model: torch.nn.Module, renderer: PromptRenderer) -> None:
    """Every prompt of a file task (else the held-out prompts) encodes and fits the engine's context with
    ``sampling.max_new_tokens``, and each held-out prompt with a larger ``eval.max_new_tokens``
    (:func:`~posttrain.loop.heldout.check_eval_budget`); the context is
    :func:`~posttrain.loop.episode_rollout.engine_context` (``rollout.vllm.max_model_len`` with vLLM, which
    would cut the responses there silently). ``ValueError`` naming the file and row (and
    ``rollout.vllm.max_model_len=N:`` when that cap is what does not fit)."""
    from posttrain.envs.task import check_prompts, task_rows
    from posttrain.loop.episode_rollout import engine_context
    from posttrain.loop.heldout import check_eval_budget

    context = engine_context(cfg, model)
    capped = context is not None and context != engine_context(None, model)
    try:
        check_prompts(task_rows(task) or heldout, tokenizer, max_context=context,
                      max_new_tokens=cfg.sampling.max_new_tokens, renderer=renderer)
        check_eval_budget(cfg, heldout, tokenizer, max_context=context, renderer=renderer)  # eval.max_new_tokens
    except ValueError as e:
        if capped:
            raise ValueError(f"rollout.vllm.max_model_len={context}: {e}") from None
        raise


def build_critic(cfg: RunConfig, plain_model: torch.nn.Module) -> CriticLearner:
    """The critic of ``critic.enabled``: a value head on a copy of ``plain_model`` (or on its backbone with
    ``critic.shared_backbone``), trained at ``critic.lr`` with the policy's epochs, mini-batches,
    micro-batch budget and gradient clip, and PPO's value clip ``critic.value_clip``."""
    vm = ValueModel.from_actor(plain_model, shared_backbone=cfg.critic.shared_backbone, seed=cfg.seed)
    return CriticLearner(
        vm, clip_eps=cfg.critic.value_clip,
        optim=OptimizerSettings(lr=cfg.critic.lr, max_grad_norm=cfg.optim.max_grad_norm),
        batching=BatchingSettings(epochs=cfg.optim.ppo_epochs, num_minibatches=cfg.optim.num_minibatches,
                                  microbatch_tokens=cfg.optim.microbatch_tokens, seed=cfg.seed),
    )


def build_parts(cfg: RunConfig, run_dir: Path) -> Parts:
    """Every part of the run of ``cfg`` (``run_dir``: where engines keep their files), in a fixed order
    (``torch.manual_seed(cfg.seed)`` first), after which every prompt of a file task (else the held-out
    prompts) is checked to encode and fit the model's context: one error naming the file and row."""
    torch.manual_seed(cfg.seed)
    tokenizer, actor = build_model(cfg)
    # One renderer for every single-turn prompt (rollout, learner check, eval, SFT): task.chat_template.
    renderer = build_renderer(cfg, tokenizer)
    task = build_task(cfg)
    # LoRA wraps the actor in place (peft): the engine, the reference and the critic need the
    # plain architecture, so they are built from a copy taken before the wrap (without LoRA the learner
    # keeps ``actor`` itself as its model).
    plain_model: torch.nn.Module = copy.deepcopy(actor) if cfg.lora.rank > 0 else actor
    # The rollout side: Ray rollout (and reward) workers behind the same calls as an in-process engine.
    # Built before the learner, so the backend is the one that joins or starts Ray (Ray learner ranks
    # then join its session) and, at Run.close, shuts down the session it started.
    backend: Backend | None = None
    remote_verify: VerifyBatch | None = None
    if cfg.system.backend == "ray":
        backend, remote_verify = _ray_backend(cfg, plain_model, tokenizer, run_dir)
    learner: Learner | None = None
    try:
        learner = build_learner(cfg, actor)
        return _build_rest(cfg, run_dir, tokenizer, renderer, task, learner, plain_model, backend, remote_verify)
    except BaseException:  # a part failed: stop the learner ranks, then the workers (and the Ray they started)
        if learner is not None:
            learner.close()
        if backend is not None:
            backend.close()
        raise


def _build_rest(cfg: RunConfig, run_dir: Path, tokenizer: PreTrainedTokenizerBase, renderer: PromptRenderer,
                task: Task, learner: Learner, plain_model: torch.nn.Module, backend: Backend | None,
                remote_verify: VerifyBatch | None) -> Parts:
    """The parts :func:`build_parts` builds after the backend and the learner, in its order."""
    engine: RolloutEngine = backend.rollout if backend is not None else build_engine(plain_model, tokenizer, cfg,
                                                                                     run_dir)
    ref_model = copy.deepcopy(plain_model).eval().requires_grad_(False) if cfg.loss.kl_estimator is not None else None
    critic = build_critic(cfg, plain_model) if cfg.critic.enabled else None
    teacher = build_teacher(cfg, tokenizer)  # loss.distill: frozen, on the learner side
    heldout = task.examples("heldout", cfg.eval.size, seed=cfg.eval.heldout_seed_of(cfg.seed))
    hidden: Verifier | None = None  # eval.hidden_verifier: judges beside the task's, never rewards
    if cfg.eval.hidden_verifier is not None:
        from posttrain.rewards.hidden import build_hidden_verifier

        hidden = build_hidden_verifier(cfg.eval.hidden_verifier, cfg.eval.hidden_verifier_kwargs)
    check_run_prompts(cfg, task, heldout, tokenizer, plain_model, renderer)
    pool: VerifierPool | None = None
    if remote_verify is None:
        from posttrain.rewards import VerifierPool

        # workers=0 too: the in-process pool applies reward.timeout_s / retries (a daemon thread per
        # call), and training and held-out evaluation both verify through this one guarded path.
        pool = VerifierPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s, retries=cfg.reward.retries)
        remote_verify = pool.verify_batch
    from posttrain.rewards.learned import build_learned_rewards

    # reward.model / reward.judge: their scores join each verdict as components (a failed score: infra_error).
    remote_verify = build_learned_rewards(cfg.reward, remote_verify)
    return Parts(cfg=cfg, tokenizer=tokenizer, renderer=renderer, task=task, heldout=list(heldout), learner=learner,
                 plain_model=plain_model, engine=engine, backend=backend, ref_model=ref_model, critic=critic,
                 hidden_verifier=hidden, verify_batch=remote_verify, pool=pool, teacher_model=teacher)


def _ray_backend(cfg: RunConfig, plain_model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                 run_dir: Path) -> tuple[Backend, VerifyBatch | None]:
    """Rollout (and reward) workers as Ray actors behind the same calls the loop already makes.

    The actors get a copy of the actor model; the engine becomes the worker pool (a ``RolloutEngine``
    whose ``generate_detailed`` reports failed requests as infra errors) and, with reward workers
    (:meth:`~posttrain.config.RunConfig.ray_reward_actors`: none for episodes), verification their
    ``verify_batch`` (None: the driver verifies). See docs/distributed.md."""
    from posttrain.loop.backends import build_ray_backend
    from posttrain.loop.builders import engine_factory

    factory = engine_factory(cfg, plain_model, tokenizer, run_dir)  # rollout.engine
    # No reward actor where nothing calls one (episodes score themselves): not started, nothing reserved.
    ray = cfg.system.ray.model_copy(update={"num_reward_workers": cfg.ray_reward_actors()})
    backend = build_ray_backend(factory, ray)
    return backend, (backend.reward.verify_batch if backend.reward is not None else None)


__all__ = ["Parts", "build_critic", "build_parts", "check_run_prompts", "close_parts", "frozen_logprobs",
           "sync_weights"]
