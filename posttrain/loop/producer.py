"""How batches of trajectories are produced: the ``system.mode`` knob of the one training loop.

The loop (:func:`posttrain.loop.training_loop.train`) asks a producer for the next batch, updates, then
syncs weights inside :meth:`Producer.quiesce`. Three producers, one rollout driver
(:class:`posttrain.loop.rollout.Rollout`, which also does partial rollout and dynamic sampling):

- ``sync`` (:class:`SyncProducer`): one rollout call per step, inline, under the weights of the
  previous update (the barrier). Dynamic sampling (DAPO) lives here only.
- ``one_step_off`` (:class:`ThreadedProducer`): a worker thread runs the call of step k+1 while
  step k updates; the engine takes the new weights after that call returns, so every sample has
  policy lag exactly 1 (except step 1). Deterministic.
- ``async`` (:class:`ThreadedProducer`): the worker streams finished *groups* into a bounded
  queue (``max_queue`` samples; a full queue blocks the worker, nothing is dropped); the learner
  takes ``prompts_per_step`` groups as they complete. A call is admitted only while its slot is at
  most ``max_staleness`` versions ahead of the policy (AReaL's bound, Fu et al. 2025,
  arXiv:2505.24298, section 5); with ``interrupt_on_update`` a weight update pauses the running
  generation and the unfinished samples resume under the new weights (AReaL's interruptible
  rollout). With ``max_staleness: 0`` nothing runs ahead and the run equals the sync run.

With partial rollout (``partial_fraction`` < 1) in async mode, while the staleness bound holds new
prompts back, a call that only resumes the carried samples may run
(:meth:`ThreadedProducer._resume_only`): otherwise the learner could wait for groups whose last
samples are paused while the bound waits for the learner.

Staleness controls at consumption (every mode): a sample whose oldest token lags the learner by
more than ``max_staleness`` versions is dropped and counted; a paused sample whose version span
would exceed ``max_version_span`` is dropped instead of being resumed, and counted. A group is
handed to the learner only when all its (not dropped) samples have finished: group advantages
wait for their own group only; single-rollout recipes (``group_size: 1``) have one-sample groups.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from posttrain.config import RunConfig
from posttrain.envs.task import TaskExample
from posttrain.loop.rollout import Rollout, merge_infos
from posttrain.loop.rollout_stage import RolloutRun, RolloutStage, build_rollout
from posttrain.trajectory import Status, Trajectory

_WAIT_S = 0.05  # granularity of every bounded wait (stop flags are checked at least this often)


@dataclasses.dataclass
class Produced:
    """One batch for the learner: trajectories (group by group, in order) and rollout metrics."""

    trajectories: list[Trajectory]
    info: dict[str, float]
    dropped: list[Trajectory] = dataclasses.field(default_factory=list)  # stale, not trained, counted


class RolloutCounters(Protocol):
    """The rollout counters a run keeps across a crash (:class:`~posttrain.loop.checkpointing.RunState`)."""

    rollout_calls: int  # rollout calls started (non-sync modes run ahead of the step)
    rollout_dropped: int  # carried members dropped before resuming


class _Versioned(Protocol):
    @property
    def version(self) -> int: ...


class PausableEngine(Protocol):
    """The engine as a producer uses it: its weights version, and pausing a running call."""

    @property
    def version(self) -> int: ...

    def pause(self) -> None:
        """Ask a running ``generate`` to return its unfinished samples as paused."""
        ...


class ProducerRun(Protocol):
    """What a producer reads and writes of a run (met by a training run's
    :class:`~posttrain.loop.sampling_lifecycle.SamplingSource`): the engine, the learner's version, the
    rollout counters and the prompt stream."""

    @property
    def engine(self) -> PausableEngine: ...

    @property
    def learner(self) -> _Versioned: ...

    @property
    def state(self) -> RolloutCounters: ...

    def next_prompts(self, n: int) -> list[TaskExample]:
        """The next ``n`` training prompts."""
        ...


class TrainingRun(RolloutRun, ProducerRun, Protocol):
    """What :func:`build_producer` reads of a run: the producer's parts and the rollout's."""


class Producer(Protocol):
    """What the loop needs from a producer (a distributed backend provides the same three calls)."""

    def next_batch(self, step: int) -> Produced:
        """The trajectories of ``step`` (blocks, with a deadline, until they are available)."""
        ...

    def quiesce(self) -> contextlib.AbstractContextManager[None]:
        """Context in which no rollout call starts (weight sync, evaluation)."""
        ...

    def close(self) -> int:
        """Stop background work; return the number of generated samples never consumed (discarded)."""
        ...


# ---------------------------------------------------------------------------------------------
# consumption-time staleness filter (all modes)


def oldest_version(t: Trajectory) -> int | None:
    """Oldest behaviour version over the action tokens (None without action tokens)."""
    acts = t.behavior_version[t.action_mask.astype(bool)]
    return int(acts.min()) if acts.size else None


def tag_and_filter(trajs: list[Trajectory], learner_version: int, max_staleness: int | None
                   ) -> tuple[list[Trajectory], list[Trajectory]]:
    """Set ``policy_lag = learner_version - oldest token version``; split into (kept, stale).

    A sample is stale when its lag exceeds ``max_staleness`` (None: never). AReaL's staleness
    bound (Fu et al. 2025, arXiv:2505.24298) applied per sample with per-token versions, so a
    resumed trajectory is judged by its oldest token.
    """
    kept: list[Trajectory] = []
    stale: list[Trajectory] = []
    for t in trajs:
        v = oldest_version(t)
        lag = 0 if v is None else learner_version - v
        t = t.replace(policy_lag=lag)
        (stale if max_staleness is not None and lag > max_staleness else kept).append(t)
    return kept, stale


def consume(produced: Produced) -> tuple[list[Trajectory], dict[str, float]]:
    """The learner's side of a produced batch: ``(usable, metrics)``.

    ``usable``: its trajectories less the ``infra_error`` and ``env_failure`` ones (no reward to learn from:
    counted in the step's ``status/*``, never trained); ``metrics``: the step's first figures, the rollout's
    ``info`` then :func:`consumption_metrics` of every trajectory and the stale ones dropped.
    """
    trajs = produced.trajectories
    usable = [t for t in trajs if t.status not in (Status.INFRA_ERROR, Status.ENV_FAILURE)]
    return usable, {**produced.info, **consumption_metrics(trajs, produced.dropped)}


def consumption_metrics(trajs: list[Trajectory], dropped: list[Trajectory]) -> dict[str, float]:
    """Policy lag, version span and staleness drops of one consumed batch.

    ``lag/mean|max`` and ``lag/count_0|1|2|3plus`` (histogram of ``policy_lag`` = learner version
    at consumption - oldest behaviour version of the sample); ``version_span/mean|max``
    (newest - oldest behaviour version within a sample); ``staleness/dropped_samples`` and
    ``staleness/dropped_tokens`` (samples over ``max_staleness``, not trained);
    ``staleness/accepted_token_frac`` = consumed action tokens / (consumed + dropped).
    """
    import numpy as np

    lags = [int(t.policy_lag or 0) for t in trajs]
    spans = []
    for t in trajs:
        v = t.behavior_version[t.action_mask.astype(bool)]
        spans.append(int(v.max() - v.min()) if v.size else 0)
    m: dict[str, float] = {
        "lag/mean": float(np.mean(lags)) if lags else 0.0,
        "lag/max": float(max(lags)) if lags else 0.0,
        "lag/count_0": float(sum(x == 0 for x in lags)),
        "lag/count_1": float(sum(x == 1 for x in lags)),
        "lag/count_2": float(sum(x == 2 for x in lags)),
        "lag/count_3plus": float(sum(x >= 3 for x in lags)),
        "version_span/mean": float(np.mean(spans)) if spans else 0.0,
        "version_span/max": float(max(spans)) if spans else 0.0,
    }
    kept_tok = sum(t.num_actions for t in trajs)
    drop_tok = sum(t.num_actions for t in dropped)
    m["staleness/dropped_samples"] = float(len(dropped))
    m["staleness/dropped_tokens"] = float(drop_tok)
    m["staleness/accepted_token_frac"] = kept_tok / (kept_tok + drop_tok) if kept_tok + drop_tok else 1.0
    return m


# ---------------------------------------------------------------------------------------------
# sync


class SyncProducer:
    """The barrier: each step's rollout runs inline under the weights of the previous update."""

    def __init__(self, cfg: RunConfig, run: ProducerRun, rollout: Rollout[Any]) -> None:
        self.cfg, self.run, self.rollout = cfg, run, rollout

    def next_batch(self, step: int) -> Produced:
        """Step ``step``'s trajectories (dynamic sampling, or one :meth:`Rollout.run_call`)."""
        if self.cfg.sampling.dynamic_sampling:
            trajs, info = self.rollout.run_dynamic(step)
        else:
            groups, info = self.rollout.run_call(step - 1)
            trajs = [t for g in groups for t in g]
        self.run.state.rollout_calls = step
        self.run.state.rollout_dropped = self.rollout.dropped
        kept, stale = tag_and_filter(trajs, self.run.learner.version, self.cfg.system.max_staleness)
        return Produced(kept, info, stale)

    def quiesce(self) -> contextlib.AbstractContextManager[None]:
        """Nothing runs in the background: a no-op."""
        return contextlib.nullcontext()

    def close(self) -> int:
        """Return the carried samples (partial rollout) that were never consumed."""
        return self.rollout.inflight()


# ---------------------------------------------------------------------------------------------
# one_step_off and async


class SampleQueue:
    """FIFO of groups bounded by a number of *samples*; puts block (bounded waits), never drop.

    ``put`` waits while the queue is non-empty and the group would overflow ``max_samples``
    (a group larger than the bound still goes into an empty queue, so nothing can deadlock).
    """

    def __init__(self, max_samples: int | None) -> None:
        self.max_samples = max_samples
        self._items: collections.deque[tuple[list[Trajectory], int]] = collections.deque()
        self._cv = threading.Condition()
        self.samples = 0
        self.blocked_s = 0.0
        self.blocked_puts = 0
        self.max_depth = 0

    def put(self, group: list[Trajectory], stop: threading.Event) -> bool:
        """Append ``group``; blocks while full. Returns False (not queued) if ``stop`` is set."""
        n = len(group)
        t0 = time.perf_counter()
        blocked = False
        with self._cv:
            while self._items and self.max_samples is not None and self.samples + n > self.max_samples:
                if stop.is_set():
                    return False
                blocked = True
                self._cv.wait(_WAIT_S)
            if blocked:
                self.blocked_puts += 1
                self.blocked_s += time.perf_counter() - t0
            self._items.append((group, n))
            self.samples += n
            self.max_depth = max(self.max_depth, self.samples)
            self._cv.notify_all()
        return True

    def get(self, timeout_s: float) -> list[Trajectory] | None:
        """Pop the oldest group, waiting at most ``timeout_s`` (None on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, _WAIT_S))
            group, n = self._items.popleft()
            self.samples -= n
            self._cv.notify_all()
            return group

    def drain(self) -> int:
        """Discard everything; return the number of samples discarded."""
        with self._cv:
            n = self.samples
            self._items.clear()
            self.samples = 0
            self._cv.notify_all()
            return n


class ThreadedProducer:
    """A rollout worker thread feeding the learner (``one_step_off`` and ``async``; module doc).

    Admission: call ``c`` (the fresh prompts of slot ``c``, step ``c + 1``) starts only when
    ``engine.version >= c - eta`` (eta = 1 for one_step_off, ``max_staleness`` for async, no bound
    when None) and no :meth:`quiesce` is active. one_step_off hands the learner one call's groups
    per step; async hands it ``prompts_per_step`` groups in completion order.
    """

    def __init__(self, cfg: RunConfig, run: ProducerRun, rollout: Rollout[Any]) -> None:
        self.cfg, self.run, self.rollout = cfg, run, rollout
        sysc = cfg.system
        self.mode = sysc.mode
        self.eta: int | None = 1 if self.mode == "one_step_off" else sysc.max_staleness
        self.interrupt = self.mode == "async" and sysc.interrupt_on_update
        self.queue = SampleQueue(sysc.max_queue if self.mode == "async" else None)
        self._cv = threading.Condition()
        self._hold = 0
        self._infos: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._lost_on_stop = 0
        self._call = int(run.state.rollout_calls)
        self._thread = threading.Thread(target=self._work, name="posttrain-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ worker
    def _admitted(self, call: int) -> bool:
        if self.mode == "one_step_off" and call >= self.cfg.steps:
            return False  # one call per step: nothing beyond the last step
        return self._hold == 0 and (self.eta is None or int(self.run.engine.version) >= call - self.eta)

    def _resume_only(self) -> bool:
        """async + partial rollout: a call that only resumes the carried (paused) samples may run while
        the staleness bound holds new prompts back. Without it the learner could wait forever for
        groups whose last samples are paused (fewer than ``prompts_per_step`` groups completed by the
        admitted calls), while the bound waits for the learner. It starts no new slot, and resumed
        samples are still judged by ``max_staleness`` / ``max_version_span`` in the call."""
        return self.mode == "async" and self._hold == 0 and bool(self.rollout.carry)

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cv:
                    while not self._stop.is_set() and not self._admitted(self._call) and not self._resume_only():
                        self._cv.wait(_WAIT_S)
                    fresh = self._admitted(self._call)
                if self._stop.is_set():
                    return
                if fresh:
                    groups, info = self.rollout.run_call(self._call)
                    with self._cv:
                        self._call += 1
                        self._cv.notify_all()  # one_step_off's quiesce waits for this call
                else:  # the staleness bound holds new prompts back: finish the paused samples meanwhile
                    groups, info = self.rollout.run_call(self._call, n_prompts=0)
                self.run.state.rollout_calls = self._call
                self.run.state.rollout_dropped = self.rollout.dropped
                with self._cv:
                    self._infos.append(info)
                # one_step_off: one item per call (possibly empty under partial rollout: the step is skipped)
                items = [[t for g in groups for t in g]] if self.mode == "one_step_off" else groups
                for i, item in enumerate(items):
                    if not self.queue.put(item, self._stop):  # stopping: count what could not be queued
                        self._lost_on_stop += sum(len(x) for x in items[i:])
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the learner thread, which raises it
            self._error = e
            self._stop.set()

    # ------------------------------------------------------------------ learner side
    def _wait_for_calls(self, n: int) -> None:
        """Block until the worker has returned from ``n`` calls (bounded by ``system.queue_timeout_s``)."""
        deadline = time.monotonic() + self.cfg.system.queue_timeout_s
        with self._cv:
            while self._call < n and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the rollout call of the next step did not return within "
                                       f"system.queue_timeout_s={self.cfg.system.queue_timeout_s}s (mode {self.mode})")
                self._cv.wait(min(left, _WAIT_S))
        if self._error is not None:
            raise RuntimeError(f"rollout worker failed: {type(self._error).__name__}: {self._error}") from self._error

    def _get(self, deadline: float) -> list[Trajectory]:
        while True:
            if self._error is not None:
                raise RuntimeError(f"rollout worker failed: {type(self._error).__name__}: {self._error}") from self._error
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no finished group within system.queue_timeout_s={self.cfg.system.queue_timeout_s}s "
                                   f"(mode {self.mode}); the rollout worker is stuck or too slow")
            g = self.queue.get(min(left, 0.5))
            if g is not None:
                return g

    def next_batch(self, step: int) -> Produced:
        """Step ``step``'s groups from the queue; stale samples are dropped and counted."""
        deadline = time.monotonic() + self.cfg.system.queue_timeout_s
        version = int(self.run.learner.version)
        sysc = self.cfg.system
        kept: list[Trajectory] = []
        stale: list[Trajectory] = []
        t0 = time.perf_counter()
        if self.mode == "one_step_off":
            kept, stale = tag_and_filter(self._get(deadline), version, sysc.max_staleness)
        else:
            groups = 0
            while groups < self.cfg.sampling.prompts_per_step:
                k, s = tag_and_filter(self._get(deadline), version, sysc.max_staleness)
                stale.extend(s)
                if k:
                    kept.extend(k)
                    groups += 1
        wait = time.perf_counter() - t0
        with self._cv:
            if self.mode == "one_step_off":  # the consumed call's own metrics: the worker logs a call's
                infos = self._infos[:1]       # info before queueing its item, one item per call
                del self._infos[:1]
            else:
                infos, self._infos = self._infos, []
        info = merge_infos(infos) if infos else {}
        info.update({
            "time/learner_wait_s": wait,
            "queue/depth_samples": float(self.queue.samples),
            "queue/max_depth_samples": float(self.queue.max_depth),
            "queue/blocked_puts": float(self.queue.blocked_puts),
            "queue/blocked_s": float(self.queue.blocked_s),
        })
        return Produced(kept, info, stale)

    @contextlib.contextmanager
    def quiesce(self) -> Iterator[None]:
        """No call starts inside; async with ``interrupt_on_update`` also pauses the running one.

        one_step_off first waits until the call of the next step has returned (``min(v + 1, steps)``
        calls done, ``v`` = the learner's version): that call samples under the weights before this
        sync whatever the threads' timing, so every sample's lag is exactly 1 (a starved worker thread
        would otherwise start it after the sync, or sample part of it under the new weights)."""
        if self.mode == "one_step_off":
            self._wait_for_calls(min(int(self.run.learner.version) + 1, self.cfg.steps))
        with self._cv:
            self._hold += 1
        if self.interrupt:
            self.run.engine.pause()
        try:
            yield
        finally:
            with self._cv:
                self._hold -= 1
                self._cv.notify_all()

    def close(self) -> int:
        """Stop the worker (pausing its call), join it with a timeout; return discarded samples."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self.run.engine.pause()
        self._thread.join(timeout=120)
        if self._thread.is_alive():
            raise RuntimeError("rollout worker did not stop within 120 s")
        return self.queue.drain() + self.rollout.inflight() + self._lost_on_stop


def build_producer(cfg: RunConfig, run: TrainingRun) -> SyncProducer | ThreadedProducer:
    """The producer of ``cfg.system.mode`` over the run's rollout driver (:func:`build_rollout`: single-turn
    samples, or multi-turn episodes with ``env.name`` set)."""
    rollout = build_rollout(cfg, run, RolloutStage.from_config(cfg))
    if cfg.system.mode == "sync":
        return SyncProducer(cfg, run, rollout)
    return ThreadedProducer(cfg, run, rollout)
