"""The training loop on the Ray backend: same calls, same samples as the local backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _micro_run import MICRO_RUN  # noqa: E402
from _tolerance import shape_rtol  # noqa: E402

SMALL = [
    *MICRO_RUN,
    "eval.size=8",
    "eval.every=100",
    "steps=2",
]
# Joins the session's cluster (ray_env); small reservations so both fit into its 2 logical CPUs.
RAY = [
    "system.backend=ray",
    "system.ray.num_rollout_workers=1",
    "system.ray.num_reward_workers=1",
    "system.ray.cpus_per_rollout_worker=0.1",
    "system.ray.cpus_per_reward_worker=0.1",
    "system.ray.startup_timeout_s=90",
]


def _ledger_rows(run_dir):
    return {t.traj_id: (step, t) for step, t in Ledger(run_dir / "ledger").iter_trajectories()}


def _same_samples(local_dir, ray_dir, n):
    """``n`` trajectories in each run, the same ids at the same steps, identical tokens, versions and
    statuses; yields ``(step, local, ray)`` for the caller's own checks."""
    a, b = _ledger_rows(local_dir), _ledger_rows(ray_dir)
    assert len(a) == n and a.keys() == b.keys()
    for k in a:
        (sa, ta), (sb, tb) = a[k], b[k]
        assert sa == sb
        np.testing.assert_array_equal(ta.token_ids, tb.token_ids)
        np.testing.assert_array_equal(ta.behavior_version, tb.behavior_version)
        assert ta.status == tb.status
        yield sb, ta, tb


@pytest.mark.timeout(400)
def test_sync_run_on_ray_equals_the_local_run(ray_env, tmp_path):
    local = train(load_run_config("grpo", [*SMALL, f"run_dir={tmp_path / 'local'}"]))
    remote = train(load_run_config("grpo", [*SMALL, *RAY, f"run_dir={tmp_path / 'ray'}"]))
    for sb, ta, tb in _same_samples(tmp_path / "local", tmp_path / "ray", 2 * 4 * 4):
        # Ray workers batch other rows together (another GEMM shape): float32 rounding over the micro
        # model's longest reduction (64), scaled by |log-prob| <= 10.
        np.testing.assert_allclose(ta.behavior_logprob, tb.behavior_logprob, rtol=0, atol=shape_rtol(64) * 10)
        assert ta.reward.total == tb.reward.total
        # Step s was sampled by the weights the Ray worker received after step s - 1 (version s - 1).
        assert set(tb.behavior_version[tb.action_mask.astype(bool)].tolist()) == {sb - 1}
    assert local.step == remote.step == 2
    # where the workers run, in the first step's metrics only (one node here: index 0 for every worker)
    def placement(run: str) -> list[dict[str, float]]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k.startswith("placement/")} for r in rows if "loss" in r]

    assert placement("ray") == [{"placement/nodes": 1.0, "placement/rollout/nodes": 1.0, "placement/rollout/0": 0.0,
                                 "placement/reward/nodes": 1.0, "placement/reward/0": 0.0}, {}]
    assert placement("local") == [{}, {}]


@pytest.mark.timeout(400)
def test_async_run_on_ray_trains_and_records_versions(ray_env, tmp_path):
    st = train(load_run_config("grpo", [*SMALL, *RAY, "system.mode=async", f"run_dir={tmp_path}"]))
    assert st.step == 2
    rows = _ledger_rows(tmp_path)
    assert len(rows) == 2 * 4 * 4
    for _, t in rows.values():
        acted = t.behavior_version[t.action_mask.astype(bool)]
        assert (acted >= 0).all() and (acted <= 1).all()


EPISODES = ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none", "env.max_turns=2",
            "env.max_tokens=120", "env.stop_strings=['e', 'o']", "sampling.prompts_per_step=2",
            "sampling.group_size=2", "sampling.max_new_tokens=12", "eval.size=2", "eval.every=100",
            "logging.progress=false", "guards.max_truncation_rate=1.0", "steps=2", "seed=3"]


@pytest.mark.timeout(400)
def test_multi_turn_episodes_on_ray_equal_the_local_run(ray_env, tmp_path):
    """Episodes on the Ray backend: the workers generate each turn, the driver steps the environments;
    same episodes (tokens, roles, versions) as the local backend."""
    train(load_run_config(None, [*EPISODES, f"run_dir={tmp_path / 'local'}"]))
    st = train(load_run_config(None, [*EPISODES, *(o for o in RAY if "reward_worker" not in o),
                                      f"run_dir={tmp_path / 'ray'}"]))
    assert st.step == 2
    for _, ta, tb in _same_samples(tmp_path / "local", tmp_path / "ray", 2 * 2 * 2):
        assert ta.roles == tb.roles
