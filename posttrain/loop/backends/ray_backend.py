"""The Ray backend: rollout workers, reward workers and (optionally) the learner as Ray actors.

Same interface as :mod:`posttrain.loop.backends.local` (see :mod:`posttrain.loop.backends.base`).

Weights (:meth:`RayRolloutWorkers.broadcast_weights`): the driver (or the learner actor, see
:meth:`RayLearner.publish_weights`) packs the state dict ONCE into a
:class:`~posttrain.rollout.weight_transfer.WeightPacket`, ``ray.put``s it, and every worker pulls
the same object (zero-copy on a node) and verifies version + checksum against the values sent in
the call, before touching a parameter. The driver waits at most ``transfer_timeout_s`` and then
raises :class:`WeightTransferError` naming the workers that did not confirm — it never hangs. A
worker that was dead during the broadcast is not an error: every ``generate`` call carries the
latest (version, checksum, object ref), and a worker holding another version loads and verifies
it before sampling (this is also how a restarted actor, rebuilt at version 0, catches up).

Faults (:meth:`RayRolloutWorkers.generate_detailed`): actors are created with ``max_restarts`` and
``max_task_retries``, so Ray restarts a dead worker and re-runs its in-flight call on the new
process. When Ray gives up (or a call exceeds ``generate_timeout_s``: the worker is then
killed with restart), the driver re-queues the call's requests on a live worker up to
``request_retries`` times, after which each request is a :class:`FailedRequest` — the loop
records it as ``infra_error``, never as a zero reward. Every call ends with
:func:`check_exactly_once`: no request lost, none double-counted.

Placement: ``colocated`` puts every worker's bundle in one placement group (``PACK``: the
same node when it fits); ``disaggregated`` gives each role its own group, rollout workers
``SPREAD`` over nodes. Bundles are CPUs/GPUs/custom resources from :class:`RayBackendConfig`,
so a multi-node run changes only ``address`` and the worker counts.
"""

from __future__ import annotations

import collections
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from posttrain.loop.backends.base import (
    Backend,
    FailedRequest,
    RolloutInfraError,
    RolloutResult,
    check_exactly_once,
    expected_completions,
    order_completions,
    split_requests,
)
from posttrain.loop.backends.config import RayBackendConfig
from posttrain.loop.backends.local import LocalRewardWorkers
from posttrain.loop.backends.worker import RolloutWorker, install_alarm_handler, merge_counts, verify_items
from posttrain.rewards.pool import Item
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.rollout.weight_transfer import WeightPacket, WeightTransferError, pack_state_dict

RAY_INSTALL_HINT = "the Ray backend needs ray: pip install 'posttrain[ray]'"


def require_ray() -> Any:
    """``import ray`` or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised by test_import_guard via a blocked import
        raise ImportError(RAY_INSTALL_HINT) from e
    return ray


def _infra_errors() -> tuple[type[BaseException], ...]:
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


def wait_alive(actor: Any, timeout_s: float) -> str | None:
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
        except (*_infra_errors(), rex.GetTimeoutError) as e:
            return f"{type(e).__name__}: {e}"[:300]


# ---------------------------------------------------------------------------- actors (bodies)
class RolloutActor:
    """Actor body around :class:`RolloutWorker` (decorated with ``ray.remote`` at build time)."""

    def __init__(self, holder_name: str, name: str, crash_marker: str | None, torch_threads: int) -> None:
        import ray

        torch.set_num_threads(max(1, torch_threads))
        # The factory (it carries the model's weights) comes from the named holder actor, not as a
        # constructor argument: Ray cannot re-read an object-store argument on a restart (ray#53727), and
        # a handle argument counts as one; the name is a plain string.
        engine_factory: Any = ray.get(ray.get_actor(holder_name).get.remote())  # Callable[[], RolloutEngine]
        self.worker: RolloutWorker = RolloutWorker(engine_factory, name, crash_marker)

    def info(self) -> dict[str, Any]:
        """Name, pid, version, loads."""
        return self.worker.info()

    def load_weights(self, box: list[Any], version: int, checksum: str, timeout_s: float) -> dict[str, float]:
        """Pull ``box[0]`` (an ObjectRef to a WeightPacket), verify, load; timings."""
        import ray

        t0 = time.perf_counter()
        packet: WeightPacket = ray.get(box[0], timeout=timeout_s)
        out = self.worker.load_packet(packet, version, checksum)
        return {"fetch_s": time.perf_counter() - t0 - out["verify_s"] - out["load_s"], **out}

    def generate(self, requests: list[GenerationRequest], finish_target: int | None,
                 sync: tuple[int, str, list[Any], float] | None) -> list[Completion]:
        """Catch up to the driver's weights (``sync``) if needed, then generate."""
        import ray

        if sync is not None:
            version, checksum, box, timeout_s = sync
            self.worker.ensure_version(version, checksum, lambda: ray.get(box[0], timeout=timeout_s))
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


class RewardActor:
    """Actor body: verifies item chunks with per-item time limits and retries."""

    def __init__(self, name: str, timeout_s: float, retries: int) -> None:
        self.name, self.timeout_s, self.retries = name, timeout_s, retries
        self.alarm = install_alarm_handler()

    def verify(self, items: list[Item]) -> list[tuple[Verdict, dict[str, int]]]:
        """See :func:`~posttrain.loop.backends.worker.verify_items`."""
        return verify_items(items, self.timeout_s if self.alarm else None, self.retries)

    def info(self) -> dict[str, Any]:
        """Name, pid, whether SIGALRM time limits are active."""
        return {"name": self.name, "pid": os.getpid(), "alarm": self.alarm}


class LearnerActor:
    """Actor body around a learner built by ``learner_factory()`` (e.g. a :class:`PolicyLearner`)."""

    def __init__(self, learner_factory: Callable[[], Any], torch_threads: int) -> None:
        torch.set_num_threads(max(1, torch_threads))
        self.learner = learner_factory()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``learner.<method>(*args, **kwargs)``."""
        return getattr(self.learner, method)(*args, **kwargs)

    def publish_weights(self) -> tuple[list[Any], int, str, int]:
        """Pack ``weights_for_rollout()`` at the learner's version and ``ray.put`` it here (the data
        never passes through the driver); returns ``([ref], version, checksum, nbytes)``."""
        import ray

        packet = pack_state_dict(self.learner.weights_for_rollout(), int(self.learner.version))
        return [ray.put(packet)], packet.version, packet.checksum, packet.nbytes

    def info(self) -> dict[str, Any]:
        """pid and version."""
        return {"pid": os.getpid(), "version": int(getattr(self.learner, "version", 0))}


# ---------------------------------------------------------------------------- placement
class Placement:
    """Placement groups for the roles; ``strategy(role, i)`` gives an actor its bundle."""

    def __init__(self, cfg: RayBackendConfig, *, learner: bool) -> None:
        ray = require_ray()
        from ray.util import placement_group

        def bundle(cpus: float, gpus: float, extra: Mapping[str, float]) -> dict[str, float]:
            b = {"CPU": cpus, **extra}
            if gpus:
                b["GPU"] = gpus
            return b

        roles: dict[str, list[dict[str, float]]] = {
            "rollout": [bundle(cfg.cpus_per_rollout_worker, cfg.gpus_per_rollout_worker, cfg.rollout_resources)]
            * cfg.num_rollout_workers,
            "reward": [bundle(cfg.cpus_per_reward_worker, 0.0, {})] * cfg.num_reward_workers,
            "learner": [bundle(cfg.cpus_per_learner, cfg.gpus_per_learner, cfg.learner_resources)] if learner else [],
        }
        self.groups: dict[str, tuple[Any, int]] = {}
        pgs: list[Any] = []
        # Names must be unique in a cluster: two runs (or a run and a test fixture) may share one.
        tag = uuid.uuid4().hex[:8]
        if cfg.placement == "colocated":
            bundles = [b for r in ("rollout", "reward", "learner") for b in roles[r]]
            pg = placement_group(bundles, strategy="PACK", name=f"posttrain-colocated-{tag}")
            pgs.append(pg)
            offset = 0
            for r in ("rollout", "reward", "learner"):
                self.groups[r] = (pg, offset)
                offset += len(roles[r])
        else:
            for r, strategy in (("rollout", "SPREAD"), ("reward", "SPREAD"), ("learner", "PACK")):
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

    def strategy(self, role: str, i: int) -> Any:
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


# ---------------------------------------------------------------------------- rollout
class RayRolloutWorkers:
    """Rollout worker actors behind one engine-shaped handle (see the module docstring).

    ``engine_factory`` is a picklable zero-argument callable returning a RolloutEngine (e.g.
    :func:`builtin_engine_factory`); each actor calls it once (and again after a restart).
    ``crash_markers[i]`` arms worker ``i``'s fault-injection hook (tests only).
    """

    def __init__(self, engine_factory: Callable[[], RolloutEngine], cfg: RayBackendConfig,
                 placement: Placement | None = None, crash_markers: Sequence[str | None] | None = None) -> None:
        ray = require_ray()
        self.cfg = cfg
        self._ray = ray
        self._errors = _infra_errors()
        markers = list(crash_markers or [None] * cfg.num_rollout_workers)
        cls = ray.remote(concurrency_groups={"control": 1})(RolloutActor)
        # Held for the backend's lifetime by an actor that never restarts: a restarted rollout actor fetches
        # the factory from it again (an object-store constructor argument would not survive, ray#53727).
        holder_name = f"posttrain-engine-factory-{uuid.uuid4().hex[:12]}"
        self._holder = ray.remote(FactoryHolder).options(name=holder_name, num_cpus=0, max_restarts=0).remote(
            engine_factory)
        self.names = [f"rollout-{i}" for i in range(cfg.num_rollout_workers)]
        self.actors: list[Any] = []
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
        self._latest: tuple[int, str, list[Any]] | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        self._control: list[Any] = []  # pause calls not yet answered (see pause / close)

    # ------------------------------------------------------------------ helpers
    def _get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        ready, not_ready = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if not_ready:
            raise TimeoutError(f"rollout workers: {len(not_ready)} of {len(refs)} did not answer '{what}' "
                               f"within {timeout_s:g}s")
        return list(self._ray.get(refs, timeout=timeout_s))

    def info(self, timeout_s: float | None = None) -> list[dict[str, Any] | None]:
        """``info()`` of every worker (``None`` for a dead one); waits at most ``timeout_s``."""
        t = timeout_s or self.cfg.startup_timeout_s
        out: list[dict[str, Any] | None] = []
        for i, a in enumerate(self.actors):
            try:
                out.append(self._ray.get(a.info.remote(), timeout=t))
            except self._errors:
                self.dead.add(i)
                out.append(None)
        return out

    def _sync(self) -> tuple[int, str, list[Any], float] | None:
        if self._latest is None:
            return None
        v, c, box = self._latest
        return v, c, box, self.cfg.transfer_timeout_s

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
        """
        reqs = list(requests)
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ValueError("generate: duplicate request_id in one call")
        total = sum(expected_completions(r) for r in reqs)
        attempts: collections.Counter[str] = collections.Counter()
        completions: list[Completion] = []
        failed: list[FailedRequest] = []
        queue: collections.deque[list[GenerationRequest]] = collections.deque(
            split_requests(reqs, max(1, len(self._alive())))
        )
        inflight: dict[Any, tuple[int, list[GenerationRequest], float]] = {}
        load: collections.Counter[int] = collections.Counter()
        requeued = failures = 0
        timeout = self.cfg.generate_timeout_s

        def target_of(chunk: list[GenerationRequest]) -> int | None:
            if finish_target is None:
                return None
            n = sum(expected_completions(r) for r in chunk)
            return max(1, min(n, math.ceil(finish_target * n / max(total, 1))))

        def on_failure(i: int, chunk: list[GenerationRequest], reason: str) -> None:
            nonlocal requeued, failures
            failures += 1
            self.counts["rollout/worker_failures"] += 1
            self._check_alive(i)
            retry = []
            for r in chunk:
                if attempts[r.request_id] <= self.cfg.request_retries:
                    retry.append(r)
                else:
                    failed.append(FailedRequest(r, reason, attempts[r.request_id]))
                    self.counts["rollout/failed_requests"] += 1
            if retry:
                requeued += len(retry)
                self.counts["rollout/requeued_requests"] += len(retry)
                queue.append(retry)

        while queue or inflight:
            while queue:
                chunk = queue.popleft()
                alive = self._alive()
                if not alive:
                    for r in chunk:
                        failed.append(FailedRequest(r, "no live rollout worker", attempts[r.request_id]))
                        self.counts["rollout/failed_requests"] += 1
                    continue
                i = min(alive, key=lambda k: (load[k], k))
                for r in chunk:
                    attempts[r.request_id] += 1
                ref = self.actors[i].generate.remote(chunk, target_of(chunk), self._sync())
                inflight[ref] = (i, chunk, time.monotonic())
                load[i] += 1
            if not inflight:
                break
            oldest = min(t for _, _, t in inflight.values())
            ready, _ = self._ray.wait(list(inflight), num_returns=1,
                                      timeout=max(0.0, oldest + timeout - time.monotonic()))
            for ref in ready:
                i, chunk, _t = inflight.pop(ref)
                load[i] -= 1
                try:
                    completions.extend(self._ray.get(ref, timeout=timeout))
                except self._errors as e:
                    on_failure(i, chunk, f"rollout worker {self.names[i]} died mid-generation ({type(e).__name__})")
            now = time.monotonic()
            for ref, (i, chunk, t) in list(inflight.items()):
                if now - t >= timeout:
                    inflight.pop(ref)
                    load[i] -= 1
                    self.counts["rollout/timeouts"] += 1
                    # Its call is abandoned: restart the worker so it cannot answer later (no double count).
                    self._ray.kill(self.actors[i], no_restart=False)
                    on_failure(i, chunk, f"rollout worker {self.names[i]} gave no answer within {timeout:g}s (restarted)")
        completions = order_completions(reqs, completions)
        check_exactly_once(reqs, completions, failed)
        self.counts["rollout/requests"] += len(reqs)
        return RolloutResult(completions, failed, requeued=requeued, worker_failures=failures)

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

    def _settle(self, refs: list[Any]) -> None:
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

    def broadcast_ref(self, box: list[Any], version: int, checksum: str) -> dict[str, float]:
        """Every live worker loads the packet ``box[0]`` (already in the object store) and verifies it.

        Raises :class:`WeightTransferError` naming the workers that failed verification or did not
        confirm within ``transfer_timeout_s``. A worker that died meanwhile is counted
        (``rollout/deferred_syncs``): it verifies and loads before its next generate.
        """
        t0 = time.perf_counter()
        tmo = self.cfg.transfer_timeout_s
        calls = {self.actors[i].load_weights.remote(box, version, checksum, tmo): i for i in self._alive()}
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
                raise WeightTransferError(f"rollout worker {self.names[i]} rejected weights v{version}: {e}") from e
        self._latest = (int(version), checksum, box)
        self.version = int(version)
        self.counts["rollout/weight_syncs"] += 1
        out = {"transfer/broadcast_s": time.perf_counter() - t0, "transfer/workers": float(len(stats))}
        if stats:
            out["transfer/fetch_s_max"] = max(s["fetch_s"] for s in stats)
            out["transfer/verify_s_max"] = max(s["verify_s"] for s in stats)
            out["transfer/load_s_max"] = max(s["load_s"] for s in stats)
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Engine protocol: :meth:`broadcast_weights` (``version=None`` -> current + 1)."""
        self.broadcast_weights(state_dict, self.version + 1 if version is None else int(version))

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


# ---------------------------------------------------------------------------- reward
class RayRewardWorkers:
    """Verifier actors: items split over workers; a worker that dies has its items re-queued
    (``request_retries`` times) and then each is an ``infra_error`` verdict, counted."""

    def __init__(self, cfg: RayBackendConfig, placement: Placement | None = None) -> None:
        ray = require_ray()
        self.cfg, self._ray = cfg, ray
        self._failures: tuple[type[BaseException], ...] = (*_infra_errors(), TimeoutError)
        cls = ray.remote(RewardActor)
        self.names = [f"reward-{i}" for i in range(cfg.num_reward_workers)]
        self.actors = []
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
            inflight: dict[Any, tuple[int, list[int], float]] = {}
            while queue:
                w, idx = queue.popleft()
                for j in idx:
                    tries[j] += 1
                ref = self.actors[w].verify.remote([items[j] for j in idx])
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


# ---------------------------------------------------------------------------- learner
class RayLearner:
    """A learner in its own actor; every call bounded by ``learner_timeout_s``.

    ``learner_factory()`` builds e.g. a :class:`~posttrain.learner.actor.PolicyLearner` inside the
    actor. :meth:`publish_weights` + :meth:`RayRolloutWorkers.broadcast_ref` move weights from the
    learner to the rollout workers without passing through the driver.
    """

    def __init__(self, learner_factory: Callable[[], Any], cfg: RayBackendConfig,
                 placement: Placement | None = None) -> None:
        ray = require_ray()
        self.cfg, self._ray = cfg, ray
        opts: dict[str, Any] = dict(num_cpus=cfg.cpus_per_learner, num_gpus=cfg.gpus_per_learner, max_restarts=0)
        if cfg.learner_resources:
            opts["resources"] = dict(cfg.learner_resources)
        if placement is not None:
            opts["scheduling_strategy"] = placement.strategy("learner", 0)
        self.actor = ray.remote(LearnerActor).options(**opts).remote(
            learner_factory, max(1, math.floor(cfg.cpus_per_learner))
        )
        ray.get(self.actor.info.remote(), timeout=cfg.startup_timeout_s)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``learner.<method>(...)`` in the actor, bounded by ``learner_timeout_s``."""
        return self._ray.get(self.actor.call.remote(method, *args, **kwargs), timeout=self.cfg.learner_timeout_s)

    def compute_logprobs(self, batch: Any) -> torch.Tensor:
        """``PolicyLearner.compute_logprobs``."""
        return self.call("compute_logprobs", batch)  # type: ignore[no-any-return]

    def update(self, batch: Any, advantages: torch.Tensor, *, old_logprob: torch.Tensor | None = None) -> dict[str, float]:
        """``PolicyLearner.update``."""
        return self.call("update", batch, advantages, old_logprob=old_logprob)  # type: ignore[no-any-return]

    @property
    def version(self) -> int:
        """The learner's version."""
        return int(self._ray.get(self.actor.info.remote(), timeout=self.cfg.learner_timeout_s)["version"])

    def publish_weights(self) -> tuple[list[Any], int, str, int]:
        """``([ref], version, checksum, nbytes)`` of the learner's rollout weights, put by the learner."""
        return self._ray.get(self.actor.publish_weights.remote(), timeout=self.cfg.transfer_timeout_s)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Kill the actor."""
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001,S110
            pass


# ---------------------------------------------------------------------------- factories
class _BuiltinFactory:
    """Picklable engine factory: a CPU copy of the model's config + weights, engine kwargs."""

    def __init__(self, model: torch.nn.Module, engine_kwargs: Mapping[str, Any]) -> None:
        self.config = model.config
        self.cls = type(model)
        self.state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
        self.dtype = next(model.parameters()).dtype
        self.engine_kwargs = dict(engine_kwargs)

    def __call__(self) -> RolloutEngine:
        from posttrain.rollout.builtin import BuiltinEngine

        model = self.cls(self.config).to(self.dtype)
        model.load_state_dict(self.state)
        return BuiltinEngine(model.eval(), **self.engine_kwargs)


def builtin_engine_factory(model: torch.nn.Module, **engine_kwargs: Any) -> Callable[[], RolloutEngine]:
    """A picklable factory building a :class:`BuiltinEngine` on a copy of ``model`` (weights at call time).

    ``engine_kwargs`` go to ``BuiltinEngine`` (``eos_token_id``, ``max_batch_size``, ...; no tokenizer
    object needed unless stop strings are used — then pass a picklable tokenizer).
    """
    return _BuiltinFactory(model, engine_kwargs)


def build_ray_backend(
    engine_factory: Callable[[], RolloutEngine],
    cfg: RayBackendConfig,
    *,
    learner_factory: Callable[[], Any] | None = None,
    crash_markers: Sequence[str | None] | None = None,
) -> Backend:
    """Start/join the cluster, reserve placement, start the actors; a :class:`Backend` of kind ``"ray"``.

    ``Backend.close()`` kills the actors, releases the placement groups and shuts Ray down if this
    call started it.
    """
    started = init_ray(cfg)
    placement = Placement(cfg, learner=learner_factory is not None)
    try:
        rollout = RayRolloutWorkers(engine_factory, cfg, placement, crash_markers)
        reward: Any = (RayRewardWorkers(cfg, placement) if cfg.num_reward_workers
                       else LocalRewardWorkers(0, cfg.verify_timeout_s, cfg.verify_retries))
        learner = RayLearner(learner_factory, cfg, placement) if learner_factory is not None else None
    except BaseException:
        placement.remove()
        if started:
            require_ray().shutdown()
        raise
    return _RayBackend(kind="ray", rollout=rollout, reward=reward, learner=learner,
                       placement=placement, started=started)


class _RayBackend(Backend):
    """:class:`Backend` that also releases placement groups and (if it started it) the cluster."""

    def __init__(self, *, placement: Placement, started: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self.placement, self.started = placement, started

    def close(self) -> None:
        """Actors, placement groups, and the cluster when this backend started it."""
        super().close()
        self.placement.remove()
        if self.started:
            require_ray().shutdown()
            self.started = False
