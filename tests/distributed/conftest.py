"""Distributed tests: a session-scoped local Ray cluster + backend (2 CPUs, loopback only).

The backend is built once (cluster start + worker actors take most of the Ray tests' time) and
closed — actors killed, placement released, Ray shut down — at the end of the session. Fault tests
arm a worker's crash hook by writing its marker file (see posttrain/loop/backends/worker.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _distributed_helpers as helpers  # noqa: E402


@pytest.fixture(scope="session")
def ray_env(tmp_path_factory):
    """``{"backend", "cfg", "markers"}``: 2 rollout workers, 1 reward worker."""
    import ray.cloudpickle

    from posttrain.loop.backends import RayBackendConfig, build_ray_backend, builtin_engine_factory

    ray.cloudpickle.register_pickle_by_value(helpers)
    markers = tmp_path_factory.mktemp("crash")
    cfg = RayBackendConfig(
        local_num_cpus=2, num_rollout_workers=2, num_reward_workers=1,
        cpus_per_rollout_worker=0.5, cpus_per_reward_worker=0.25,
        transfer_timeout_s=20, generate_timeout_s=60, verify_timeout_s=5, startup_timeout_s=90,
        max_restarts=10, max_task_retries=0, request_retries=1,
    )
    backend = build_ray_backend(
        builtin_engine_factory(helpers.micro_engine_model(), eos_token_id=1), cfg,
        crash_markers=[str(markers / "rollout-0"), str(markers / "rollout-1")],
    )
    try:
        yield {"backend": backend, "cfg": cfg, "markers": markers}
    finally:
        backend.close()
