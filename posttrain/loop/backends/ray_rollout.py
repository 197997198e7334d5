"""Rollout workers as Ray actors behind one engine-shaped handle (:class:`RayRolloutWorkers`).

Weights, two paths (``system.ray.weight_sync``, docs/distributed.md):

- via the driver (:meth:`RayRolloutWorkers.broadcast_weights`): the driver packs the state dict ONCE
  into a :class:`~posttrain.rollout.weight_transfer.WeightPacket`, ``ray.put``s it, and every
  worker pulls the same object (zero-copy on a node);
- direct (:meth:`RayRolloutWorkers.broadcast_buckets`): the state dict handed to
  :meth:`~RayRolloutWorkers.update_weights` is a
  :class:`~posttrain.rollout.weight_transfer.PublishedWeights` — learner rank 0's actor already put
  every weight bucket in the object store — so the driver passes only the references, and every
  worker fetches the buckets from the rank's store itself.

Either way each worker verifies version + checksum of every packet against the values sent in the
call, before touching a parameter. The driver waits at most ``transfer_timeout_s`` and then
raises :class:`WeightTransferError` naming the workers that did not confirm -- it never hangs. A
worker that was dead during the broadcast is not an error: every ``generate`` call carries the
latest (version, checksums, object refs), and a worker holding another version loads and verifies
it before sampling (this is also how a restarted actor, rebuilt at version 0, catches up).

Faults (:meth:`RayRolloutWorkers.generate_detailed`): actors are created with ``max_restarts`` and
``max_task_retries``, so Ray restarts a dead worker and re-runs its in-flight call on the new
process. When Ray gives up (or a call exceeds ``generate_timeout_s``: the worker is then
killed with restart), the driver re-queues the call's requests on a live worker up to
``request_retries`` times, after which each request is a :class:`FailedRequest` -- the loop
records it as ``infra_error``, never as a zero reward. Every call ends with
:func:`check_exactly_once`: no request lost, none double-counted.
"""

from __future__ import annotations

import collections
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from posttrain.config.ray import RayBackendConfig
from posttrain.loop.backends.base import (
    FailedRequest,
    RolloutInfraError,
    RolloutResult,
    check_exactly_once,
    expected_completions,
    order_completions,
    split_requests,
)
from posttrain.loop.backends.ray_cluster import Placement, infra_errors, require_ray, wait_alive
from posttrain.loop.backends.worker import RolloutWorker
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.rollout.weight_transfer import (
    PublishedBucket,
    PublishedWeights,
    WeightPacket,
    WeightTransferError,
    pack_state_dict,
)

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

# The object-store references to the WeightPackets of one version (one packed by the driver, or one
# per bucket published by learner rank 0): inside a list, Ray passes the references themselves to the
# actor instead of resolving them (the actor fetches them when it needs them).
WeightBox = list["ObjectRef[WeightPacket]"]
# What every generate call carries so a worker at another version catches up first:
# (version, checksum of each packet of the box, box, fetch timeout in seconds).
WeightSync = tuple[int, tuple[str, ...], WeightBox, float]


class RolloutActor:
    """Actor body around :class:`RolloutWorker` (decorated with ``ray.remote`` at build time)."""

    def __init__(self, holder_name: str, name: str, crash_marker: str | None, torch_threads: int) -> None:
        import ray

        torch.set_num_threads(max(1, torch_threads))
        # The factory (it carries the model's weights) comes from the named holder actor, not as a
        # constructor argument: Ray cannot re-read an object-store argument on a restart (ray#53727), and
        # a handle argument counts as one; the name is a plain string.
        holder: ActorHandle[FactoryHolder] = ray.get_actor(holder_name)
        factory_ref: ObjectRef[Callable[[], RolloutEngine]] = holder.get.remote()
        engine_factory: Callable[[], RolloutEngine] = ray.get(factory_ref)
        self.worker: RolloutWorker = RolloutWorker(engine_factory, name, crash_marker)

    def info(self) -> dict[str, str | int]:
        """Name, pid, version, loads."""
        return self.worker.info()

    def load_weights(self, box: WeightBox, version: int, checksums: Sequence[str],
                     timeout_s: float) -> dict[str, float]:
        """Pull every packet of ``box`` (ObjectRefs to WeightPackets), verify, load (``RolloutWorker.load_packets``); timings."""
        import ray

        t0 = time.perf_counter()
        packets: list[WeightPacket] = ray.get(list(box), timeout=timeout_s)
        out = self.worker.load_packets(packets, version, checksums)
        return {"fetch_s": time.perf_counter() - t0 - out["verify_s"] - out["load_s"], **out}

    def generate(self, requests: list[GenerationRequest], finish_target: int | None,
                 sync: WeightSync | None) -> list[Completion]:
        """Catch up to the driver's weights (``sync``) if needed, then generate."""
        import ray

        if sync is not None:
            version, checksums, box, timeout_s = sync
            self.worker.ensure_version(version, checksums, lambda: ray.get(list(box), timeout=timeout_s))
        return self.worker.generate(requests, finish_target)

    def pause(self) -> None:
        """Pause the running generate (runs in the ``control`` concurrency group)."""
        self.worker.pause()


class FactoryHolder:
    """Actor body holding the rollout workers' engine factory for their lifetime (and restarts)."""

    def __init__(self, engine_factory: Callable[[], RolloutEngine]) -> None:
        self.engine_factory = engine_factory

    def get(self) -> Callable[[], RolloutEngine]:
        """The factory (each rollout actor fetches it in its constructor, again after a restart)."""
        return self.engine_factory


class RayRolloutWorkers:
    """Rollout worker actors behind one engine-shaped handle (see the module docstring).

    ``engine_factory`` is a picklable zero-argument callable returning a RolloutEngine (e.g.
    :func:`~posttrain.loop.backends.builtin_factory.builtin_engine_factory`); each actor calls it once (and again after a restart).
    ``crash_markers[i]`` arms worker ``i``'s fault-injection hook (tests only).
    """

    def __init__(self, engine_factory: Callable[[], RolloutEngine], cfg: RayBackendConfig,
                 placement: Placement | None = None, crash_markers: Sequence[str | None] | None = None) -> None:
        ray = require_ray()
        self.cfg = cfg
        self._ray = ray
        self._errors = infra_errors()
        markers = list(crash_markers or [None] * cfg.num_rollout_workers)
        cls = ray.remote(concurrency_groups={"control": 1})(RolloutActor)
        # Held for the backend's lifetime by an actor that never restarts: a restarted rollout actor fetches
        # the factory from it again (an object-store constructor argument would not survive, ray#53727).
        holder_name = f"posttrain-engine-factory-{uuid.uuid4().hex[:12]}"
        self._holder = ray.remote(FactoryHolder).options(name=holder_name, num_cpus=0, max_restarts=0).remote(
            engine_factory)
        self.names = [f"rollout-{i}" for i in range(cfg.num_rollout_workers)]
        self.actors: list[ActorHandle[RolloutActor]] = []
        for i, name in enumerate(self.names):
            opts: dict[str, Any] = dict(
                num_cpus=cfg.cpus_per_rollout_worker,
                num_gpus=cfg.gpus_per_rollout_worker,
                max_restarts=cfg.max_restarts,
                max_task_retries=cfg.max_task_retries,
            )
            if cfg.rollout_resources:
                opts["resources"] = dict(cfg.rollout_resources)
            if placement is not None:
                opts["scheduling_strategy"] = placement.strategy("rollout", i)
            threads = max(1, math.floor(cfg.cpus_per_rollout_worker))
            self.actors.append(cls.options(**opts).remote(holder_name, name, markers[i], threads))
        infos = self._get([a.info.remote() for a in self.actors], cfg.startup_timeout_s, "start")
        versions = {int(x["version"]) for x in infos}
        if len(versions) != 1:
            raise RuntimeError(f"rollout workers start at different versions {sorted(versions)}")
        self.version = versions.pop()
        self.dead: set[int] = set()
        self.last_error: dict[int, str] = {}
        self._latest: tuple[int, tuple[str, ...], WeightBox] | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        self._control: list[ObjectRef[None]] = []  # pause calls not yet answered (see pause / close)

    # ------------------------------------------------------------------ helpers
    def _get(self, refs: list[ObjectRef[dict[str, str | int]]], timeout_s: float,
             what: str) -> list[dict[str, str | int]]:
        ready, not_ready = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if not_ready:
            raise TimeoutError(f"rollout workers: {len(not_ready)} of {len(refs)} did not answer '{what}' "
                               f"within {timeout_s:g}s")
        return list(self._ray.get(refs, timeout=timeout_s))

    def info(self, timeout_s: float | None = None) -> list[dict[str, str | int] | None]:
        """``info()`` of every worker (``None`` for a dead one); waits at most ``timeout_s``."""
        t = timeout_s or self.cfg.startup_timeout_s
        out: list[dict[str, str | int] | None] = []
        for i, a in enumerate(self.actors):
            try:
                out.append(self._ray.get(a.info.remote(), timeout=t))
            except self._errors:
                self.dead.add(i)
                out.append(None)
        return out

    def _sync(self) -> WeightSync | None:
        if self._latest is None:
            return None
        v, cs, box = self._latest
        return v, cs, box, self.cfg.transfer_timeout_s

    def _alive(self) -> list[int]:
        return [i for i in range(len(self.actors)) if i not in self.dead]

    def _check_alive(self, i: int) -> None:
        """After a failure: wait for worker ``i`` to answer again (a restart takes seconds), at most
        ``startup_timeout_s``; mark it dead when Ray gave up on it or it never answers."""
        err = wait_alive(self.actors[i], self.cfg.startup_timeout_s)
        if err is not None:
            self.last_error[i] = err
            self.dead.add(i)
            self.counts["rollout/dead_workers"] += 1

    # ------------------------------------------------------------------ generation
    def generate_detailed(self, requests: Sequence[GenerationRequest], *,
                          finish_target: int | None = None) -> RolloutResult:
        """Completions + failed requests, each request exactly once (see the module docstring).

        ``finish_target`` (partial rollout) is shared out over the worker calls in proportion to
        their expected completions (rounded up), so at least ``finish_target`` finish overall.
        The requests are split over the live workers, then each round submits the queued chunks
        (:meth:`_Generation.dispatch`), takes the answered calls (:meth:`_Generation.collect`) and
        abandons the calls past ``generate_timeout_s`` (:meth:`_Generation.expire`) until nothing is
        queued or in flight.
        """
        reqs = list(requests)
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ValueError("generate: duplicate request_id in one call")
        call = _Generation(self, reqs, finish_target)
        while call.queue or call.inflight:
            call.dispatch()
            if not call.inflight:
                break
            call.collect()
            call.expire()
        completions = order_completions(reqs, call.completions)
        check_exactly_once(reqs, completions, call.failed)
        self.counts["rollout/requests"] += len(reqs)
        return RolloutResult(completions, call.failed, requeued=call.requeued, worker_failures=call.failures)

    def generate(self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None) -> list[Completion]:
        """Engine protocol: raises :class:`RolloutInfraError` (with the full result) if any request failed."""
        res = self.generate_detailed(requests, finish_target=finish_target)
        if res.failed:
            raise RolloutInfraError(res)
        return res.completions

    def pause(self) -> None:
        """Ask every live worker's running generate to return unfinished samples as paused.

        The calls are kept until they answer (:meth:`close` waits for them before killing the
        actors: a pause still queued when its actor is killed is reported by Ray as a failed task).
        """
        if self._control:
            done, self._control = self._ray.wait(self._control, num_returns=len(self._control), timeout=0)
            self._settle(done)
        for i in self._alive():
            self._control.append(self.actors[i].pause.options(concurrency_group="control").remote())

    def _settle(self, refs: list[ObjectRef[None]]) -> None:
        """Fetch the results of finished control calls (errors included) so none is left unhandled."""
        for ref in refs:
            try:
                self._ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001,S110 - a pause on a dead worker: nothing to pause
                pass

    # ------------------------------------------------------------------ weights
    def broadcast_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Pack once, ``ray.put`` once, every worker pulls and verifies (see the module docstring)."""
        t0 = time.perf_counter()
        packet = pack_state_dict(state_dict, version)
        t1 = time.perf_counter()
        ref = self._ray.put(packet)
        t2 = time.perf_counter()
        m = self.broadcast_ref([ref], version, packet.checksum)
        return {"transfer/pack_s": t1 - t0, "transfer/put_s": t2 - t1, "transfer/bytes": float(packet.nbytes),
                **m, "transfer/total_s": time.perf_counter() - t0}

    def broadcast_buckets(self, buckets: Sequence[PublishedBucket], version: int) -> dict[str, float]:
        """Every live worker fetches the published ``buckets`` (already in the object store, put there
        by their publisher) and verifies each against its checksum (see :meth:`broadcast_ref`); the
        driver passes only the references."""
        t0 = time.perf_counter()
        box = [ref for b in buckets for ref in b.box]
        m = self._load_everywhere(box, version, tuple(b.checksum for b in buckets))
        return {"transfer/bytes": float(sum(b.nbytes for b in buckets)), "transfer/buckets": float(len(buckets)),
                **m, "transfer/total_s": time.perf_counter() - t0}

    def broadcast_ref(self, box: WeightBox, version: int, checksum: str) -> dict[str, float]:
        """Every live worker loads the packet ``box[0]`` (already in the object store) and verifies it.

        Raises :class:`WeightTransferError` naming the workers that failed verification or did not
        confirm within ``transfer_timeout_s``. A worker that died meanwhile is counted
        (``rollout/deferred_syncs``): it verifies and loads before its next generate.
        """
        return self._load_everywhere(box, version, (checksum,))

    def _load_everywhere(self, box: WeightBox, version: int, checksums: tuple[str, ...]) -> dict[str, float]:
        """:meth:`broadcast_ref` for the packets of ``box``, ``checksums[i]`` announced for ``box[i]``."""
        t0 = time.perf_counter()
        tmo = self.cfg.transfer_timeout_s
        calls = {self.actors[i].load_weights.remote(box, version, checksums, tmo): i for i in self._alive()}
        ready, not_ready = self._ray.wait(list(calls), num_returns=len(calls), timeout=tmo)
        if not_ready:
            names = sorted(self.names[calls[r]] for r in not_ready)
            raise WeightTransferError(f"rollout worker(s) {names} did not confirm weights v{version} within {tmo:g}s")
        stats: list[dict[str, float]] = []
        for r in ready:
            i = calls[r]
            try:
                stats.append(self._ray.get(r, timeout=tmo))
            except self._errors:
                self.counts["rollout/deferred_syncs"] += 1
            except Exception as e:  # the worker raised (checksum, version, shape): fail loudly, name it
                why = getattr(e, "cause", None) or e  # a RayTaskError's own error, without the remote traceback
                raise WeightTransferError(f"rollout worker {self.names[i]} rejected weights v{version}: {why}") from e
        self._latest = (int(version), checksums, box)
        self.version = int(version)
        self.counts["rollout/weight_syncs"] += 1
        out = {"transfer/broadcast_s": time.perf_counter() - t0, "transfer/workers": float(len(stats))}
        if stats:
            out["transfer/fetch_s_max"] = max(s["fetch_s"] for s in stats)
            out["transfer/verify_s_max"] = max(s["verify_s"] for s in stats)
            out["transfer/load_s_max"] = max(s["load_s"] for s in stats)
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Engine protocol (``version=None`` -> current + 1): :meth:`broadcast_buckets` when
        ``state_dict`` is :class:`~posttrain.rollout.weight_transfer.PublishedWeights` of that version
        and ``system.ray.weight_sync=direct``, else :meth:`broadcast_weights`."""
        v = self.version + 1 if version is None else int(version)
        if isinstance(state_dict, PublishedWeights) and state_dict.version == v and self.cfg.weight_sync == "direct":
            self.broadcast_buckets(state_dict.buckets, v)
        else:
            self.broadcast_weights(state_dict, v)

    def metrics(self) -> dict[str, float]:
        """Cumulative ``rollout/*`` counters."""
        return {k: float(v) for k, v in sorted(self.counts.items())}

    def close(self) -> None:
        """Kill the worker actors (no restart), once their pending pause calls have answered
        (a flag set on the worker: at most 30 s, or ``generate_timeout_s`` if shorter; one still pending
        then is fetched, as the error it is, after the kill)."""
        pending, self._control = self._control, []
        if pending:
            done, pending = self._ray.wait(pending, num_returns=len(pending), timeout=min(30.0, self.cfg.generate_timeout_s))
            self._settle(done)
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001,S110 - already gone
                pass
        self.actors = []
        try:
            self._ray.kill(self._holder, no_restart=True)
        except Exception:  # noqa: BLE001,S110 - already gone
            pass
        for ref in pending:  # killed with the actor: fetched so that Ray does not print it as unhandled
            try:
                self._ray.get(ref, timeout=5)
            except Exception:  # noqa: BLE001,S110 - the expected ActorDiedError
                pass


__all__ = ["FactoryHolder", "RayRolloutWorkers", "RolloutActor"]


class _Generation:
    """One :meth:`RayRolloutWorkers.generate_detailed` call in progress: the chunks queued, the worker calls
    in flight (worker, chunk, start time), each worker's load, each request's attempts, and what has ended
    (completions, failed requests, requeue and failure counts)."""

    def __init__(self, workers: RayRolloutWorkers, reqs: list[GenerationRequest], finish_target: int | None) -> None:
        self.w, self.finish_target = workers, finish_target
        self.total = sum(expected_completions(r) for r in reqs)
        self.timeout = workers.cfg.generate_timeout_s
        self.attempts: collections.Counter[str] = collections.Counter()
        self.completions: list[Completion] = []
        self.failed: list[FailedRequest] = []
        self.queue: collections.deque[list[GenerationRequest]] = collections.deque(
            split_requests(reqs, max(1, len(workers._alive())))
        )
        self.inflight: dict[ObjectRef[list[Completion]], tuple[int, list[GenerationRequest], float]] = {}
        self.load: collections.Counter[int] = collections.Counter()
        self.requeued = self.failures = 0

    def target_of(self, chunk: list[GenerationRequest]) -> int | None:
        """The chunk's share of the finish target: ``ceil(finish_target * n / total)`` of its ``n`` expected
        completions, clamped to ``[1, n]``; None without a target."""
        if self.finish_target is None:
            return None
        n = sum(expected_completions(r) for r in chunk)
        return max(1, min(n, math.ceil(self.finish_target * n / max(self.total, 1))))

    def dispatch(self) -> None:
        """Submit every queued chunk to the least-loaded live worker (lowest index on ties), one attempt more
        for each of its requests; with no live worker, each request of the chunk fails."""
        w = self.w
        while self.queue:
            chunk = self.queue.popleft()
            alive = w._alive()
            if not alive:
                for r in chunk:
                    self.failed.append(FailedRequest(r, "no live rollout worker", self.attempts[r.request_id]))
                    w.counts["rollout/failed_requests"] += 1
                continue
            i = min(alive, key=lambda k: (self.load[k], k))
            for r in chunk:
                self.attempts[r.request_id] += 1
            ref: ObjectRef[list[Completion]] = w.actors[i].generate.remote(chunk, self.target_of(chunk), w._sync())
            self.inflight[ref] = (i, chunk, time.monotonic())
            self.load[i] += 1

    def collect(self) -> None:
        """Wait for the first in-flight call to answer (at most until the oldest one times out) and take the
        completions of every answered call; a call whose worker died goes to :meth:`on_failure`."""
        w = self.w
        oldest = min(t for _, _, t in self.inflight.values())
        ready, _ = w._ray.wait(list(self.inflight), num_returns=1,
                               timeout=max(0.0, oldest + self.timeout - time.monotonic()))
        for done in ready:
            i, chunk, _t = self.inflight.pop(done)
            self.load[i] -= 1
            try:
                self.completions.extend(w._ray.get(done, timeout=self.timeout))
            except w._errors as e:
                self.on_failure(i, chunk, f"rollout worker {w.names[i]} died mid-generation ({type(e).__name__})")

    def expire(self) -> None:
        """Abandon every in-flight call older than ``generate_timeout_s``: its worker is killed with restart (so
        it cannot answer later: no double count) and its chunk goes to :meth:`on_failure`."""
        w = self.w
        now = time.monotonic()
        for late, (i, chunk, t) in list(self.inflight.items()):
            if now - t >= self.timeout:
                self.inflight.pop(late)
                self.load[i] -= 1
                w.counts["rollout/timeouts"] += 1
                # Its call is abandoned: restart the worker so it cannot answer later (no double count).
                w._ray.kill(w.actors[i], no_restart=False)
                self.on_failure(i, chunk, f"rollout worker {w.names[i]} gave no answer within {self.timeout:g}s "
                                "(restarted)")

    def on_failure(self, i: int, chunk: list[GenerationRequest], reason: str) -> None:
        """Worker ``i`` failed ``chunk``: check it is alive again (:meth:`RayRolloutWorkers._check_alive`), then
        re-queue each request with attempts left (at most ``request_retries`` re-runs) as one chunk; the others
        fail with ``reason``."""
        w = self.w
        self.failures += 1
        w.counts["rollout/worker_failures"] += 1
        w._check_alive(i)
        retry = []
        for r in chunk:
            if self.attempts[r.request_id] <= w.cfg.request_retries:
                retry.append(r)
            else:
                self.failed.append(FailedRequest(r, reason, self.attempts[r.request_id]))
                w.counts["rollout/failed_requests"] += 1
        if retry:
            self.requeued += len(retry)
            w.counts["rollout/requeued_requests"] += len(retry)
            self.queue.append(retry)
