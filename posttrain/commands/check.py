"""``posttrain check RECIPE [key=value ...]``: the rollout-to-update invariants checked on the user's own setup.

On the configured model, engine and recipe (a few prompts, no training) it checks:

1. ``ratio_is_one``: with ``lr = 0`` (pi_theta = pi_old) every action token's ratio is 1 and no
   token is clipped; "1" up to the rounding of two forwards of different batch shapes, the
   length- and dtype-aware rule of :mod:`posttrain.diagnostics.tolerance` (:func:`ratio_is_one`);
2. ``mask_invariance``: loss and gradient are unchanged when log-probs, advantages and token ids
   change only at positions the action mask excludes;
3. ``behavior_vs_old``: |log kappa| = |log mu - log pi_old| over action tokens (mean, p99, max)
   against ``guards.max_abs_log_kappa``;
4. ``microbatch_split``: gradients with one row per micro-batch equal the whole-batch gradients;
5. ``save_resume``: a checkpoint round trip keeps the log-probs, versions and data cursor.

With ``env.name`` set the trajectories are multi-turn episodes played as in training, so checks
1-4 also cover the observation tokens between turns (never in a ratio, a loss or a gradient). With
``loss.distill`` the advantages are the teacher's reverse-KL ones the run trains on. With ``loss.kl_estimator`` the
batch carries pi_ref's log-probs as a run's first step has them (the starting policy's), so the KL term (in the loss,
or in the reward with ``credit.kl_in_reward``) is part of every check.

The list depends on the recipe's ``trainer`` (:func:`run_checks`, through its registry entry's ``checks``):
``preference`` (offline) and ``reward_model`` run their own checks on a few pairs of ``preference.data``
(:mod:`posttrain.commands.check_preference`, :mod:`posttrain.commands.check_reward_model`); online
``preference`` runs checks 3 and 5 on the sampled groups and the preference checks on pairs built from
them (:mod:`posttrain.commands.check_online_preference`).

Prints a pass / FAIL / n/a table (n/a: the check does not apply, the detail says why); exit code 1 when
any check fails.
"""

from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING, Any

import torch

from posttrain.commands.check_result import CheckResult, all_passed, max_rel
from posttrain.commands.check_rollout import check_behavior_vs_old, check_save_resume, sample_trajectories
from posttrain.diagnostics.tolerance import compute_dtype, shape_rtol

if TYPE_CHECKING:
    from collections.abc import Callable

    from posttrain.config import RunConfig
    from posttrain.learner.actor import PolicyLearner
    from posttrain.trajectory import TrajectoryBatch


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="run the verification list of the recipe's trainer (ratio=1, masking, |log k|, "
                                     "splits, resume; preference / reward-model checks)")
    p.add_argument("recipe", nargs="?", default="grpo", help="recipe YAML path or shipped name (default grpo)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--prompts", type=int, default=4, help="prompts to sample (x group size); preference and "
                   "reward-model recipes: pairs to check")
    p.set_defaults(func=run)


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


def ratio_is_one(ratio_min: float, ratio_max: float, clipped: float, tokens: int,
                 dtype: torch.dtype) -> CheckResult:
    """Check 1 from an ``lr = 0`` update's ratio range and clipped fraction: passes when no token is clipped
    and ``max |ratio - 1| <= shape_rtol(tokens, compute_dtype(dtype))`` — the rounding two forwards of
    different batch shapes may differ by over ``tokens`` (the padded length) in a model of parameter dtype
    ``dtype`` (:mod:`posttrain.diagnostics.tolerance`). A 128-token float32 batch gets ``6.1e-5``: its
    measured ``1.1e-5`` passes, a ratio off by ``1e-3`` (log-probs of another temperature or mask) fails."""
    dev = max(abs(ratio_min - 1), abs(ratio_max - 1))
    limit = shape_rtol(tokens, compute_dtype(dtype))
    return ("ratio_is_one", dev <= limit and clipped == 0.0,
            f"max |ratio - 1| = {dev:.2e} (limit {limit:.1e}: {tokens} tokens, {str(dtype).removeprefix('torch.')}), "
            f"clipped fraction {clipped:.3f} (lr = 0)")


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

    rows, per, mbs = prompts * cfg.sampling.group_size, cfg.sampling.group_size, cfg.optim.num_minibatches
    if rows < mbs:  # refused before the model loads, naming the flag that fixes it
        raise ValueError(f"check: --prompts {prompts} x sampling.group_size {per} = {rows} rows, fewer than "
                         f"optim.num_minibatches={mbs}; pass --prompts {-(-mbs // per)} or more")
    torch.manual_seed(cfg.seed)
    tok, model = build_model(cfg)
    task = build_task(cfg)
    learner = build_policy_learner(cfg, model)
    from posttrain.rollout.precision import engine_copy

    # sampled at the recipe's rollout.precision (builtin engine), so behavior_vs_old reports that choice's mismatch
    engine = build_engine(engine_copy(learner.model, cfg.rollout.builtin_precision()), tok)
    trajs = sample_trajectories(cfg, prompts, tok, model, task, engine)
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    old = learner.compute_logprobs(batch)
    if cfg.loss.kl_estimator is not None:  # a run's pi_ref is its starting policy (loop/parts.py), version 0
        batch = batch.freeze("ref", old, 0)  # equal to pi_old at the first step
    distill = cfg.loss.distill  # on-policy distillation: the teacher's reverse-KL advantages, as the run trains
    with quiet_hf_progress():
        teacher = build_teacher(cfg, tok) if distill is not None else None
    adv = build_targets(batch, old_logprob=old, ref_logprob=batch.ref_logprob, values=None,
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
    m = frozen.update(batch, adv, old_logprob=old).metrics
    results.append(ratio_is_one(m["ratio_min"], m["ratio_max"], m.get("clip_frac_low", 0.0) + m.get("clip_frac_high", 0.0),
                                tokens=batch.input_ids.shape[1], dtype=next(learner.model.parameters()).dtype))

    # 2. masked positions change -> same loss and gradient
    loss_a, g_a = learner.compute_gradients(batch, adv, old_logprob=old)
    junk = copy.copy(batch)
    noise = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    junk.behavior_logprob = torch.where(mask, batch.behavior_logprob, -50.0 + noise)
    if batch.ref_logprob is not None:
        junk.ref_logprob = torch.where(mask, batch.ref_logprob, -40.0 + noise)
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


def preference_checks(cfg: RunConfig, prompts: int = 4) -> list[CheckResult]:
    """``trainer: preference``'s checks: offline :func:`~posttrain.commands.check_preference.offline_checks` on
    ``prompts`` pairs, online :func:`~posttrain.commands.check_online_preference.online_preference_checks`."""
    if cfg.preference.online:
        from posttrain.commands.check_online_preference import online_preference_checks

        return online_preference_checks(cfg, prompts)
    from posttrain.commands.check_preference import offline_checks

    return offline_checks(cfg, prompts)


def run_checks(cfg: RunConfig, prompts: int = 4) -> list[CheckResult]:
    """The checks of ``cfg``'s trainer: the function its registry entry names
    (:attr:`~posttrain.config.trainers.TrainerEntry.checks`, ``(cfg, prompts) -> list[CheckResult]``): ``rl``
    (distillation included) the five RL checks of the module docstring (:func:`run_rl_checks`), ``preference``
    :func:`preference_checks`, ``reward_model``
    :func:`~posttrain.commands.check_reward_model.reward_model_checks`. A trainer whose entry names none yet
    gets one ``n/a`` row saying so."""
    from posttrain.config.trainers import trainer_entry
    from posttrain.dotted import import_dotted

    entry = trainer_entry(cfg.trainer)
    if entry.checks is None:
        return [("checks", None, f"trainer={entry.name} has no posttrain check yet (posttrain train checks its "
                 "inputs before the run directory is written)")]
    checks: Callable[[RunConfig, int], list[CheckResult]] = import_dotted(
        entry.checks, what=f"trainer {entry.name!r} checks", shape="package.module:function")
    return checks(cfg, prompts)


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
