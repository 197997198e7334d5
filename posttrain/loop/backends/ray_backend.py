"""The Ray backend: rollout workers and (optionally) reward workers as Ray actors, one :class:`Backend`.

:func:`build_ray_backend` joins or starts the cluster (:mod:`~posttrain.loop.backends.ray_cluster`),
reserves the placement, and starts the rollout actors (:mod:`~posttrain.loop.backends.ray_rollout`)
and, with ``num_reward_workers > 0``, the reward actors (:mod:`~posttrain.loop.backends.ray_reward`).
The loop (``system.backend=ray``, ``posttrain.loop.run``) uses the rollout workers as its
engine and the reward workers' ``verify_batch`` as its verifier; see docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.config.ray import RayBackendConfig
from posttrain.loop.backends.base import Backend, RewardWorkers
from posttrain.loop.backends.ray_cluster import Placement, init_ray, require_ray, role_placement_metrics
from posttrain.loop.backends.ray_reward import RayRewardWorkers
from posttrain.loop.backends.ray_rollout import RayRolloutWorkers
from posttrain.rollout.engine import RolloutEngine


def build_ray_backend(
    engine_factory: Callable[[], RolloutEngine],
    cfg: RayBackendConfig,
    *,
    crash_markers: Sequence[str | None] | None = None,
) -> Backend:
    """Start/join the cluster, reserve placement, start the actors; the :class:`Backend` of them.

    ``engine_factory``: picklable, zero arguments (e.g. ``builtin_engine_factory``); each rollout
    actor calls it once, and again after a restart. ``crash_markers[i]`` arms rollout worker ``i``'s
    fault-injection hook (tests only). ``Backend.reward`` is None without reward workers (the driver
    verifies). ``Backend.close()`` kills the actors, releases the placement groups and shuts Ray
    down if this call started it. A failure while starting releases what was started and re-raises.
    """
    started = init_ray(cfg)
    placement = Placement(cfg)

    def release() -> None:
        placement.remove()
        if started:
            require_ray().shutdown()

    try:
        rollout = RayRolloutWorkers(engine_factory, cfg, placement, crash_markers)
        reward: RewardWorkers | None = RayRewardWorkers(cfg, placement) if cfg.num_reward_workers else None
    except BaseException:
        release()
        raise
    return Backend(rollout=rollout, reward=reward, release=release,
                   placement=role_placement_metrics(placement.where()))


__all__ = ["build_ray_backend"]
