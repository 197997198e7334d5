"""Freeze old coordinates and build targets: pi_old / pi_ref log-probs, values, advantages.

Runs after scoring and before the update. The reward of a sequence enters the estimator once
(``rewards [B]`` for sequence-level estimators, or placed on the last action token for
token-level ones); it is never copied to every token and then summed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import posttrain.algos as A
from posttrain.algos.advantages import AdvantageInputs
from posttrain.trajectory import Finish, TrajectoryBatch

TOKEN_LEVEL_ESTIMATORS = frozenset({"gae", "reinforce_pp", "reinforce_pp_baseline"})


@dataclasses.dataclass
class Targets:
    """Everything the update consumes, aligned to the batch (``[B, T]`` unless noted)."""

    old_logprob: torch.Tensor
    ref_logprob: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    values: torch.Tensor | None
    rewards: torch.Tensor  # [B]
    token_kl: torch.Tensor | None


def group_index(batch: TrajectoryBatch) -> torch.Tensor:
    """``[B]`` long group ids (rows of one prompt's G samples share an id)."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(t.group_id, len(ids)) for t in batch.trajectories], dtype=torch.long)


def build_targets(
    batch: TrajectoryBatch,
    *,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor | None,
    values: torch.Tensor | None,
    final_values: torch.Tensor | None = None,
    estimator: str = "grpo",
    estimator_kwargs: dict[str, Any] | None = None,
    kl_in_reward: bool = False,
    kl_estimator: str | None = None,
    kl_coef: float = 0.0,
) -> Targets:
    """Compute advantages (and returns) with the registered ``estimator``."""
    mask = batch.action_mask.to(torch.float64)
    rewards = torch.tensor([float(t.reward.total) for t in batch.trajectories], dtype=torch.float64)  # type: ignore[arg-type]
    token_kl = None
    if ref_logprob is not None and kl_estimator is not None:
        token_kl = A.KL_ESTIMATORS[kl_estimator](old_logprob.to(torch.float64), ref_logprob.to(torch.float64)) * mask
    # The sequence reward enters once: the estimators place ``rewards`` on the last action token
    # themselves; ``token_rewards`` carries only the per-token KL penalty (KL in the reward).
    token_rewards = None
    if kl_in_reward and token_kl is not None:
        if estimator not in TOKEN_LEVEL_ESTIMATORS:
            raise ValueError(f"credit.kl_in_reward needs a token-level estimator ({', '.join(sorted(TOKEN_LEVEL_ESTIMATORS))})")
        token_rewards = -kl_coef * token_kl
    terminal = torch.tensor([t.finish is Finish.TERMINAL for t in batch.trajectories])
    inputs = AdvantageInputs(
        action_mask=mask,
        rewards=rewards,
        token_rewards=token_rewards,
        group_index=group_index(batch),
        values=None if values is None else values.to(torch.float64),
        terminal=terminal,
        # A truncated row bootstraps from the critic's value of the state after its last token.
        bootstrap_value=None if final_values is None else final_values.to(torch.float64),
    )
    out = A.ADVANTAGES[estimator](inputs, **(estimator_kwargs or {}))
    return Targets(
        old_logprob=old_logprob,
        ref_logprob=ref_logprob,
        advantages=out.advantages,
        returns=out.returns,
        values=values,
        rewards=rewards,
        token_kl=token_kl,
    )
