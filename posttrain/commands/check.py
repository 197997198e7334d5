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
1-4 also cover the observation tokens between turns (never in a ratio, a loss or a gradient).

Prints a pass/fail table; exit code 1 when any check fails.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.envs.task import Task
    from posttrain.rewards.scoring import Decoder
    from posttrain.rollout.engine import RolloutEngine
    from posttrain.trajectory import Trajectory


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="run the verification list (ratio=1, masking, |log k|, splits, resume)")
    p.add_argument("recipe", nargs="?", default="grpo", help="recipe YAML path or shipped name (default grpo)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--prompts", type=int, default=4, help="prompts to sample (x group size)")
    p.set_defaults(func=run)


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = max(float((a[k] - b[k]).abs().max()) for k in a)
    den = max(float(a[k].abs().max()) for k in a) or 1.0
    return num / den


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


def run_checks(cfg: RunConfig, prompts: int = 4) -> list[tuple[str, bool, str]]:
    """Run the five checks on ``cfg``; returns ``[(name, passed, detail)]``."""
    from posttrain.envs.task import check_prompts, task_rows
    from posttrain.learner.checkpoint import load_checkpoint, restore_actor, save_checkpoint
    from posttrain.loop.builders import (
        build_engine,
        build_model,
        build_policy_learner,
        build_renderer,
        build_task,
    )
    from posttrain.loop.single_turn import play_once
    from posttrain.loop.targets import build_targets
    from posttrain.rewards.scoring import ScoringSpec
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.trajectory import Status, collate

    torch.manual_seed(cfg.seed)
    tok, model = build_model(cfg)
    renderer = build_renderer(cfg, tok)
    task = build_task(cfg)
    learner = build_policy_learner(cfg, model)
    engine = build_engine(learner.model, tok)
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
                           renderer=renderer, verifier=task.verifier, tokenizer=tok)
        trajs = played.trajectories(verifier=task.verifier, spec=ScoringSpec(
            cfg.reward.weights, cfg.reward.overlong_max_len, cfg.reward.overlong_cache_len))
    trajs = [t for t in trajs if t.status not in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    if not trajs:
        raise ValueError(f"check: none of the {prompts} sampled prompts gave a usable trajectory (all infra_error / "
                         "env_failure); nothing to check")
    batch = collate(trajs, pad_token_id=int(tok.pad_token_id or 0))
    old = learner.compute_logprobs(batch)
    adv = build_targets(batch, old_logprob=old, ref_logprob=None, values=None,
                        estimator=cfg.credit.estimator if not cfg.critic.enabled else "grpo",
                        estimator_kwargs=cfg.credit.kwargs if not cfg.critic.enabled else {}).advantages
    if not bool((adv != 0).any()):  # all-equal rewards: use a fixed pattern so gradients are non-trivial
        adv = torch.linspace(-1, 1, batch.size, dtype=torch.float64)[:, None] * batch.action_mask
    results: list[tuple[str, bool, str]] = []
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
    rel = _max_rel(g_a, g_b)
    results.append(("mask_invariance", abs(loss_a - loss_b) <= 1e-6 * max(1.0, abs(loss_a)) and rel < 1e-5,
                    f"|d loss| = {abs(loss_a - loss_b):.2e}, max rel |d grad| = {rel:.2e}"))

    # 3. behavior vs recomputed old log-probs
    lk = (batch.behavior_logprob - old).abs()[mask]
    p99 = float(torch.quantile(lk, 0.99)) if lk.numel() else 0.0
    thr = cfg.guards.max_abs_log_kappa
    results.append(("behavior_vs_old", float(lk.max()) < thr,
                    f"|log k| mean {float(lk.mean()):.2e}, p99 {p99:.2e}, max {float(lk.max()):.2e} (limit {thr:g})"))

    # 4. micro-batch split invariance
    whole = build_policy_learner(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"microbatch_tokens": 10**9})}),
                          learner.model)
    one_row = build_policy_learner(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"microbatch_tokens": 1})}),
                            learner.model)
    la, ga = whole.compute_gradients(batch, adv, old_logprob=old)
    lb, gb = one_row.compute_gradients(batch, adv, old_logprob=old)
    rel = _max_rel(ga, gb)
    results.append(("microbatch_split", rel < 1e-4 and abs(la - lb) <= 1e-5 * max(1.0, abs(la)),
                    f"1 row vs whole batch: |d loss| = {abs(la - lb):.2e}, max rel |d grad| = {rel:.2e}"))

    # 5. save / resume continuity
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
    results.append(("save_resume", dlp == 0.0 and same_extra,
                    f"max |d logprob| after reload {dlp:.2e}; cursor/versions restored: {same_extra}"))
    return results


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
        t.add_row(name, "[green]pass[/green]" if ok else "[red]FAIL[/red]", detail)
    Console().print(t)
    return 0 if all(ok for _, ok, _ in results) else 1
