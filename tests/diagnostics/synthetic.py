"""A tiny synthetic run directory written with the ledger's own writer (hand-chosen numbers)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from posttrain.trajectory import Ledger, Reward, Status, Trajectory

CONFIG: dict[str, Any] = {
    "name": "synthetic", "seed": 0, "steps": 2, "run_dir": None,
    "model": {"path": "builtin:tiny", "init_seed": 0, "dtype": "float32"},
    "task": {"name": "arithmetic", "kwargs": {"digits": 1}},
    "eval": {"size": 8, "max_new_tokens": None, "temperature": 0.0},
    "sampling": {"group_size": 2, "temperature": 1.0},
    "optim": {"lr": 0.001},
}


def traj(tid: str, group: str, status: str, reward: float | None, behavior: Sequence[float],
         old: Sequence[float] | None, *, lag: int = 0, response: str = "7", reference: str = "7",
         verifier: str = "integer@1") -> Trajectory:
    """Two prompt tokens (ids 1, 2) then one action token (id 10+i) per behaviour log-prob."""
    n = len(behavior)
    roles = ["prompt", "prompt"] + ["action"] * n
    return Trajectory(
        traj_id=tid, prompt_id=group, group_id=group, token_ids=[1, 2, *range(10, 10 + n)], roles=roles,
        action_mask=[0, 0] + [1] * n, behavior_logprob=[0.0, 0.0, *behavior], behavior_version=[-1, -1] + [1] * n,
        old_logprob=None if old is None else [0.0, 0.0, *old], old_version=None if old is None else 1,
        finish="terminal", status=Status(status),
        reward=Reward({"task": reward} if reward is not None else {}, {"task": 1.0}, reward),
        verifier=verifier, policy_lag=lag, meta={"response": response, "reference": reference},
    )


def step1() -> list[Trajectory]:
    """Group g1: one correct (reward 1), one wrong (reward 0); group g2: both wrong."""
    return [
        traj("a", "g1", "correct", 1.0, [-0.5, -1.0], [-0.5, -1.25]),  # |log kappa| = 0, 0.25 -> mean 0.125
        traj("b", "g1", "wrong", 0.0, [-2.0], [-2.0005], lag=1, response="8"),  # mean 5e-4
        traj("c", "g2", "wrong", 0.0, [-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.02], lag=3),  # mean 0.005
        traj("d", "g2", "wrong", 0.0, [-1.0, -1.0, -1.0], None, response="x"),
    ]


def write_run(root: Path, metrics: Sequence[dict[str, Any]] | None = None, config: dict[str, Any] | None = None,
              trajectories: dict[int, list[Trajectory]] | None = None) -> Path:
    """Write config.yaml, metrics.jsonl and a ledger under ``root``; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config or CONFIG))
    led = Ledger(root / "ledger")
    for step, trajs in (trajectories if trajectories is not None else {1: step1()}).items():
        led.write_trajectories(step, trajs)
    rows = metrics if metrics is not None else [
        {"step": 0, "heldout/accuracy": 0.5},
        {"step": 1, "reward/mean": 0.25, "loss": 0.0, "tokens/generated": 10.0, "time/step_s": 2.0,
         "heldout/accuracy": 0.5},
    ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    return root
