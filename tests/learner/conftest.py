"""Shared builders for the learner tests: tiny float64 models and ragged rollout batches.

Exposed as fixtures that return the builder functions (test modules are imported with
``--import-mode=importlib``, so they cannot import a helper module by name)."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import build_tiny_model
from posttrain.trajectory import TrajectoryBatch, collate, make_trajectory


def micro_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """The ``micro`` preset (~0.1M params), float64 by default so equalities can be tight."""
    return build_tiny_model("micro", seed=seed).to(dtype)


def ragged_batch(n: int = 16, seed: int = 1, max_prompt: int = 6, max_actions: int = 9) -> TrajectoryBatch:
    """``n`` single-turn rows with random prompt (2..max_prompt-1) and action (1..max_actions-1)
    lengths; behavior log-probs are arbitrary negative numbers (not the model's)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        P = int(torch.randint(2, max_prompt, (1,), generator=g))
        A = int(torch.randint(1, max_actions, (1,), generator=g))
        ids = torch.randint(3, 106, (P + A,), generator=g).tolist()
        beh = (-torch.rand(A, generator=g, dtype=torch.float64) * 3 - 0.1).tolist()
        trajs.append(
            make_trajectory(
                traj_id=f"t{i}",
                prompt_id=f"p{i // 4}",
                group_id=f"g{i // 4}",
                prompt_ids=ids[:P],
                action_ids=ids[P:],
                action_logprobs=beh,
                action_versions=0,
                finish="terminal",
            )
        )
    return collate(trajs, pad_token_id=0)


def seq_advantages(batch: TrajectoryBatch, seed: int = 2) -> torch.Tensor:
    """Random per-row advantages broadcast over each row's action tokens: ``[B, T]`` float64."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch.size, generator=g, dtype=torch.float64)
    return a[:, None] * batch.action_mask.to(torch.float64)


@pytest.fixture(scope="session")
def make_model():
    """Fixture: :func:`micro_model`."""
    return micro_model


@pytest.fixture(scope="session")
def make_batch():
    """Fixture: :func:`ragged_batch`."""
    return ragged_batch


@pytest.fixture(scope="session")
def make_advantages():
    """Fixture: :func:`seq_advantages`."""
    return seq_advantages
