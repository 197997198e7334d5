"""``RayBackendConfig``: the keys of ``system.ray`` (validated by pydantic, ``extra="forbid"``).

Scaling rule: a laptop run and a multi-node run differ only in ``address`` (``None`` starts a
local cluster; ``"auto"`` or ``"host:port"`` joins a running one) and the worker counts. Placement
is expressed in resources (CPUs/GPUs per worker, optional custom resources that pin a role to
labelled nodes) and placement groups, never in host names.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

REMOVED_KEYS: dict[str, str] = {
    "weight_transport": "nothing read it (the weights always went through Ray's object store; system.ray.weight_sync "
                        "picks the route)",
}
"""Keys ``system.ray`` once had, each with why it went: a recipe that sets one is refused naming it; a run's saved
``config.yaml`` that lists one (every key was recorded) is read without it."""


class RayBackendConfig(BaseModel):
    """Ray backend settings (see ``docs/distributed.md`` for each key)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or not REMOVED_KEYS.keys() & data.keys():
            return data
        if (info.context or {}).get("recorded"):  # a run recorded before the key went: read as it ran
            return {k: v for k, v in data.items() if k not in REMOVED_KEYS}
        key = sorted(REMOVED_KEYS.keys() & data.keys())[0]
        raise ValueError(f"system.ray.{key} was removed: {REMOVED_KEYS[key]}; drop it from the recipe")

    address: str | None = Field(
        default=None, description="None: start a local cluster; 'auto' or 'host:port': join that cluster"
    )
    num_rollout_workers: int = Field(default=2, ge=1, description="rollout worker actors (one engine each)")
    num_reward_workers: int = Field(default=1, ge=0, description="verifier actors (0: verify in the driver process)")
    placement: Literal["colocated", "disaggregated"] = Field(
        default="colocated",
        description="colocated: one placement group (PACK) for every worker, the learner ranks' group PACKed "
        "too; disaggregated: one group per role, rollout workers and learner ranks SPREAD over nodes",
    )
    cpus_per_rollout_worker: float = Field(default=0.5, gt=0, description="logical CPUs reserved per rollout worker")
    cpus_per_reward_worker: float = Field(default=0.25, gt=0, description="logical CPUs reserved per reward worker")
    cpus_per_learner: float = Field(
        default=0.25, gt=0, description="logical CPUs reserved per learner rank actor (learner.strategy ddp / fsdp2); "
        "the defaults' 2 x 0.5 + 0.25 + 2 x 0.25 = 1.75 fit a 2-core machine with learner.world_size=2"
    )
    gpus_per_rollout_worker: float = Field(default=0.0, ge=0)
    gpus_per_learner: float = Field(default=0.0, ge=0, description="GPUs per learner rank actor (1 for a CUDA learner)")
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources per rollout worker, e.g. {'rollout_node': 1}"
    )
    learner_resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources per learner rank bundle, e.g. {'learner_node': 1}"
    )
    transfer_timeout_s: float = Field(default=60.0, gt=0, description="bound on one weight broadcast (fails loudly)")
    generate_timeout_s: float = Field(default=600.0, gt=0, description="bound on one worker's generate call")
    verify_timeout_s: float = Field(default=10.0, gt=0, description="per-item verifier time limit")
    learner_timeout_s: float = Field(default=1800.0, gt=0, description="bound on one remote learner call")
    startup_timeout_s: float = Field(default=120.0, gt=0, description="bound on placement + actor start-up")
    max_restarts: int = Field(default=3, ge=0, description="Ray restarts of a dead worker actor")
    max_task_retries: int = Field(
        default=1, ge=0, description="Ray re-runs of a call whose actor died mid-call (on the restarted actor)"
    )
    request_retries: int = Field(
        default=1, ge=0, description="driver re-queues of a request whose worker failed, before it is an infra_error"
    )
    verify_retries: int = Field(default=1, ge=0, description="retries of a verifier that raised or timed out")
    weight_sync: Literal["direct", "via_driver"] = Field(
        default="direct",
        description="learner ranks (learner.strategy ddp / fsdp2) -> rollout workers after an update. direct: rank "
        "0's actor puts each weight bucket in the object store and every rollout worker fetches and verifies the "
        "buckets itself (the driver passes references); via_driver: the buckets stream to the driver, which packs "
        "its copy into one packet for the workers (docs/distributed.md, 'Weight sync')",
    )
    local_num_cpus: int | None = Field(
        default=None, ge=1, description="logical CPUs of a locally started cluster (None: the CPUs Ray detects, "
        "all cores or the container's quota); may exceed the cores, oversubscribing them"
    )

    @model_validator(mode="after")
    def _check(self) -> RayBackendConfig:
        if self.address is not None and self.local_num_cpus is not None:
            raise ValueError("local_num_cpus only applies to a locally started cluster (address: null)")
        return self

    def cpu_demand(self, reward_workers: int, learner_ranks: int) -> float:
        """Logical CPUs the run's bundles reserve: ``num_rollout_workers x cpus_per_rollout_worker +
        reward_workers x cpus_per_reward_worker + learner_ranks x cpus_per_learner`` (the driver and the
        factory holder actor reserve none). ``reward_workers``: the reward actors the run starts
        (``RunConfig.ray_reward_actors``); ``learner_ranks``: ``learner.world_size`` with ddp / fsdp2, else 0."""
        return (self.num_rollout_workers * self.cpus_per_rollout_worker + reward_workers * self.cpus_per_reward_worker
                + learner_ranks * self.cpus_per_learner)

    def check_local_cpus(self, reward_workers: int, learner_ranks: int, detected: float | None = None) -> None:
        """For a locally started cluster (``address: null``), ``ValueError`` (one line naming the keys) when
        :meth:`cpu_demand` exceeds its logical CPUs: ``local_num_cpus``, else ``detected`` (default
        :func:`ray_detected_cpus`). Placement would otherwise wait ``startup_timeout_s`` for bundles that a
        cluster of fixed size can never hold. A joined cluster (``address`` set) is not checked: it may grow."""
        if self.address is not None:
            return
        cpus = float(self.local_num_cpus) if self.local_num_cpus is not None else (
            ray_detected_cpus() if detected is None else detected)
        need = self.cpu_demand(reward_workers, learner_ranks)
        if need <= cpus + 1e-9:
            return
        terms = [f"system.ray.num_rollout_workers={self.num_rollout_workers} x "
                 f"system.ray.cpus_per_rollout_worker={self.cpus_per_rollout_worker:g}"]
        if reward_workers:
            terms.append(f"{reward_workers} reward actor(s) x system.ray.cpus_per_reward_worker="
                         f"{self.cpus_per_reward_worker:g}")
        if learner_ranks:
            terms.append(f"learner.world_size={learner_ranks} x system.ray.cpus_per_learner={self.cpus_per_learner:g}")
        have = (f"system.ray.local_num_cpus={self.local_num_cpus}" if self.local_num_cpus is not None
                else f"the {cpus:g} CPUs Ray detects here (system.ray.local_num_cpus unset)")
        raise ValueError(f"the Ray bundles reserve {need:g} logical CPUs ({' + '.join(terms)}) but the local cluster "
                         f"has {have}; lower those keys, or set system.ray.local_num_cpus to at least {need:g} "
                         "(logical CPUs: it may exceed the cores)")


def ray_detected_cpus() -> float:
    """The CPUs a locally started Ray cluster gets without ``num_cpus``: Ray's own detection
    (``os.cpu_count()``, or a container's CPU quota) when Ray is installed, else ``os.cpu_count()``."""
    try:
        from ray._private.utils import get_num_cpus
    except ImportError:
        return float(os.cpu_count() or 1)
    return float(get_num_cpus(override_docker_cpu_warning=True))
