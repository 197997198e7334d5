"""``posttrain check RECIPE [key=value ...]``: the rollout-to-update invariants checked on the user's own setup.

On the configured model, engine and recipe (a few prompts, no training) it checks:

1. ``ratio_is_one``: with ``lr = 0`` (pi_theta = pi_old) every action token's ratio is 1 and no
   token is clipped;
2. ``mask_invariance``: loss and gradient are unchanged when log-probs, advantages and token ids
   change only at positions the action mask excludes;
3. ``behavior_vs_old``: |log kappa| = |log mu - log pi_old| over action tokens (mean, p99, max)
   against ``guards.max_abs_log_kappa``;
4. ``microbatch_split``: gradients with one row per micro-batch equal the whole-batch gradients;
5. ``save_resume``: a checkpoint round trip keeps the log-probs, versions and data cursor.

With ``env.name`` set the trajectories are multi-turn episodes played as in training, so checks
1-4 also cover the observation tokens between turns (never in a ratio, a loss or a gradient). With
``loss.distill`` the advantages are the teacher's reverse-KL ones the run trains on.

The list depends on the recipe's ``trainer`` (:func:`run_checks`): ``preference`` (offline) and
``reward_model`` run their own checks on a few pairs of ``preference.data``
(:mod:`posttrain.commands.check_preference`, :mod:`posttrain.commands.check_reward_model`); online
``preference`` runs checks 3 and 5 on the sampled groups and the preference checks on pairs built from
them (:mod:`posttrain.commands.check_online_preference`).

Prints a pass / FAIL / n/a table (n/a: the check does not apply, the detail says why); exit code 1 when
any check fails.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.commands.check_result import CheckResult, all_passed, max_rel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.config import RunConfig
    from posttrain.envs.task import Task
    from posttrain.learner.actor import PolicyLearner
    from posttrain.rewards.scoring import Decoder, VerifyBatch
    from posttrain.rollout.engine import RolloutEngine
    from posttrain.trajectory import Trajectory, TrajectoryBatch


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="run the verification list of the recipe's trainer (ratio=1, masking, |log k|, "
                                     "splits, resume; preference / reward-model checks)")
    p.add_argument("recipe", nargs="?", default="grpo", help="recipe YAML path or shipped name (default grpo)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--prompts", type=int, default=4, help="prompts to sample (x group size); preference and "
                   "reward-model recipes: pairs to check")
    p.set_defaults(func=run)


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
        trajs = played.trajectories(verifier=task.verifier, spec=ScoringSpec(
            cfg.reward.weights, cfg.reward.overlong_max_len, cfg.reward.overlong_cache_len))
    trajs = [t for t in trajs if t.status not in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    if not trajs:
        raise ValueError(f"check: none of the {prompts} sampled prompts gave a usable trajectory (all infra_error / "
                         "env_failure); nothing to check")
    return trajs


def check_behavior_vs_old(batch: TrajectoryBatch, old: torch.Tensor, cfg: RunConfig) -> CheckResult:
    """``behavior_vs_old``: |log kappa| = |log mu - log pi_old| over the action tokens against
    ``guards.max_abs_log_kappa``."""
    mask = batch.action_mask > 0
    lk = (batch.behavior_logprob - old).abs()[mask]
    p99 = float(torch.quantile(lk, 0.99)) if lk.numel() else 0.0
    thr = cfg.guards.max_abs_log_kappa
    return ("behavior_vs_old", float(lk.max()) < thr,
            f"|log k| mean {float(lk.mean()):.2e}, p99 {p99:.2e}, max {float(lk.max()):.2e} (limit {thr:g})")


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


def _teacher_logprobs(teacher: torch.nn.Module, learner: PolicyLearner, batch: TrajectoryBatch,
                      cfg: RunConfig) -> torch.Tensor:
    """The frozen teacher's log-probs of ``batch`` as a distillation run computes them (the learner's
    temperature and truncation), 0 off the action mask."""
    from posttrain.learner.logprobs import token_logprobs

    with torch.no_grad():
        lp, _ = token_logprobs(teacher, batch.input_ids, batch.attention_mask, temperature=learner.temperature,
                               top_k=learner.top_k, top_p=learner.top_p, microbatch_tokens=cfg.optim.microbatch_tokens,
                               action_mask=batch.action_mask)
    out: torch.Tensor = lp * batch.action_mask.to(lp.dtype)
    return out


def run_rl_checks(cfg: RunConfig, prompts: int = 4) -> list[CheckResult]:
    """Run the five RL checks (module docstring) on ``cfg``; returns ``[(name, passed, detail)]``."""
    from posttrain.learner.checkpoint import quiet_hf_progress
    from posttrain.loop.builders import (
        build_engine,
        build_model,
        build_policy_learner,
        build_task,
        build_teacher,
    )
    from posttrain.loop.targets import build_targets
    from posttrain.trajectory import collate

    torch.manual_seed(cfg.seed)
    tok, model = build_model(cfg)
    task = build_task(cfg)
    learner = build_policy_learner(cfg, model)
    engine = build_engine(learner.model, tok)
    trajs = sample_trajectories(cfg, prompts, tok, model, task, engine)
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    old = learner.compute_logprobs(batch)
    distill = cfg.loss.distill  # on-policy distillation: the teacher's reverse-KL advantages, as the run trains
    with quiet_hf_progress():
        teacher = build_teacher(cfg, tok) if distill is not None else None
    adv = build_targets(batch, old_logprob=old, ref_logprob=None, values=None,
                        estimator=cfg.credit.estimator if not cfg.critic.enabled else "grpo",
                        estimator_kwargs=cfg.credit.kwargs if not cfg.critic.enabled else {},
                        teacher_logprob=None if teacher is None else _teacher_logprobs(teacher, learner, batch, cfg),
                        distill_coef=None if distill is None else distill.coef,
                        distill_only=distill is not None and distill.only).advantages
    if not bool((adv != 0).any()):  # all-equal rewards: use a fixed pattern so gradients are non-trivial
        adv = torch.linspace(-1, 1, batch.size, dtype=torch.float64)[:, None] * batch.action_mask
    results: list[CheckResult] = []
    mask = batch.action_mask > 0

    # 1. ratio = 1 at lr = 0
    frozen = build_policy_learner(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 0.0})}),
                           copy.deepcopy(learner.model))
    m = frozen.update(batch, adv, old_logprob=old)
    dev = max(abs(m["ratio_min"] - 1), abs(m["ratio_max"] - 1))
    clipped = m.get("clip_frac_low", 0.0) + m.get("clip_frac_high", 0.0)
    results.append(("ratio_is_one", dev < 1e-5 and clipped == 0.0,
                    f"max |ratio - 1| = {dev:.2e}, clipped fraction {clipped:.3f} (lr = 0)"))

    # 2. masked positions change -> same loss and gradient
    loss_a, g_a = learner.compute_gradients(batch, adv, old_logprob=old)
    junk = copy.copy(batch)
    noise = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    junk.behavior_logprob = torch.where(mask, batch.behavior_logprob, -50.0 + noise)
    junk.input_ids = torch.where(batch.attention_mask > 0, batch.input_ids, (batch.input_ids + 7) % 50)
    loss_b, g_b = learner.compute_gradients(junk, torch.where(mask, adv, 1e3 * noise),
                                            old_logprob=torch.where(mask, old, -30.0 + noise))
    rel = max_rel(g_a, g_b)
    results.append(("mask_invariance", abs(loss_a - loss_b) <= 1e-6 * max(1.0, abs(loss_a)) and rel < 1e-5,
                    f"|d loss| = {abs(loss_a - loss_b):.2e}, max rel |d grad| = {rel:.2e}"))

    # 3. behavior vs recomputed old log-probs
    results.append(check_behavior_vs_old(batch, old, cfg))

    # 4. micro-batch split invariance
    whole = build_policy_learner(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"microbatch_tokens": 10**9})}),
                          learner.model)
    one_row = build_policy_learner(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"microbatch_tokens": 1})}),
                            learner.model)
    la, ga = whole.compute_gradients(batch, adv, old_logprob=old)
    lb, gb = one_row.compute_gradients(batch, adv, old_logprob=old)
    rel = max_rel(ga, gb)
    results.append(("microbatch_split", rel < 1e-4 and abs(la - lb) <= 1e-5 * max(1.0, abs(la)),
                    f"1 row vs whole batch: |d loss| = {abs(la - lb):.2e}, max rel |d grad| = {rel:.2e}"))

    # 5. save / resume continuity
    results.append(check_save_resume(cfg, learner, tok, batch, old))
    return results


def run_checks(cfg: RunConfig, prompts: int = 4) -> list[CheckResult]:
    """The checks of ``cfg``'s trainer: ``rl`` (distillation included) the five RL checks of the module
    docstring; ``preference`` offline :func:`~posttrain.commands.check_preference.offline_checks` on
    ``prompts`` pairs, online
    :func:`~posttrain.commands.check_online_preference.online_preference_checks`; ``reward_model``
    :func:`~posttrain.commands.check_reward_model.reward_model_checks`."""
    if cfg.trainer == "reward_model":
        from posttrain.commands.check_reward_model import reward_model_checks

        return reward_model_checks(cfg, prompts)
    if cfg.trainer == "preference":
        if cfg.preference.online:
            from posttrain.commands.check_online_preference import online_preference_checks

            return online_preference_checks(cfg, prompts)
        from posttrain.commands.check_preference import offline_checks

        return offline_checks(cfg, prompts)
    return run_rl_checks(cfg, prompts)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from posttrain.loop.validate import load_run_config

    cfg = load_run_config(args.recipe, args.overrides)
    results = run_checks(cfg, prompts=args.prompts)
    t = Table(title=f"posttrain check: {cfg.name} on {cfg.model.path}")
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail")
    for name, ok, detail in results:
        t.add_row(name, "[yellow]n/a[/yellow]" if ok is None else "[green]pass[/green]" if ok else "[red]FAIL[/red]",
                  detail)
    Console().print(t)
    return 0 if all_passed(results) else 1
