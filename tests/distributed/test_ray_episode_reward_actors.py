"""Episodes on the Ray backend start no reward actor: the environment scores its own episodes (learned rewards
are scored in the driver), so an actor would sit idle holding its CPU reservation. Before, the default
``system.ray.num_reward_workers=1`` started one anyway (its placement was reported in the first step's
metrics: ``placement/reward/*``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _micro_run import MICRO_RUN  # noqa: E402

EPISODES = ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none", "env.max_turns=2",
            "env.max_tokens=120", "env.stop_strings=['e', 'o']", "sampling.prompts_per_step=2",
            "sampling.group_size=2", "sampling.max_new_tokens=12", "eval.size=2", "eval.every=100",
            "logging.progress=false", "guards.max_truncation_rate=1.0", "steps=1", "seed=3"]
# Joins the session's cluster (ray_env); the default num_reward_workers=1 is left as it is.
RAY = ["system.backend=ray", "system.ray.num_rollout_workers=1", "system.ray.cpus_per_rollout_worker=0.1",
       "system.ray.startup_timeout_s=90"]


def _placement(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {k: v for r in rows if "loss" in r for k, v in r.items() if k.startswith("placement/")}


@pytest.mark.timeout(400)
def test_episodes_on_ray_start_no_reward_actor(ray_env, tmp_path: Path) -> None:
    st = train(load_run_config(None, [*EPISODES, *RAY, f"run_dir={tmp_path / 'episodes'}"]))
    assert st.step == 1
    placed = _placement(tmp_path / "episodes")
    assert placed["placement/rollout/nodes"] == 1.0  # the rollout worker was placed and reported
    assert not [k for k in placed if k.startswith("placement/reward")], placed
    # single-turn samples still get theirs (they verify through it)
    train(load_run_config("grpo", [*MICRO_RUN, *RAY, "system.ray.cpus_per_reward_worker=0.1", "steps=1",
                                   "eval.size=4", "eval.every=100", f"run_dir={tmp_path / 'single'}"]))
    assert _placement(tmp_path / "single")["placement/reward/nodes"] == 1.0


def test_a_reward_actor_cpu_setting_with_episodes_is_refused_since_no_actor_starts() -> None:
    with pytest.raises(ConfigError, match=r"system\.ray\.cpus_per_reward_worker=0\.5.*no Ray reward actor"):
        load_run_config(None, [*EPISODES, *RAY, "system.ray.cpus_per_reward_worker=0.5"])
