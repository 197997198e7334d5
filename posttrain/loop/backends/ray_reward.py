"""Reward workers as Ray actors (:class:`RayRewardWorkers`): verification chunks spread over
verifier actors; a worker that dies has its items re-queued (``request_retries`` times), after
which each is an ``infra_error`` verdict, counted -- never a zero reward."""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from posttrain.config.ray import RayBackendConfig
from posttrain.loop.backends.ray_cluster import Placement, infra_errors, require_ray, wait_alive
from posttrain.loop.backends.worker import install_alarm_handler, merge_counts, verify_items
from posttrain.rewards.pool import Item
from posttrain.rewards.verdict import Verdict, infra_error

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle


class RewardActor:
    """Actor body: verifies item chunks with per-item time limits and retries."""

    def __init__(self, name: str, timeout_s: float, retries: int) -> None:
        self.name, self.timeout_s, self.retries = name, timeout_s, retries
        self.alarm = install_alarm_handler()

    def verify(self, items: list[Item]) -> list[tuple[Verdict, dict[str, int]]]:
        """See :func:`~posttrain.loop.backends.worker.verify_items`."""
        return verify_items(items, self.timeout_s if self.alarm else None, self.retries)

    def info(self) -> dict[str, str | int | bool]:
        """Name, pid, whether SIGALRM time limits are active."""
        return {"name": self.name, "pid": os.getpid(), "alarm": self.alarm}


class RayRewardWorkers:
    """Verifier actors: items split over workers; a worker that dies has its items re-queued
    (``request_retries`` times) and then each is an ``infra_error`` verdict, counted."""

    def __init__(self, cfg: RayBackendConfig, placement: Placement | None = None) -> None:
        ray = require_ray()
        self.cfg, self._ray = cfg, ray
        self._failures: tuple[type[BaseException], ...] = (*infra_errors(), TimeoutError)
        cls = ray.remote(RewardActor)
        self.names = [f"reward-{i}" for i in range(cfg.num_reward_workers)]
        self.actors: list[ActorHandle[RewardActor]] = []
        for i, name in enumerate(self.names):
            opts: dict[str, Any] = dict(num_cpus=cfg.cpus_per_reward_worker, max_restarts=cfg.max_restarts,
                                        max_task_retries=cfg.max_task_retries)
            if placement is not None:
                opts["scheduling_strategy"] = placement.strategy("reward", i)
            self.actors.append(cls.options(**opts).remote(name, cfg.verify_timeout_s, cfg.verify_retries))
        ray.get([a.info.remote() for a in self.actors], timeout=cfg.startup_timeout_s)
        self.counts: dict[str, float] = {}
        self.dead: set[int] = set()

    def verify_batch(self, items: Sequence[Item]) -> list[Verdict]:
        """One verdict per item, in order (see the class docstring)."""
        items = list(items)
        merge_counts(self.counts, {"calls": len(items)}, "verify/")
        results: list[Verdict | None] = [None] * len(items)
        tries: collections.Counter[int] = collections.Counter()
        n = len(self.actors)
        alive = [k for k in range(n) if k not in self.dead]
        if not alive:
            merge_counts(self.counts, {"infra_error": len(items)}, "verify/")
            return [infra_error("no live reward worker") for _ in items]
        chunks = [list(range(len(items)))[k :: len(alive)] for k in range(len(alive))] if items else []
        queue = collections.deque((alive[k], c) for k, c in enumerate(chunks) if c)
        per_item = self.cfg.verify_timeout_s * (self.cfg.verify_retries + 1) + 5.0
        while queue:
            inflight: dict[ObjectRef[list[tuple[Verdict, dict[str, int]]]], tuple[int, list[int], float]] = {}
            while queue:
                w, idx = queue.popleft()
                for j in idx:
                    tries[j] += 1
                ref: ObjectRef[list[tuple[Verdict, dict[str, int]]]] = self.actors[w].verify.remote(
                    [items[j] for j in idx])
                inflight[ref] = (w, idx, per_item * len(idx) + self.cfg.startup_timeout_s)
            budget = max(t for _, _, t in inflight.values())
            ready, not_ready = self._ray.wait(list(inflight), num_returns=len(inflight), timeout=budget)
            for ref in not_ready:
                w, idx, _ = inflight[ref]
                self._ray.kill(self.actors[w], no_restart=False)
            for ref in list(ready) + list(not_ready):
                w, idx, _ = inflight[ref]
                try:
                    if ref in not_ready:
                        raise TimeoutError(f"reward worker {self.names[w]} gave no answer within {budget:g}s")
                    out = self._ray.get(ref, timeout=budget)
                except self._failures as e:
                    merge_counts(self.counts, {"worker_failures": 1}, "verify/")
                    if wait_alive(self.actors[w], self.cfg.startup_timeout_s) is not None:
                        self.dead.add(w)
                    retry = [j for j in idx if tries[j] <= self.cfg.request_retries and len(self.dead) < n]
                    for j in idx:
                        if j not in retry:
                            results[j] = infra_error(f"reward worker {self.names[w]} failed: {type(e).__name__}")
                            merge_counts(self.counts, {"infra_error": 1}, "verify/")
                    if retry:
                        merge_counts(self.counts, {"requeued": len(retry)}, "verify/")
                        alive = [k for k in range(n) if k not in self.dead]
                        queue.append((alive[(alive.index(w) + 1) % len(alive)] if w in alive else alive[0], retry))
                    continue
                for j, (verdict, counts) in zip(idx, out, strict=True):
                    results[j] = verdict
                    merge_counts(self.counts, counts, "verify/")
                    if verdict.status.value == "infra_error":
                        merge_counts(self.counts, {"infra_error": 1}, "verify/")
        final = [r for r in results if r is not None]
        if len(final) != len(items):
            raise RuntimeError(f"reward workers: {len(items) - len(final)} item(s) without a verdict")
        return final

    def metrics(self) -> dict[str, float]:
        """Cumulative ``verify/*`` counters."""
        return dict(sorted(self.counts.items()))

    def close(self) -> None:
        """Kill the actors."""
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001,S110
                pass
        self.actors = []


__all__ = ["RayRewardWorkers", "RewardActor"]
