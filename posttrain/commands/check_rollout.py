"""The rollout side of ``posttrain check``: a few groups sampled and scored as a training step would, and the
two checks every sampling trainer shares (``behavior_vs_old``, ``save_resume``; posttrain/commands/check.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.commands.check_result import CheckResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.config import RunConfig
    from posttrain.envs.task import Task
    from posttrain.learner.actor import PolicyLearner
    from posttrain.rewards.scoring import Decoder, VerifyBatch
    from posttrain.rollout.engine import RolloutEngine
    from posttrain.trajectory import Trajectory, TrajectoryBatch


def _episode_trajectories(cfg: RunConfig, prompts: int, tok: Decoder, model: torch.nn.Module, task: Task,
                          engine: RolloutEngine) -> list[Trajectory]:
    """``prompts`` groups of multi-turn episodes (``env.name``), played exactly as a training call
    plays them (the rollout driver, :func:`~posttrain.loop.rollout_stage.build_rollout`): the checks then
    run on a batch whose observation tokens sit between action turns."""
    import types

    from posttrain.loop.rollout_stage import RolloutStage, build_rollout

    run = types.SimpleNamespace(cfg=cfg, engine=engine, tokenizer=tok, task=task, plain_model=model,
                                next_prompts=lambda n: task.examples("train", n, seed=cfg.seed))
    whole = cfg.model_copy(update={"system": cfg.system.model_copy(update={"partial_fraction": 1.0})})
    groups, _ = build_rollout(whole, run, RolloutStage.from_config(cfg)).run_call(0, n_prompts=prompts)
    return [t for g in groups for t in g]


def _verify_batch(cfg: RunConfig) -> VerifyBatch | None:
    """The verification a run's verdicts go through when it has learned reward components (``reward.model``,
    ``reward.judge``: the verifier's verdicts plus theirs, :func:`~posttrain.rewards.learned.build_learned_rewards`,
    so ``reward.weights`` on them compose as in training); None (the default in-process path) otherwise."""
    if cfg.reward.model is None and cfg.reward.judge is None:
        return None
    from posttrain.rewards.learned import build_learned_rewards
    from posttrain.rewards.pool import VerifierPool

    return build_learned_rewards(cfg.reward, VerifierPool(workers=0).verify_batch)


def sample_trajectories(cfg: RunConfig, prompts: int, tok: Any, model: torch.nn.Module, task: Task,
                        engine: RolloutEngine) -> list[Trajectory]:
    """``prompts`` groups sampled and scored as a training step would (multi-turn episodes with ``env.name``),
    infra_error / env_failure rows left out; ``ValueError`` when none is left. ``tok`` is
    :func:`~posttrain.loop.builders.build_model`'s tokenizer (typed as it returns it)."""
    from posttrain.envs.task import check_prompts, task_rows
    from posttrain.loop.builders import build_renderer
    from posttrain.loop.single_turn import play_once
    from posttrain.rewards.scoring import ScoringSpec
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.trajectory import Status

    renderer = build_renderer(cfg, tok)
    if cfg.env.name is not None:
        trajs = _episode_trajectories(cfg, prompts, tok, model, task, engine)
    else:
        s = cfg.sampling
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, n=s.group_size, seed=cfg.seed)
        examples = task.examples("train", prompts, seed=cfg.seed)
        # Every row of a file task (else the sampled prompts) must encode and fit the model's context:
        # one error naming the file and row, before anything is tokenized for generation.
        check_prompts(task_rows(task) or examples, tok,
                      max_context=getattr(model.config, "max_position_embeddings", None),
                      max_new_tokens=s.max_new_tokens, renderer=renderer)
        played = play_once(engine, examples, params, request_ids=[f"check{i}" for i in range(len(examples))],
                           renderer=renderer, verifier=task.verifier, tokenizer=tok,
                           verify_batch=_verify_batch(cfg))
        trajs = played.trajectories(verifier=task.verifier, spec=ScoringSpec.of(cfg.reward))
    trajs = [t for t in trajs if t.status not in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    if not trajs:
        raise ValueError(f"check: none of the {prompts} sampled prompts gave a usable trajectory (all infra_error / "
                         "env_failure); nothing to check")
    return trajs


def check_behavior_vs_old(batch: TrajectoryBatch, old: torch.Tensor, cfg: RunConfig) -> CheckResult:
    """``behavior_vs_old``: |log kappa| = |log mu - log pi_old| over the action tokens against
    ``guards.max_abs_log_kappa`` (the guard the run applies), the engine at the recipe's ``rollout.precision``."""
    mask = batch.action_mask > 0
    lk = (batch.behavior_logprob - old).abs()[mask]
    p99 = float(torch.quantile(lk, 0.99)) if lk.numel() else 0.0
    thr = cfg.guards.max_abs_log_kappa
    ok = float(lk.max()) < thr
    hint = ""
    if not ok and cfg.correction.name is None:  # a real mismatch the loss does not correct
        hint = ("; the loss treats these samples as on-policy: set correction.name (tis, icepop, mis; "
                "docs/rollout.md) and guards.max_abs_log_kappa to the mismatch you accept")
    return ("behavior_vs_old", ok,
            f"|log k| mean {float(lk.mean()):.2e}, p99 {p99:.2e}, max {float(lk.max()):.2e} (limit {thr:g}, "
            f"rollout.precision={cfg.rollout.precision}, correction.name={cfg.correction.name}){hint}")


def check_save_resume(cfg: RunConfig, learner: PolicyLearner, tok: PreTrainedTokenizerBase, batch: TrajectoryBatch,
                      old: torch.Tensor) -> CheckResult:
    """``save_resume``: a checkpoint of ``learner`` reloaded into a differently initialised model gives the
    same log-probs, and the cursor and versions come back."""
    from posttrain.learner.checkpoint import load_checkpoint, restore_actor, save_checkpoint
    from posttrain.loop.builders import build_model, build_policy_learner

    with tempfile.TemporaryDirectory() as d:
        extra = {"cursor": 123, "policy_version": learner.version, "ref_version": 0}
        path = save_checkpoint(Path(d) / "step_000001", step=1, actor=learner.model, tokenizer=tok,
                               learner_state={"learner": learner.state_dict()}, extra=extra)
        ck = load_checkpoint(path)
        _, fresh = build_model(cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_seed": cfg.model.init_seed + 1})}))
        restore_actor(fresh, ck)
        lp2 = build_policy_learner(cfg, fresh).compute_logprobs(batch)
        dlp = float((lp2 - old).abs().max())
        same_extra = ck.extra == extra
    return ("save_resume", dlp == 0.0 and same_extra,
            f"max |d logprob| after reload {dlp:.2e}; cursor/versions restored: {same_extra}")
