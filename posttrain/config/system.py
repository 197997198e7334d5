"""System axis (``system``): how rollout and update are scheduled, on which backend (docs/system_modes.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.ray import RayBackendConfig
from posttrain.config.section import Section


class SystemConfig(Section):
    """System axis: how rollout and update are scheduled (see docs/system_modes.md).

    One loop, one knob: ``mode`` decides how batches of trajectories are produced; the update
    is the same code in every mode. The three staleness controls are independent switches:
    ``max_staleness`` (version tags: admission bound + drop at consumption), ``max_queue``
    (depth bound, producers block) and the ``correction`` section / ``decoupled_ppo`` loss
    (importance correction against the recorded behaviour log-probs).
    """

    mode: Literal["sync", "one_step_off", "async"] = Field(
        default="sync",
        description="sync: rollout then update (barrier); one_step_off: the rollout of step k+1 runs in a "
        "background thread while step k updates (policy lag 1); async: a rollout worker streams finished "
        "groups into a bounded queue and the learner consumes groups as they complete (AReaL-style)",
    )
    backend: Literal["local", "ray"] = Field(
        default="local",
        description="local: engine, verifiers and learner in this process; ray: rollout and reward workers as "
        "Ray actors (settings under system.ray; see docs/distributed.md)",
    )
    ray: RayBackendConfig = Field(
        default_factory=RayBackendConfig,
        description="Ray backend settings (used when backend=ray); a multi-node run changes only ray.address "
        "and the worker counts",
    )
    max_staleness: int | None = Field(
        default=None, ge=0,
        description="bound on policy lag in versions. A rollout is only started when its batch "
        "slot is at most this many versions ahead of the current policy, and at consumption every sample whose "
        "oldest token is older than this many versions is dropped and counted (staleness/dropped_samples). "
        "None = no version bound (async with neither bound gets max_staleness=1)",
    )
    max_queue: int | None = Field(
        default=None, ge=1,
        description="async: the queue of finished groups holds at most this many samples; a producer blocks "
        "(time counted in queue/blocked_s) instead of dropping anything. None = no depth bound",
    )
    interrupt_on_update: bool = Field(
        default=True,
        description="async: a weight update pauses the running generation; its unfinished samples resume under "
        "the new weights (their tokens then span versions; AReaL's interruptible rollout)",
    )
    partial_fraction: float = Field(
        default=1.0, gt=0.0, le=1.0,
        description="partial rollout lambda (every mode): each rollout call plans K=group_size samples for "
        "prompts_per_step prompts and returns once ceil(lambda*N*K) samples have finished; the rest are paused (not "
        "truncated) and resumed in the next call, topped up with fresh prompts. 1.0 = off",
    )
    max_version_span: int | None = Field(
        default=None, ge=0,
        description="drop (and count) a paused trajectory instead of resuming it when its tokens would span more "
        "than this many policy versions (newest - oldest behaviour version). None = no limit",
    )
    queue_timeout_s: float = Field(
        default=600.0, gt=0,
        description="non-sync modes: the learner fails loudly if no finished group arrives for this long",
    )
    engine_sleep: bool = Field(
        default=False, description="colocation: the rollout engine releases its weights and caches during each update "
        "(its sleep() hook) and re-acquires them before the weight sync (wake()); sync mode only; an engine "
        "that cannot (no hook, vLLM without CUDA) is logged and keeps its memory (docs/distributed.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _async_default_bound(cls, data: Any) -> Any:
        # async without any bound would run away: default to AReaL's common choice, staleness 1 (explicit
        # in the resolved config).
        if isinstance(data, dict) and data.get("mode") == "async" and data.get("max_staleness") is None \
                and data.get("max_queue") is None:
            data = {**data, "max_staleness": 1}
        return data

    @model_validator(mode="after")
    def _check_mode(self) -> SystemConfig:
        if self.mode == "async" and self.max_staleness is None and self.max_queue is None:
            raise ValueError("system.mode=async needs a bound: system.max_staleness and/or system.max_queue")
        if self.engine_sleep and self.mode != "sync":
            raise ValueError(f"system.engine_sleep=true needs system.mode=sync (in {self.mode} mode the engine "
                             "generates while the learner updates)")
        return self
