"""The Ray cluster side of the Ray backend: joining or starting a cluster, and placement.

:func:`init_ray` connects to ``system.ray.address`` or starts a loopback-only local cluster;
:class:`Placement` reserves the workers' bundles: ``colocated`` puts every worker's bundle in one
placement group (``PACK``: the same node when it fits), ``disaggregated`` gives each role its own
group, spread over nodes (``SPREAD``). The learner ranks of ``learner.strategy=ddp|fsdp2`` get a
group of their own (:func:`learner_group`: one bundle per rank, ``PACK`` when colocated, ``SPREAD``
when disaggregated). Bundles are CPUs/GPUs/custom resources from
:class:`~posttrain.loop.backends.config.RayBackendConfig`, so a multi-node run changes only
``address`` and the worker counts. Importing this module does not import Ray; every function does.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

from posttrain.config.ray import RayBackendConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

_Actor = TypeVar("_Actor")

RAY_INSTALL_HINT = "the Ray backend needs ray: pip install 'posttrain[ray]'"


def require_ray() -> ModuleType:
    """``import ray`` or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised by test_import_guard via a blocked import
        raise ImportError(RAY_INSTALL_HINT) from e
    return ray


def infra_errors() -> tuple[type[BaseException], ...]:
    """Ray exceptions that mean "the worker or its data is gone", not "the code raised"."""
    import ray.exceptions as rex

    names = ("RayActorError", "WorkerCrashedError", "ObjectLostError", "OwnerDiedError", "NodeDiedError",
             "LocalRayletDiedError", "ObjectFetchTimedOutError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def loopback_only() -> None:
    """Make a locally started cluster bind and connect on 127.0.0.1 only.

    Ray resolves "127.0.0.1" to the machine's routable address unless its cluster mode is off;
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` turns it off (for this process, read from the
    constant, and for every Ray process it starts, through the inherited environment), so the
    GCS, raylets, object stores and workers listen on loopback only. Only for ``address: null``.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as rc

    rc.ENABLE_RAY_CLUSTER = False


def init_ray(cfg: RayBackendConfig) -> bool:
    """Connect to (``address``) or start (``address: null``) a cluster; True when this call started it.

    A locally started cluster is loopback-only (:func:`loopback_only`) with no dashboard. An
    already initialised Ray is reused as is.
    """
    ray = require_ray()
    if ray.is_initialized():
        return False
    if cfg.address is None:
        loopback_only()
        ray.init(
            num_cpus=cfg.local_num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
    else:
        ray.init(address=cfg.address, log_to_driver=True, configure_logging=False)
    return True


def bundle_node(pg: PlacementGroup, index: int) -> str:
    """The Ray node id on which bundle ``index`` of the ready placement group ``pg`` is reserved."""
    from ray.util import placement_group_table

    return str(placement_group_table(pg)["bundles_to_node_id"][index])


def role_placement_metrics(where: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Where each role's workers run, as numbers for the run's metrics: ``placement/nodes`` (distinct
    nodes over every role), ``placement/<role>/nodes`` and ``placement/<role>/<i>`` (worker ``i``'s node
    as an index into the sorted distinct node ids, shared by every role: two workers share a node iff
    their indices are equal)."""
    nodes = sorted({n for ids in where.values() for n in ids})
    out = {"placement/nodes": float(len(nodes))}
    for role, ids in sorted(where.items()):
        out[f"placement/{role}/nodes"] = float(len(set(ids)))
        out.update({f"placement/{role}/{i}": float(nodes.index(n)) for i, n in enumerate(ids)})
    return out


def learner_group(cfg: RayBackendConfig, world_size: int) -> PlacementGroup:
    """A ready placement group of ``world_size`` learner bundles (``cpus_per_learner``,
    ``gpus_per_learner``, ``learner_resources`` each): ``PACK`` for ``placement: colocated`` (one node
    when it fits), ``SPREAD`` for ``disaggregated`` (the ranks over nodes). Raises ``RuntimeError``
    naming what could not be reserved within ``startup_timeout_s``."""
    ray = require_ray()
    from ray.util import placement_group, remove_placement_group

    b = {"CPU": cfg.cpus_per_learner, **cfg.learner_resources}
    if cfg.gpus_per_learner:
        b["GPU"] = cfg.gpus_per_learner
    strategy = "PACK" if cfg.placement == "colocated" else "SPREAD"
    pg: PlacementGroup = placement_group([dict(b)] * world_size, strategy=strategy,
                                         name=f"posttrain-learner-{uuid.uuid4().hex[:8]}")
    try:
        ray.get(pg.ready(), timeout=cfg.startup_timeout_s)
    except Exception as e:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray placement ({strategy}) could not reserve {world_size} learner bundles of {b} within "
            f"{cfg.startup_timeout_s:g}s; cluster has {ray.available_resources()} available ({type(e).__name__})"
        ) from e
    return pg


def wait_alive(actor: ActorHandle[_Actor], timeout_s: float) -> str | None:
    """Ping ``actor.info`` until it answers (``None``) or Ray says it is gone / ``timeout_s`` passes
    (the error text). An actor being restarted is waited for, not declared dead."""
    ray = require_ray()
    rex = ray.exceptions
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            ray.get(actor.info.remote(), timeout=max(0.1, left))
            return None
        except rex.ActorUnavailableError as e:  # restarting: ask again
            if left <= 0:
                return f"{type(e).__name__}: {e}"[:300]
            time.sleep(0.2)
        except (*infra_errors(), rex.GetTimeoutError) as e:
            return f"{type(e).__name__}: {e}"[:300]


class Placement:
    """Placement groups for the roles; ``strategy(role, i)`` gives an actor its bundle."""

    def __init__(self, cfg: RayBackendConfig) -> None:
        ray = require_ray()
        from ray.util import placement_group

        self.cfg = cfg

        def bundle(cpus: float, gpus: float, extra: Mapping[str, float]) -> dict[str, float]:
            b = {"CPU": cpus, **extra}
            if gpus:
                b["GPU"] = gpus
            return b

        roles: dict[str, list[dict[str, float]]] = {
            "rollout": [bundle(cfg.cpus_per_rollout_worker, cfg.gpus_per_rollout_worker, cfg.rollout_resources)]
            * cfg.num_rollout_workers,
            "reward": [bundle(cfg.cpus_per_reward_worker, 0.0, {})] * cfg.num_reward_workers,
        }
        self.groups: dict[str, tuple[PlacementGroup, int]] = {}
        pgs: list[PlacementGroup] = []
        # Names must be unique in a cluster: two runs (or a run and a test fixture) may share one.
        tag = uuid.uuid4().hex[:8]
        if cfg.placement == "colocated":
            bundles = [b for r in ("rollout", "reward") for b in roles[r]]
            pg = placement_group(bundles, strategy="PACK", name=f"posttrain-colocated-{tag}")
            pgs.append(pg)
            offset = 0
            for r in ("rollout", "reward"):
                self.groups[r] = (pg, offset)
                offset += len(roles[r])
        else:
            for r, strategy in (("rollout", "SPREAD"), ("reward", "SPREAD")):
                if roles[r]:
                    pg = placement_group(roles[r], strategy=strategy, name=f"posttrain-{r}-{tag}")
                    pgs.append(pg)
                    self.groups[r] = (pg, 0)
        self.pgs = pgs
        try:
            ray.get([pg.ready() for pg in pgs], timeout=cfg.startup_timeout_s)
        except Exception as e:
            self.remove()
            need = {r: b for r, b in roles.items() if b}
            raise RuntimeError(
                f"Ray placement ({cfg.placement}) could not reserve {need} within {cfg.startup_timeout_s:g}s; "
                f"cluster has {ray.available_resources()} available ({type(e).__name__})"
            ) from e

    def where(self) -> dict[str, list[str]]:
        """``{role: [Ray node id of bundle i, ...]}`` for every role with workers (from the placement
        group table: where Ray reserved each worker's bundle)."""
        sizes = {"rollout": self.cfg.num_rollout_workers, "reward": self.cfg.num_reward_workers}
        return {role: [bundle_node(pg, offset + i) for i in range(sizes[role])]
                for role, (pg, offset) in self.groups.items() if sizes[role]}

    def strategy(self, role: str, i: int) -> PlacementGroupSchedulingStrategy:
        """A ``PlacementGroupSchedulingStrategy`` for worker ``i`` of ``role``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, offset = self.groups[role]
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=offset + i)

    def remove(self) -> None:
        """Release the reserved resources."""
        from ray.util import remove_placement_group

        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001,S110 - best effort at shutdown
                pass
        self.pgs = []


__all__ = ["RAY_INSTALL_HINT", "Placement", "bundle_node", "infra_errors", "init_ray", "learner_group", "loopback_only",
           "require_ray", "role_placement_metrics", "wait_alive"]
