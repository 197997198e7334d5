"""Execution backends: where rollout and reward workers run when ``system.backend=ray``.

``system.backend=local`` (the default) needs none of this: the loop calls the engine and the
verifier pool in-process. ``ray`` gives the loop a :class:`Backend` whose rollout workers stand
where the engine stands and whose reward workers' ``verify_batch`` stands where the pool's does.
Modules, one concept each:

- :mod:`~posttrain.loop.backends.base`: the interface (:class:`Backend`, worker protocols,
  :class:`FailedRequest`, the exactly-once check) and the request helpers every engine call uses;
- :mod:`~posttrain.loop.backends.worker`: one rollout worker's logic (weights, generation, crash hook)
  and the reward workers' verification, process-agnostic;
- :mod:`~posttrain.loop.backends.ray_cluster`: joining/starting the cluster, placement groups;
- :mod:`~posttrain.loop.backends.ray_rollout` / :mod:`~posttrain.loop.backends.ray_reward`: the actor
  pools; :mod:`~posttrain.loop.backends.ray_backend`: their assembly;
- :mod:`~posttrain.loop.backends.ray_learner`: learner ranks (``learner.strategy`` ddp / fsdp2) as Ray
  actors, a :class:`~posttrain.learner.rank_transport.RankTransport` for
  :class:`~posttrain.learner.ranks.LearnerRanks` (:func:`ray_rank_starter`; Ray is imported when the
  ranks start);
- :mod:`~posttrain.loop.backends.builtin_factory`: the built-in engine's picklable factory.

Importing this package never imports Ray; :func:`build_ray_backend` does, and without Ray
installed raises ``ImportError("... pip install 'posttrain[ray]'")``. See docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.config.ray import RayBackendConfig
from posttrain.loop.backends.base import (
    Backend,
    FailedRequest,
    RewardWorkers,
    RolloutInfraError,
    RolloutResult,
    RolloutWorkers,
    check_exactly_once,
)
from posttrain.loop.backends.builtin_factory import builtin_engine_factory
from posttrain.loop.backends.ray_learner import ray_rank_starter
from posttrain.rollout.engine import RolloutEngine

__all__ = [
    "Backend",
    "FailedRequest",
    "RayBackendConfig",
    "RewardWorkers",
    "RolloutInfraError",
    "RolloutResult",
    "RolloutWorkers",
    "build_ray_backend",
    "builtin_engine_factory",
    "check_exactly_once",
    "ray_rank_starter",
]


def build_ray_backend(engine_factory: Callable[[], RolloutEngine], cfg: RayBackendConfig, *,
                      crash_markers: Sequence[str | None] | None = None) -> Backend:
    """:func:`posttrain.loop.backends.ray_backend.build_ray_backend` (imports Ray on call)."""
    from posttrain.loop.backends.ray_backend import build_ray_backend as _build

    return _build(engine_factory, cfg, crash_markers=crash_markers)

