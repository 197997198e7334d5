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


def rl_metrics(n_steps: int, *, eval_every: int = 5, entropy_collapse_at: int | None = None,
               heldout_sets: Sequence[str] = ("heldout", "heldout_sampled"), heldout_gain: float = 0.3
               ) -> list[dict[str, Any]]:
    """``metrics.jsonl`` rows of an RL run: step 0 (held-out only), then steps 1..n_steps with the keys the
    loop logs (reward, entropy, KL, clip, ratio, |log kappa|, length, lag, tokens, time split) and held-out
    accuracy of each of ``heldout_sets`` (0.3 rising by ``heldout_gain`` over the run, 0.1 less per later set)
    every ``eval_every`` steps. Smooth, hand-chosen curves; with ``entropy_collapse_at`` the entropy drops
    from ~1.0 to 0.05 from that step on."""
    first = {f"{h}/accuracy": 0.3 for h in heldout_sets}
    rows: list[dict[str, Any]] = [{"step": 0, **first, "revision": "promoted"}]
    for s in range(1, n_steps + 1):
        collapsed = entropy_collapse_at is not None and s >= entropy_collapse_at
        ent = 0.05 if collapsed else 1.0 - 0.1 * s / n_steps
        m: dict[str, Any] = {
            "step": s, "reward/mean": 0.3 + 0.4 * s / n_steps, "train/accuracy": 0.25 + 0.4 * s / n_steps,
            "loss": 0.01 * (1 + s % 3), "pg_loss": 0.01, "grad_norm": 1.0 + 0.1 * (s % 5), "entropy": ent,
            "kl": 0.001 * s, "kl_coef": 0.02, "clip_frac_low": 0.01, "clip_frac_high": 0.02 + 0.001 * (s % 4),
            "ratio_mean": 1.0, "ratio_min": 0.9, "ratio_max": 1.1,
            "logkappa_abs_mean": 1e-7, "logkappa/p99": 6e-7,
            "length/mean": 10.0 + 0.01 * s, "length/p95": 14.0, "finish/truncated_rate": 0.0,
            "lag/mean": 0.0, "staleness/accepted_token_frac": 1.0, "tokens/generated": 640.0,
            "time/rollout_s": 1.0, "time/learner_s": 0.5, "time/weight_sync_s": 0.01, "time/step_s": 1.6,
            "adv/zero_group_frac": 0.1, "revision": "candidate",
        }
        if s % eval_every == 0:
            m.update({f"{h}/accuracy": 0.3 + heldout_gain * s / n_steps - 0.1 * i * s / n_steps
                      for i, h in enumerate(heldout_sets)}, revision="promoted", **{"time/eval_s": 0.2})
        rows.append(m)
    return rows


def write_outcomes(root: Path, rows: Sequence[dict[str, Any]], n_problems: int = 50) -> Path:
    """``heldout_outcomes.jsonl`` matching each ``<set>/accuracy`` of ``rows`` (greedy: one sample each)."""
    lines = []
    for m in rows:
        for k, v in m.items():
            if k.endswith("/accuracy") and k.startswith("heldout"):
                n_ok = round(v * n_problems)
                lines.append(json.dumps({
                    "step": m["step"], "set": k.split("/")[0], "accuracy": n_ok / n_problems,
                    "prompt_ids": [f"p{i}" for i in range(n_problems)], "valid": [1] * n_problems,
                    "correct": [1] * n_ok + [0] * (n_problems - n_ok)}))
    path = root / "heldout_outcomes.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_big_ledger(root: Path, steps: int, per_step: int, group_size: int = 8, tokens: int = 4) -> Path:
    """A run whose ledger holds ``steps`` steps of ``per_step`` trajectories (groups of ``group_size``, two
    prompt tokens then ``tokens - 2`` action tokens each), written column-wise with pyarrow in the ledger's
    schema (the row-wise writer would take minutes for 100k rows). Rewards alternate 1, 0 within a group
    (status correct / wrong); the advantage column is stored (+1 / -1 on action tokens)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from posttrain.trajectory.ledger import TRAJECTORY_SCHEMA

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    traj_dir = root / "ledger" / "trajectories"
    traj_dir.mkdir(parents=True, exist_ok=True)
    n, idx = per_step, np.arange(per_step)
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * tokens)
    mask = np.tile(np.array([0, 0] + [1] * (tokens - 2), dtype=np.int8), n)
    ok = idx % 2 == 0
    sign = np.where(ok, 1.0, -1.0)

    def lists(values: np.ndarray, typ: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(values, type=typ))

    for step in range(1, steps + 1):
        ids = [f"s{step}-t{i}" for i in range(n)]
        gids = [f"s{step}-g{i // group_size}" for i in range(n)]
        cols: dict[str, pa.Array] = {
            "traj_id": pa.array(ids), "prompt_id": pa.array([f"p{i // group_size}" for i in range(n)]),
            "group_id": pa.array(gids),
            "token_ids": lists(np.tile(np.arange(1, tokens + 1), n), pa.int64()),
            "roles": lists(np.tile(np.array(["prompt", "prompt"] + ["action"] * (tokens - 2)), n),
                           pa.string()).cast(TRAJECTORY_SCHEMA.field("roles").type),
            "action_mask": lists(mask, pa.int8()),
            "behavior_logprob": lists(-mask.astype(np.float64), pa.float64()),
            "behavior_version": lists(np.where(mask == 1, step, -1), pa.int64()),
            "finish": pa.array(["terminal"] * n), "status": pa.array(np.where(ok, "correct", "wrong")),
            "reward_total": pa.array(ok.astype(np.float64)), "verifier": pa.array(["integer@1"] * n),
            "policy_lag": pa.array(idx % 3), "meta": pa.array(["{}"] * n),
            "num_actions": pa.array(np.full(n, tokens - 2)), "version_span": pa.array(np.zeros(n, dtype=np.int64)),
            "advantage": lists(np.repeat(sign, tokens) * mask, pa.float64()),
        }
        table = pa.table({f.name: cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in TRAJECTORY_SCHEMA},
                         schema=TRAJECTORY_SCHEMA)
        pq.write_table(table, traj_dir / f"step_{step:06d}.parquet")
    return root
