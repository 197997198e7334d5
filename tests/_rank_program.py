"""The RL program over the learner primitives, shared by the tests that run it on learner ranks (spawned
processes: tests/learner/test_rank_primitives.py; Ray rank actors: tests/distributed/test_ray_rank_primitives.py)
and compare it with the one-command ``update``: the learner settings, the float64 micro model, a ragged batch
with reference log-probs, its advantages, and :func:`rl_program` (PolicyLearner.update's program written
against the Learner protocol's primitives)."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.algos.registry import CORRECTIONS
from posttrain.learner.actor import PolicyLearner
from posttrain.learner.optim_step import StepTally
from posttrain.learner.policy_loss import Correction, check_advantages, policy_tensors, update_metrics
from posttrain.learner.primitives import LossBatch, merge_metrics
from posttrain.models import build_tiny_model
from posttrain.trajectory import TrajectoryBatch, collate, make_trajectory

# 2 epochs x 2 mini-batches: 4 optimiser steps, 2 generator draws; KL, entropy and a correction all on.
KW: dict[str, Any] = dict(
    lr=1e-2, max_grad_norm=1.0, ppo_epochs=2, num_minibatches=2, seed=3, policy_loss="ppo_clip",
    kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01, correction="tis", correction_kwargs={"cap": 1.5},
    microbatch_tokens=20,
)
KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "kl", "entropy", "ratio_mean", "ratio_min", "ratio_max",
        "tokens_trained", "grad_norm", "grad_norm_max", "optimizer_steps", "lr", "clip_frac_low", "clip_frac_high")


def micro_model() -> torch.nn.Module:
    """The float64 ``micro`` preset, seed 0 (every learner of these tests starts here)."""
    return build_tiny_model("micro", seed=0).to(torch.float64)


def rl_batch(n: int = 11) -> TrajectoryBatch:
    """``n`` ragged single-turn rows (seeded), frozen with a seed-7 model's reference log-probs."""
    g = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(n):
        p, a = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(3, 106, (p + a,), generator=g).tolist()
        beh = (-torch.rand(a, generator=g, dtype=torch.float64) * 3 - 0.1).tolist()
        trajs.append(make_trajectory(traj_id=f"t{i}", prompt_id=f"p{i // 4}", group_id=f"g{i // 4}",
                                     prompt_ids=ids[:p], action_ids=ids[p:], action_logprobs=beh,
                                     action_versions=0, finish="terminal"))
    batch = collate(trajs, pad_token_id=0)
    ref = PolicyLearner(build_tiny_model("micro", seed=7).to(torch.float64), lr=0.0).compute_logprobs(batch)
    return batch.freeze("ref", ref, 0)


def rl_advantages(batch: TrajectoryBatch) -> torch.Tensor:
    """Seeded per-row advantages, broadcast over the action tokens of ``batch``."""
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch.size, generator=g, dtype=torch.float64)[:, None] * batch.action_mask.to(torch.float64)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rl_program(learner: Any, loss_source: PolicyLearner, batch: TrajectoryBatch, adv: torch.Tensor,
               old: torch.Tensor) -> dict[str, Any]:
    """PolicyLearner.update's program written against the Learner protocol's primitives (no fused pi_old):
    the policy tensors and loss built here, then minibatch_plan / forward_backward / optim_step on ``learner``."""
    t, _ = policy_tensors(batch, check_advantages(batch, adv), old, device=torch.device("cpu"), dtype=torch.float64,
                          correction=Correction(CORRECTIONS["tis"], loss_source.correction_kwargs),
                          version=learner.version)
    loss = loss_source.policy_loss()
    sums: dict[str, float] = {}
    steps, outs = StepTally(), []
    plan = learner.minibatch_plan(batch.size)
    for i, rows in enumerate(plan):
        out = learner.forward_backward(LossBatch(t, rows, loss.normaliser(t, rows)), loss)
        merge_metrics(sums, out.metrics)
        steps.record(learner.optim_step(ends_update=i == len(plan) - 1))
        outs.append(out)
    assert steps.lr is not None
    metrics = update_metrics(sums, steps, trained=len(plan), empty=0, lr=steps.lr, kl_coef=0.05,
                             version=learner.version)
    return {"plan": plan, "outs": outs, "metrics": metrics, "weights": weights_of(learner.model),
            "last": (LossBatch(t, plan[-1], loss.normaliser(t, plan[-1])), loss)}


__all__ = ["KEYS", "KW", "micro_model", "rl_advantages", "rl_batch", "rl_program", "weights_of"]
