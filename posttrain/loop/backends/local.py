"""The local backend: rollout workers and reward workers in this process (the default).

Same interface as :mod:`posttrain.loop.backends.ray_backend`, so the loop never branches on the
backend. Weight transfer goes through the same verified :class:`WeightPacket` (pack once, every
worker verifies version + checksum before loading), which costs one copy of the weights and keeps
both backends on one code path. Errors of an in-process engine are bugs or bad requests, not
infrastructure: they propagate (there is no worker to restart).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from posttrain.loop.backends.base import (
    Backend,
    RolloutInfraError,
    RolloutResult,
    check_exactly_once,
    order_completions,
    split_requests,
)
from posttrain.loop.backends.worker import RolloutWorker
from posttrain.rewards.pool import Item, VerifierPool
from posttrain.rewards.verdict import Verdict
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.rollout.weight_transfer import pack_state_dict


class _Given:
    """A factory returning an engine that already exists."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def __call__(self) -> RolloutEngine:
        return self.engine


class LocalRolloutWorkers:
    """N in-process engines behind one engine-shaped handle (requests split in order, run in turn)."""

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        if not engines:
            raise ValueError("LocalRolloutWorkers needs at least one engine")
        self.workers = [RolloutWorker(_Given(e), f"local-rollout-{i}") for i, e in enumerate(engines)]
        versions = {w.version for w in self.workers}
        if len(versions) != 1:
            raise ValueError(f"engines start at different versions {sorted(versions)}")
        self.version = versions.pop()
        self.counts: dict[str, float] = {"rollout/requests": 0.0, "rollout/weight_syncs": 0.0}

    def generate_detailed(
        self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None
    ) -> RolloutResult:
        """Completions of ``requests`` (``finish_target`` applies per worker chunk when N > 1)."""
        self.counts["rollout/requests"] += len(requests)
        out: list[Completion] = []
        for w, chunk in zip(self.workers, split_requests(requests, len(self.workers)), strict=False):
            out.extend(w.generate(chunk, finish_target))
        completions = order_completions(requests, out)
        check_exactly_once(requests, completions, [])
        return RolloutResult(completions, [])

    def generate(self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None) -> list[Completion]:
        """Engine protocol."""
        res = self.generate_detailed(requests, finish_target=finish_target)
        if res.failed:
            raise RolloutInfraError(res)
        return res.completions

    def broadcast_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Pack once, every worker verifies and loads; returns ``transfer/*`` timings."""
        t0 = time.perf_counter()
        packet = pack_state_dict(state_dict, version)
        t1 = time.perf_counter()
        load = [w.load_packet(packet, version, packet.checksum) for w in self.workers]
        self.version = int(version)
        self.counts["rollout/weight_syncs"] += 1
        return {
            "transfer/pack_s": t1 - t0,
            "transfer/total_s": time.perf_counter() - t0,
            "transfer/load_s_max": max(x["load_s"] + x["verify_s"] for x in load),
            "transfer/bytes": float(packet.nbytes),
        }

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Engine protocol: :meth:`broadcast_weights` (``version=None`` -> current + 1)."""
        self.broadcast_weights(state_dict, self.version + 1 if version is None else int(version))

    def pause(self) -> None:
        """Pause every engine."""
        for w in self.workers:
            w.pause()

    def metrics(self) -> dict[str, float]:
        """Cumulative counters."""
        return dict(self.counts)

    def close(self) -> None:
        """Nothing to release."""


class LocalRewardWorkers:
    """:class:`~posttrain.rewards.pool.VerifierPool` (``workers=0``: in-process) behind the backend interface."""

    def __init__(self, workers: int = 0, timeout_s: float = 10.0, retries: int = 1) -> None:
        self.pool = VerifierPool(workers=workers, timeout_s=timeout_s, retries=retries)

    def verify_batch(self, items: Sequence[Item]) -> list[Verdict]:
        """One verdict per item (infra errors never become a reward)."""
        return self.pool.verify_batch(items)

    def metrics(self) -> dict[str, float]:
        """The pool's ``verify/*`` counters."""
        return self.pool.metrics()

    def close(self) -> None:
        """Shut the pool down."""
        self.pool.close()


def build_local_backend(
    engine_factory: Callable[[], RolloutEngine] | None = None,
    *,
    engines: Sequence[RolloutEngine] | None = None,
    num_rollout_workers: int = 1,
    reward_workers: int = 0,
    verify_timeout_s: float = 10.0,
    verify_retries: int = 1,
) -> Backend:
    """A local :class:`Backend`: ``engines`` as given, or ``num_rollout_workers`` from ``engine_factory``."""
    if engines is None:
        if engine_factory is None:
            raise ValueError("build_local_backend needs engines or an engine_factory")
        engines = [engine_factory() for _ in range(num_rollout_workers)]
    return Backend(
        kind="local",
        rollout=LocalRolloutWorkers(engines),
        reward=LocalRewardWorkers(reward_workers, verify_timeout_s, verify_retries),
    )
