"""How batches of trajectories are produced: the ``system.mode`` knob of the one training loop.

The loop (:func:`posttrain.loop.sync.train`) asks a producer for the next batch, updates, then
syncs weights inside :meth:`Producer.quiesce`. Three producers, one rollout machinery:

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

Partial rollout (``partial_fraction`` lambda < 1, every mode; Kimi k1.5, Kimi Team
2025, arXiv:2501.12599, section 2.6.2 "partial rollouts"): each call plans ``N*K`` samples —
the carried (paused) ones plus fresh prompts to top up — and returns once ``ceil(lambda*N*K)``
have finished (engine ``finish_target``); the rest are paused with their per-token log-probs and
versions and resumed in the next call, possibly under new weights. Paused is not truncated. In
async mode, while the staleness bound holds new prompts back, a call that only resumes the paused
samples may run (:meth:`ThreadedProducer._resume_only`): otherwise the learner could wait for groups
whose last samples are paused while the bound waits for the learner.

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
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from posttrain.config import RunConfig
from posttrain.loop.backends.base import generate_detailed
from posttrain.loop.rollout_stage import RolloutStage
from posttrain.rewards.scoring import score
from posttrain.trajectory import Trajectory

_WAIT_S = 0.05  # granularity of every bounded wait (stop flags are checked at least this often)


@dataclasses.dataclass
class Produced:
    """One batch for the learner: trajectories (group by group, in order) and rollout metrics."""

    trajectories: list[Trajectory]
    info: dict[str, float]
    dropped: list[Trajectory] = dataclasses.field(default_factory=list)  # stale, not trained, counted


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
# the rollout machinery shared by every mode


@dataclasses.dataclass
class _Sample:
    """A sample not handed to the learner yet: finished (waiting for its group) or paused."""

    completion: Any  # posttrain.rollout.types.Completion
    pauses: int = 0  # times this sample was paused
    first_pause_call: int | None = None


@dataclasses.dataclass
class _Group:
    group_id: str
    example: Any
    call: int
    expected: int  # samples still expected (K minus the dropped ones)
    done: dict[int, _Sample] = dataclasses.field(default_factory=dict)
    dropped: int = 0


class _InfraCompletion:
    """A sample whose request failed in the backend (no usable completion): becomes infra_error."""

    def __init__(self, completion: Any, reason: str) -> None:
        self.completion, self.reason = completion, reason
        self.request_id, self.sample_index = completion.request_id, completion.sample_index
        self.token_ids, self.versions = completion.token_ids, completion.versions

    def trajectory(self, traj_id: str, group_id: str, example: Any, spec: Any, task: Any,
                   meta: dict[str, Any]) -> Trajectory:
        from posttrain.trajectory import Reward, Status

        v = task.verifier
        return self.completion.to_trajectory(  # type: ignore[no-any-return]
            traj_id=traj_id, prompt_id=example.prompt_id, group_id=group_id, status=Status.INFRA_ERROR,
            reward=Reward(components={}, weights=dict(spec.weights), total=None), verifier=f"{v.name}@{v.version}",
            meta={**meta, "explanation": f"rollout infra error: {self.reason}"[:500]})


def _empty_completion(request: Any, sample_index: int) -> Any:
    from posttrain.rollout.types import Completion

    return Completion(request_id=request.request_id, sample_index=sample_index, prompt_ids=list(request.prompt_ids),
                      token_ids=[], logprobs=[], versions=[], finish_reason="paused", params=request.params,
                      seed=request.params.seed)


def _span(versions: list[int]) -> int:
    return (max(versions) - min(versions)) if versions else 0


class GroupRollout:
    """Rollout calls with carried paused samples; emits complete, scored groups (see module doc).

    Thread-compatible, not thread-safe: one thread at a time calls :meth:`run_call`.
    """

    def __init__(self, cfg: RunConfig, run: Any, stage: RolloutStage) -> None:
        self.cfg, self.run, self.stage = cfg, run, stage
        self.N, self.K = cfg.sampling.prompts_per_step, cfg.sampling.group_size
        self.lam = cfg.system.partial_fraction
        self.groups: dict[str, _Group] = {}  # open groups, in creation order
        self.carry: list[tuple[str, _Sample]] = []  # (group_id, paused sample)
        # paused samples dropped instead of resumed (span / staleness), cumulative over the run
        self.dropped = int(getattr(getattr(run, "state", None), "rollout_dropped", 0))

    def inflight(self) -> int:
        """Samples generated (fully or partly) but not emitted: carried plus finished in open groups."""
        return len(self.carry) + sum(len(g.done) for g in self.groups.values())

    def run_call(self, call: int, *, round_idx: int = 0, n_prompts: int | None = None
                 ) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """One engine call: fresh prompts of slot ``call`` (step ``call + 1``) + resumed samples.

        Returns the groups completed by this call (scored, in creation order) and the call's
        metrics. Fresh requests are exactly those of the sync loop (same ids and seeds), so with
        lambda = 1 and nothing carried the call is the sync rollout of step ``call + 1``.
        ``round_idx`` / ``n_prompts``: the dynamic-sampling rounds of one step (:meth:`run_dynamic`)
        draw ``n_prompts`` fresh prompts under their own request ids and seeds.
        """
        from posttrain.rollout.types import GenerationRequest

        run, cfg, syscfg = self.run, self.cfg, self.cfg.system
        step = call + 1
        engine_version = int(run.engine.version)
        info: dict[str, float] = {}
        # 1. carried samples: drop those whose span (or lag) already breaks a limit, resume the rest
        resumed: dict[str, tuple[str, _Sample]] = {}
        reqs: list[Any] = []
        drop_span = drop_stale = 0
        for gid, s in self.carry:
            c = s.completion
            span_if_resumed = engine_version - min(c.versions) if c.versions else 0
            if syscfg.max_version_span is not None and span_if_resumed > syscfg.max_version_span:
                drop_span += 1
                self._drop(gid)
                continue
            if syscfg.max_staleness is not None and span_if_resumed > syscfg.max_staleness:
                drop_stale += 1  # it could only be consumed older than max_staleness
                self._drop(gid)
                continue
            rid = f"{c.request_id}#{c.sample_index}"  # one sample per resumed request, unique ids
            resumed[rid] = (gid, s)
            reqs.append(GenerationRequest(request_id=rid, prompt_ids=list(c.prompt_ids), params=c.params,
                                          resume=dataclasses.replace(c, request_id=rid)))
        self.carry = []
        self.dropped += drop_span + drop_stale
        # 2. fresh prompts: N, or (partial rollout) topped up to N*K planned samples
        n_fresh = self.N if self.lam >= 1.0 else max(0, self.N - len(reqs) // self.K)
        if n_fresh == 0 and not reqs:
            n_fresh = self.N
        if n_prompts is not None:
            n_fresh = n_prompts
        fresh: list[Any] = []
        render = _renderer(run)
        if n_fresh:
            examples = run.next_prompts(n_fresh)
            seed = cfg.seed * 1_000_003 + step * 101 + round_idx
            for i, ex in enumerate(examples):
                rid = f"s{step}r{round_idx}p{i}-{ex.prompt_id}"
                fresh.append(GenerationRequest(request_id=rid, prompt_ids=render.ids(ex),
                                               params=dataclasses.replace(self.stage.sampling, seed=seed + i)))
                self.groups[rid] = _Group(rid, ex, call, self.K)
        all_reqs = fresh + reqs
        planned = n_fresh * self.K + len(reqs)
        target = math.ceil(self.lam * self.N * self.K) if self.lam < 1.0 else None
        if target is not None and target >= planned:
            target = None  # nothing would be paused
        before = {rid: len(s.completion.token_ids) for rid, (_, s) in resumed.items()}
        t0 = time.perf_counter()
        comps, failed = generate_detailed(run.engine, all_reqs, target)
        t_roll = time.perf_counter() - t0
        # A request that failed for infrastructure reasons (a distributed backend's dead worker) ends as
        # infra_error samples: counted, excluded from the update, never a zero reward.
        for f in failed:
            r = f.request
            if r.request_id in resumed:
                c = dataclasses.replace(r.resume, request_id=r.request_id)
                comps.append(_InfraCompletion(c, f.reason))
            else:
                for j in range(int(r.params.n)):
                    comps.append(_InfraCompletion(_empty_completion(r, j), f.reason))
        # 3. sort results: finished -> their group; paused -> carried to the next call
        new_tokens: list[int] = []
        finished_lens: list[int] = []
        paused_lens: list[int] = []
        n_finished = n_paused = 0
        for c in comps:
            infra = isinstance(c, _InfraCompletion)
            if c.request_id in resumed:
                gid, s = resumed[c.request_id]
                new_tokens.append(0 if infra else len(c.token_ids) - before[c.request_id])
                orig = s.completion.request_id
                c = (_InfraCompletion(dataclasses.replace(c.completion, request_id=orig), c.reason) if infra
                     else dataclasses.replace(c, request_id=orig))
            else:
                gid, s = c.request_id, _Sample(c)
                new_tokens.append(0 if infra else len(c.token_ids))
            s.completion = c
            if isinstance(c, _InfraCompletion):
                self.groups[gid].done[c.sample_index] = s
            elif c.finished:
                n_finished += 1
                finished_lens.append(len(c.token_ids))
                self.groups[gid].done[c.sample_index] = s
            else:
                n_paused += 1
                paused_lens.append(len(c.token_ids))
                s.pauses += 1
                if s.first_pause_call is None:
                    s.first_pause_call = call
                self.carry.append((gid, s))
        # 4. complete groups -> score (one verification batch), in creation order
        complete = [g for g in self.groups.values() if g.expected > 0 and len(g.done) >= g.expected]
        empty = [g for g in self.groups.values() if g.expected <= 0]
        for g in complete + empty:
            del self.groups[g.group_id]
        out: list[list[Trajectory]] = []
        t_rew = 0.0
        pause_ages: list[int] = []
        if complete:
            comps_out, exs, gids, tids, metas = [], [], [], [], []
            for g in complete:
                for idx in sorted(g.done):
                    s = g.done[idx]
                    c = s.completion
                    age = 0 if s.first_pause_call is None else call - s.first_pause_call
                    if s.pauses:
                        pause_ages.append(age)
                    comps_out.append(c)
                    exs.append(g.example)
                    gids.append(g.group_id)
                    tids.append(f"{g.group_id}/{c.sample_index}")
                    metas.append({"pauses": s.pauses, "pause_age": age, "version_span": _span(c.versions),
                                  "rollout_call": call, **render.record(g.example)})
            ok = [i for i, c in enumerate(comps_out) if not isinstance(c, _InfraCompletion)]
            trajs_ok: list[Trajectory] = []
            if ok:
                trajs_ok, rinfo = score([comps_out[i] for i in ok], [exs[i] for i in ok], task=run.task,
                                        tokenizer=run.tokenizer, spec=self.stage.spec, group_ids=[gids[i] for i in ok],
                                        step=step, verify_batch=run.verify_batch, traj_ids=[tids[i] for i in ok],
                                        metas=[metas[i] for i in ok])
                t_rew = rinfo["time/reward_s"]
            scored = dict(zip(ok, trajs_ok, strict=True))
            trajs = [scored[i] if i in scored else comps_out[i].trajectory(
                tids[i], gids[i], exs[i], self.stage.spec, run.task, metas[i]) for i in range(len(comps_out))]
            by_group: dict[str, list[Trajectory]] = {}
            for t in trajs:
                by_group.setdefault(t.group_id, []).append(t)
            out = [by_group[g.group_id] for g in complete]
        # 5. metrics of the call
        rows = len(comps)
        longest = max(new_tokens) if new_tokens else 0
        info.update({
            "time/rollout_s": t_roll,
            "time/reward_s": t_rew,
            "sampling/rounds": 1.0,
            "rollout/calls": 1.0,
            "rollout/new_tokens": float(sum(new_tokens)),
            "rollout/rows": float(rows),
            # Fraction of the call's sample-slots (rows x decode steps of its longest sample) in which
            # a sample had already finished and waited for the call's stragglers (the barrier's idle).
            "rollout/group_idle_frac": 1.0 - sum(new_tokens) / (rows * longest) if rows and longest else 0.0,
            "partial/lambda": float(self.lam),
            "partial/fresh_prompts": float(n_fresh),
            "partial/resumed": float(len(reqs)),
            "partial/finished": float(n_finished),
            "partial/paused": float(n_paused),
            "partial/dropped_span": float(drop_span),
            "staleness/dropped_before_resume": float(drop_stale),
            "partial/finished_len_mean": _mean(finished_lens),
            "partial/paused_len_mean": _mean(paused_lens),
            "partial/pause_age_mean": _mean(pause_ages),
            "partial/pause_age_max": float(max(pause_ages)) if pause_ages else 0.0,
            "partial/groups_completed": float(len(out)),
            "partial/groups_emptied": float(len(empty)),
        })
        return out, info

    def run_dynamic(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Dynamic sampling (DAPO) for step ``step``: rounds of :meth:`run_call` until the batch holds
        ``prompts_per_step`` groups whose valid rewards differ, or ``max_sampling_rounds`` is reached.

        A group whose rewards are all equal carries no group signal and is dropped; infra errors
        are excluded from that judgement and stay in the batch (counted, never trained) as in every
        other call. The shortfall is
        reported (``sampling/shortfall_groups``), never hidden.
        """
        from posttrain.trajectory import Status

        out: list[Trajectory] = []
        infos: list[dict[str, float]] = []
        kept = dropped = rounds = 0
        need = self.N
        while rounds < self.cfg.sampling.max_sampling_rounds and need > 0:
            groups, info = self.run_call(step - 1, round_idx=rounds, n_prompts=need)
            infos.append(info)
            rounds += 1
            for g in groups:
                rewards = {t.reward.total for t in g if t.status is not Status.INFRA_ERROR}
                if len(rewards) > 1 and kept < self.N:
                    kept += 1
                    out.extend(g)
                else:
                    dropped += 1
                    # Infra errors stay in the batch (excluded from the update, counted in
                    # status/infra_error) exactly as in a call without dynamic sampling.
                    out.extend(t for t in g if t.status is Status.INFRA_ERROR)
            need = self.N - kept
        info = merge_infos(infos)
        info.update({"sampling/rounds": float(rounds), "sampling/dropped_groups": float(dropped),
                     "sampling/shortfall_groups": float(max(need, 0))})
        return out, info

    def _drop(self, gid: str) -> None:
        g = self.groups.get(gid)
        if g is not None:
            g.expected -= 1
            g.dropped += 1


def _mean(xs: list[int] | list[float]) -> float:
    return float(sum(xs)) / len(xs) if xs else 0.0


def merge_infos(infos: list[dict[str, float]]) -> dict[str, float]:
    """Sum the counts / times of several calls; lambda and means are averaged, maxima maxed."""
    out: dict[str, float] = {}
    for k in sorted({k for d in infos for k in d}):
        vals = [d[k] for d in infos if k in d]
        if k.endswith(("_mean", "_frac")) or k == "partial/lambda":
            out[k] = sum(vals) / len(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        else:
            out[k] = float(sum(vals))
    return out


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


# ---------------------------------------------------------------------------------------------
# sync


class SyncProducer:
    """The barrier: each step's rollout runs inline under the weights of the previous update."""

    def __init__(self, cfg: RunConfig, run: Any, stage: RolloutStage, rollout: GroupRollout) -> None:
        self.cfg, self.run, self.stage, self.rollout = cfg, run, stage, rollout

    def next_batch(self, step: int) -> Produced:
        """Step ``step``'s trajectories (dynamic sampling, or one :meth:`GroupRollout.run_call`)."""
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

    def __init__(self, cfg: RunConfig, run: Any, rollout: GroupRollout) -> None:
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
        return self.mode == "async" and self._hold == 0 and bool(getattr(self.rollout, "carry", None))

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
                    self._call += 1
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
        """No call starts inside; async with ``interrupt_on_update`` also pauses the running one."""
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


def build_producer(cfg: RunConfig, run: Any) -> SyncProducer | ThreadedProducer:
    """The producer of ``cfg.system.mode`` over the run's engine, task and reward; with ``env.name``
    set its rollout is :class:`~posttrain.loop.episode_rollout.EpisodeRollout` (multi-turn episodes)."""
    stage = RolloutStage.from_config(cfg, run)
    rollout: Any = GroupRollout(cfg, run, stage)
    if cfg.env.name is not None:
        from posttrain.loop.episode_rollout import EpisodeRollout

        rollout = EpisodeRollout(cfg, run, stage)
    if cfg.system.mode == "sync":
        return SyncProducer(cfg, run, stage, rollout)
    return ThreadedProducer(cfg, run, rollout)


def _renderer(run: Any) -> Any:
    """The run's prompt renderer (a stand-in run without one renders raw text, as before chat templates)."""
    r = getattr(run, "renderer", None)
    if r is None:
        from posttrain.envs.prompt_render import PromptRenderer

        r = PromptRenderer(run.tokenizer)
    return r
