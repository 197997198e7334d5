"""The synchronous audited RL iteration (one loop; the whole step reads top to bottom).

    snapshot -> rollout (G samples per prompt) -> validate statuses -> score
      -> freeze old / ref log-probs and targets -> update -> sync weights (version + 1)
      -> held-out eval every N steps -> promote / retain / reject the revision

Trajectories with ``infra_error`` are excluded from the update and counted. Every step writes
its trajectories and metrics to the Parquet ledger and ``metrics.jsonl``; checkpoints are
atomic and a run resumes exactly (see :mod:`posttrain.loop.run_state`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from posttrain.config import RunConfig
from posttrain.loop.guards import check_guards
from posttrain.loop.rollout_stage import RolloutStage
from posttrain.loop.run_state import RunState, open_run
from posttrain.loop.step_metrics import step_metrics
from posttrain.loop.targets import build_targets
from posttrain.trajectory import Status, collate, with_logprobs


def train(cfg: RunConfig, *, progress: Any = None) -> RunState:
    """Run ``cfg.steps`` synchronous RL steps (after optional SFT warm-up); returns the final state."""
    run = open_run(cfg)  # builds model/task/engine/learner, resumes if asked, writes config.yaml
    stage = RolloutStage.from_config(cfg, run)
    st = run.state
    if st.step == 0:
        run.warmup_and_baseline(progress)  # SFT (if configured) and the step-0 held-out eval
    task_bar = progress.add_task("RL", total=cfg.steps, completed=st.step) if progress else None
    while st.step < cfg.steps:
        step = st.step + 1
        t_step = time.perf_counter()
        # 1. rollout + 2. validate + 3. score (dynamic sampling oversamples inside the stage)
        trajs, rollout_info = stage.collect(step)
        usable = [t for t in trajs if t.status is not Status.INFRA_ERROR]
        metrics: dict[str, Any] = dict(rollout_info)
        if not usable:
            metrics["skipped"] = 1.0
            run.finish_step(step, trajs, metrics, t_step)
            continue
        # 4. freeze old / ref coordinates and targets
        t0 = time.perf_counter()
        batch = collate(usable, pad_token_id=run.pad_token_id)
        old = run.learner.compute_logprobs(batch)
        batch = collate(with_logprobs(batch, "old", old, run.learner.version), pad_token_id=run.pad_token_id)
        ref = None
        if run.ref_model is not None:
            ref = run.ref_logprobs(batch)
            batch = collate(with_logprobs(batch, "ref", ref, st.ref_version), pad_token_id=run.pad_token_id)
        values = final_values = None
        if run.critic is not None:
            values, final_values = run.critic.compute_values(batch)
        tg = build_targets(
            batch, old_logprob=old, ref_logprob=ref, values=values, final_values=final_values,
            estimator=cfg.credit.estimator, estimator_kwargs=cfg.credit.kwargs,
            kl_in_reward=cfg.credit.kl_in_reward, kl_estimator=cfg.loss.kl_estimator,
            kl_coef=run.kl_coef_value(),
        )
        # 5. update actor (and critic) under the recipe's reduction
        upd = run.learner.update(batch, tg.advantages, old_logprob=old)
        if run.critic is not None and tg.returns is not None:
            upd.update({f"critic/{k}": v for k, v in run.critic.update(batch, tg.returns, old_values=values).items()})
        metrics.update(upd)
        metrics["time/learner_s"] = time.perf_counter() - t0
        metrics.update(step_metrics(batch, trajs, tg))
        # 6. judge the revision; a NaN/inf loss is rejected and the promoted weights restored
        if not math.isfinite(float(upd.get("loss", 0.0))):
            run.reject(step, reason=f"non-finite loss {upd.get('loss')}")
            metrics["revision"] = "rejected"
        else:
            metrics["revision"] = "candidate"
        run.sync_weights()  # the engine gets the new weights with an incremented version
        run.observe_kl(metrics)
        # 7. held-out eval every N steps -> promote / retain / reject
        if step % cfg.eval.every == 0 or step == cfg.steps:
            metrics.update(run.evaluate_and_judge(step))
        stop_reason = check_guards(cfg.guards, metrics)
        ledger_trajs = list(batch.trajectories) + [t for t in trajs if t.status is Status.INFRA_ERROR]
        run.finish_step(step, ledger_trajs, metrics, t_step)
        if progress is not None:
            progress.update(task_bar, advance=1, description=(
                f"RL step {step} reward {metrics.get('reward/mean', float('nan')):.3f} "
                f"held-out {st.last_heldout_accuracy:.3f}"))
        if stop_reason:
            run.stop(stop_reason)
            break
    run.close()
    return st


__all__ = ["train", "torch"]
