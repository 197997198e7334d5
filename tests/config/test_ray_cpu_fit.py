"""The Ray bundles' logical CPUs against a local cluster's, checked at load (no cluster is started).

Hand-computed sums: defaults 2 rollout x 0.5 + 1 reward x 0.25 + N learners x 0.25.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import posttrain.config.ray as ray_config
from posttrain.cli import main
from posttrain.config.ray import RayBackendConfig
from posttrain.errors import ConfigError
from posttrain.loop.validate import load_run_config
from tests._cli_errors import one_error_line

README = ["system.backend=ray", "learner.strategy=fsdp2", "learner.world_size=2", "steps=2"]


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray would detect 2 CPUs here, whatever this machine has."""
    monkeypatch.setattr(ray_config, "ray_detected_cpus", lambda: 2.0, raising=False)


def test_cpu_demand_is_the_sum_of_the_bundles() -> None:
    cfg = RayBackendConfig()
    assert cfg.cpu_demand(reward_workers=1, learner_ranks=2) == 2 * 0.5 + 0.25 + 2 * 0.25 == 1.75
    assert cfg.cpu_demand(reward_workers=0, learner_ranks=0) == 1.0


def test_the_readme_example_shape_fits_two_cpus_by_default(two_cpus: None) -> None:
    cfg = load_run_config("grpo", README)  # 1.75 <= 2
    assert cfg.system.ray.cpus_per_learner == 0.25


def test_more_bundles_than_cpus_are_refused_at_load_in_one_line_naming_the_keys(two_cpus: None) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config("grpo", [*README[:2], "learner.world_size=4"])  # 1.0 + 0.25 + 4 x 0.25 = 2.25 > 2
    msg = str(e.value)
    assert "\n" not in msg
    assert "system.ray: the Ray bundles reserve 2.25 logical CPUs" in msg
    for key in ("system.ray.num_rollout_workers=2", "system.ray.cpus_per_rollout_worker=0.5",
                "system.ray.cpus_per_reward_worker=0.25", "learner.world_size=4", "system.ray.cpus_per_learner=0.25",
                "the 2 CPUs Ray detects here", "system.ray.local_num_cpus to at least 2.25"):
        assert key in msg, key


def test_explicit_reservations_over_the_cpus_are_refused(two_cpus: None) -> None:
    # the shape with the old default 0.5 per learner: 2 x 0.5 + 0.25 + 2 x 0.5 = 2.25 > 2
    with pytest.raises(ConfigError, match=r"reserve 2\.25 logical CPUs"):
        load_run_config("grpo", [*README, "system.ray.cpus_per_learner=0.5"])


def test_local_num_cpus_and_a_joined_cluster_are_what_counts(two_cpus: None) -> None:
    over = [*README[:2], "learner.world_size=4"]
    load_run_config("grpo", [*over, "system.ray.local_num_cpus=3"])  # 2.25 <= 3 logical CPUs
    with pytest.raises(ConfigError, match=r"but the local cluster has system\.ray\.local_num_cpus=1;"):
        load_run_config("grpo", [*README, "system.ray.local_num_cpus=1"])  # 1.75 > 1
    load_run_config("grpo", [*over, "system.ray.address=auto"])  # a joined cluster may grow: not checked here


def test_no_reward_actor_and_no_learner_rank_reserve_nothing(two_cpus: None) -> None:
    # embedded learner: only 2 x 0.5 + 0.25 = 1.25; 4 rollout workers x 0.5 = 2.0 fit exactly without reward actors
    load_run_config("grpo", ["system.backend=ray", "system.ray.num_rollout_workers=4", "system.ray.num_reward_workers=0"])
    with pytest.raises(ConfigError, match=r"reserve 2\.25 logical CPUs \(system\.ray\.num_rollout_workers=4 x"):
        load_run_config("grpo", ["system.backend=ray", "system.ray.num_rollout_workers=4"])


def test_posttrain_train_refuses_before_the_run_dir(two_cpus: None, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "grpo", *README[:2], "learner.world_size=4", f"run_dir={run_dir}"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("posttrain train: error: ") and "reserve 2.25 logical CPUs" in line
    assert not run_dir.exists()
