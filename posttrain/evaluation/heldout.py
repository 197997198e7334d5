"""``posttrain eval``'s part of the held-out evaluation: the parts of a run rebuilt from a config and weights.

The evaluation itself is the run's (:mod:`posttrain.loop.heldout`: :func:`heldout_metrics` over the
rollout's one path); :class:`HeldoutRun` supplies what it reads of a run when there is no run, only
a checkpoint and its ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from posttrain.config import RunConfig
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.envs.task import Task, TaskExample
    from posttrain.rewards import VerifierPool
    from posttrain.rewards.scoring import VerifyBatch
    from posttrain.rewards.verifier import Verifier
    from posttrain.rollout.engine import RolloutEngine

__all__ = ["HeldoutRun"]


@dataclasses.dataclass
class HeldoutRun:
    """The parts of a run its held-out evaluation reads, rebuilt from a config and saved weights
    (``posttrain eval`` of a checkpoint): what :func:`evaluate_run` / :func:`heldout_metrics` need.

    Built by :meth:`from_config` with the run's own builders (task with ``reward.extract`` and
    ``reward.functions``, renderer, held-out split of ``eval.size`` at ``seed``, guarded verifier pool under
    the run's limits: ``reward.*``, or ``system.ray.verify_timeout_s`` / ``verify_retries`` when Ray reward
    actors verified, ``eval.hidden_verifier``), so nothing of the run's evaluation is re-implemented here.
    The task's further held-out sets (``eval_splits``) are fetched by the evaluation itself
    (:func:`~posttrain.loop.heldout.split_examples`: the same size and seed), as in the run.
    Call :meth:`close` when done (the verifier pool).
    """

    cfg: RunConfig
    engine: RolloutEngine
    tokenizer: PreTrainedTokenizerBase
    task: Task
    heldout: list[TaskExample]
    renderer: PromptRenderer
    verify_batch: VerifyBatch
    hidden_verifier: Verifier | None
    plain_model: torch.nn.Module
    _pool: VerifierPool | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> HeldoutRun:
        """The evaluation parts of run config ``cfg`` (a ``RunConfig``) over ``model`` / ``tokenizer``.

        Uses the in-process built-in engine (``rollout.engine`` is not started here). Raises the run's
        own one-line errors: a task or kwargs that do not build, a prompt that does not fit the context.
        """
        from posttrain.loop.builders import build_engine, build_renderer, build_task
        from posttrain.loop.parts import check_run_prompts
        from posttrain.rewards import VerifierPool

        task = build_task(cfg)
        renderer = build_renderer(cfg, tokenizer)
        heldout = list(task.examples("heldout", cfg.eval.size, seed=cfg.eval.heldout_seed_of(cfg.seed)))
        check_run_prompts(cfg, task, heldout, tokenizer, model, renderer)  # the run's own prompt checks
        hidden = None
        if cfg.eval.hidden_verifier is not None:
            from posttrain.rewards.hidden import build_hidden_verifier

            hidden = build_hidden_verifier(cfg.eval.hidden_verifier, cfg.eval.hidden_verifier_kwargs)
        ray = cfg.system.ray
        if cfg.ray_reward_actors() > 0:  # the run's Ray reward actors' limits
            pool = VerifierPool(workers=0, timeout_s=ray.verify_timeout_s, retries=ray.verify_retries)
        else:
            pool = VerifierPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s, retries=cfg.reward.retries)
        from posttrain.rollout.precision import engine_copy

        # the engine computes as the run's did (rollout.precision of the builtin engine; others sampled at
        # their own dtype, evaluated here by the builtin engine at the model's)
        engine = build_engine(engine_copy(model, cfg.rollout.builtin_precision()), tokenizer)
        return cls(cfg=cfg, engine=engine, tokenizer=tokenizer, task=task, heldout=heldout,
                   renderer=renderer, verify_batch=pool.verify_batch, hidden_verifier=hidden, plain_model=model,
                   _pool=pool)

    def close(self) -> None:
        """Close the verifier pool (idempotent)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
