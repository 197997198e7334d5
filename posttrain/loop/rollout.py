"""The rollout driver: plans groups, advances them, suspends and resumes (partial rollout), emits whole groups.

One driver for every kind of rollout: a single-turn task is a one-turn episode. What differs by
kind is only how a group's members (samples or episodes) are started, advanced in one engine call
(or one call's turn rounds) and recorded as trajectories: a :class:`Player`
(:class:`~posttrain.loop.single_turn.SingleTurn`, :class:`~posttrain.loop.episode_rollout.EpisodeRollout`).
Everything else is here, once: how many fresh prompts a call draws, their group ids, the finish
target, which carried members are dropped instead of resumed, when a group is complete, and the
call's metrics. The producers of every system mode (:mod:`posttrain.loop.producer`) call
:meth:`Rollout.run_call`; ``posttrain check`` calls it too.

Partial rollout (``partial_fraction`` lambda < 1; Kimi k1.5, Kimi Team 2025, arXiv:2501.12599,
section 2.6.2): each call plans ``N*K`` members — the carried (suspended) ones plus fresh groups to
top up — and returns once ``ceil(lambda*N*K)`` have ended; the rest are suspended with their
per-token log-probs and versions and resumed in a later call, possibly under new weights. A carried
member whose version span would exceed ``max_version_span`` (or lag beyond ``max_staleness``) is
dropped instead of resumed, and counted. A group is emitted when all its (not dropped) members
have ended. Thread-compatible, not thread-safe: one thread at a time calls :meth:`Rollout.run_call`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Generic, Protocol, TypeVar

from posttrain.config import RunConfig
from posttrain.envs.task import TaskExample
from posttrain.trajectory import Status, Trajectory


class Member(Protocol):
    """A member of a group: a sample (single-turn) or an episode (multi-turn)."""

    @property
    def group_id(self) -> str: ...


M = TypeVar("M", bound=Member)


class Versioned(Protocol):
    """The engine as the driver reads it: the weights version it samples with."""

    @property
    def version(self) -> int: ...


class RolloutSource(Protocol):
    """What the driver reads of a run: its engine (read at every call) and its prompt stream."""

    @property
    def engine(self) -> Versioned: ...

    def next_prompts(self, n: int) -> list[TaskExample]:
        """The next ``n`` training prompts."""
        ...


@dataclasses.dataclass
class Group(Generic[M]):
    """One prompt's ``group_size`` members until all have ended (partial rollout keeps it open)."""

    group_id: str
    example: TaskExample
    call: int  # the call that opened it
    members: list[M]  # in member order; a dropped member leaves


@dataclasses.dataclass
class Advanced(Generic[M]):
    """What one call did to its members: each member it touched, in the order the engine answered
    (ended or not), the members that finished normally, and the player's own metrics."""

    members: list[M]
    finished: int
    info: dict[str, float]


class Player(Protocol[M]):
    """How one kind of member is started, advanced, suspended and recorded (see the module docstring)."""

    def start(self, group: Group[M], index: int, step: int, round_idx: int) -> list[M]:
        """The fresh members of ``group`` (the ``index``-th fresh group of slot ``step``, round ``round_idx``)."""
        ...

    def versions(self, member: M) -> list[int]:
        """The behaviour versions of the member's action tokens so far."""
        ...

    def ended(self, member: M) -> bool:
        """Whether the member has ended (finished, truncated or failed)."""
        ...

    def resume(self, member: M) -> None:
        """Prepare a carried member to run again in this call."""
        ...

    def suspend(self, member: M, call: int) -> None:
        """A member left unfinished by call ``call``: it is carried to the next call."""
        ...

    def advance(self, resumed: list[M], fresh: list[M], finish_target: int | None, call: int) -> Advanced[M]:
        """Run one call over the members (until ``finish_target`` of them have ended, or all)."""
        ...

    def emit(self, groups: list[Group[M]], call: int, step: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """The trajectories of complete ``groups`` (in order) and the recording metrics."""
        ...


class Rollout(Generic[M]):
    """Rollout calls over one :class:`Player`; emits complete groups (see the module docstring).

    ``cfg``: ``sampling.prompts_per_step`` (N), ``sampling.group_size`` (K),
    ``system.partial_fraction`` / ``max_version_span`` / ``max_staleness``,
    ``sampling.max_sampling_rounds``. ``run``: the engine and prompt stream; ``dropped``: members
    dropped before resume so far (a resumed run's count).
    """

    def __init__(self, cfg: RunConfig, run: RolloutSource, player: Player[M], dropped: int = 0) -> None:
        self.cfg, self.run, self.player = cfg, run, player
        self.N, self.K = cfg.sampling.prompts_per_step, cfg.sampling.group_size
        self.lam = cfg.system.partial_fraction
        self.groups: dict[str, Group[M]] = {}  # open groups, in creation order
        self.carry: list[M] = []  # suspended members waiting for the next call
        self.dropped = dropped  # carried members dropped instead of resumed, cumulative over the run

    def inflight(self) -> int:
        """Members begun but not emitted: suspended ones plus ended ones in open groups."""
        return sum(len(g.members) for g in self.groups.values())

    def _resume_carried(self, engine_version: int) -> tuple[list[M], int, int]:
        """The carried members to resume now; those past ``max_version_span`` / ``max_staleness`` if
        resumed leave their groups. Returns (resumed, dropped for span, dropped for lag)."""
        sysc = self.cfg.system
        resumed: list[M] = []
        drop_span = drop_stale = 0
        for m in self.carry:
            acted = self.player.versions(m)
            span = engine_version - min(acted) if acted else 0
            if sysc.max_version_span is not None and span > sysc.max_version_span:
                drop_span += 1
            elif sysc.max_staleness is not None and span > sysc.max_staleness:
                drop_stale += 1  # it could only be consumed older than max_staleness
            else:
                self.player.resume(m)
                resumed.append(m)
                continue
            self.groups[m.group_id].members.remove(m)
        self.carry = []
        self.dropped += drop_span + drop_stale
        return resumed, drop_span, drop_stale

    def run_call(self, call: int, *, round_idx: int = 0, n_prompts: int | None = None
                 ) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """One call: the carried members plus fresh groups of slot ``call`` (step ``call + 1``).

        ``n_prompts`` fresh prompts (default N, or with partial rollout topped up to ``N*K`` planned
        members), group ids ``s{step}r{round_idx}p{i}-{prompt_id}``; with lambda = 1 and nothing
        carried the call is the sync rollout of step ``call + 1``. Returns the groups completed by
        this call (in creation order) and the call's metrics. ``round_idx`` / ``n_prompts``: the
        dynamic-sampling rounds of one step (:meth:`run_dynamic`).
        """
        step = call + 1
        resumed, drop_span, drop_stale = self._resume_carried(int(getattr(self.run.engine, "version", 0)))
        n_fresh = self.N if self.lam >= 1.0 else max(0, self.N - len(resumed) // self.K)
        if n_fresh == 0 and not resumed:
            n_fresh = self.N
        if n_prompts is not None:
            n_fresh = n_prompts
        examples = self.run.next_prompts(n_fresh) if n_fresh else []
        t0 = time.perf_counter()  # time/rollout_s: starting the fresh members and the engine call(s)
        fresh: list[M] = []
        for i, ex in enumerate(examples):
            gid = f"s{step}r{round_idx}p{i}-{ex.prompt_id}"
            g: Group[M] = Group(gid, ex, call, [])
            self.groups[gid] = g
            g.members = self.player.start(g, i, step, round_idx)
            fresh.extend(g.members)
        planned = sum(not self.player.ended(m) for m in resumed + fresh)
        target = math.ceil(self.lam * self.N * self.K) if self.lam < 1.0 else None
        if target is not None and target >= planned:
            target = None  # nothing would be suspended
        adv = self.player.advance(resumed, fresh, target, call)
        t_roll = time.perf_counter() - t0
        for m in adv.members:
            if not self.player.ended(m):
                self.player.suspend(m, call)
                self.carry.append(m)
        complete = [g for g in self.groups.values() if g.members and all(self.player.ended(m) for m in g.members)]
        emptied = [g for g in self.groups.values() if not g.members]
        for g in complete + emptied:
            del self.groups[g.group_id]
        out, rinfo = self.player.emit(complete, call, step)
        info = {**adv.info, **rinfo}
        info.update({
            "time/rollout_s": t_roll,
            "sampling/rounds": 1.0,
            "rollout/calls": 1.0,
            "partial/lambda": float(self.lam),
            "partial/fresh_prompts": float(n_fresh),
            "partial/resumed": float(len(resumed)),
            "partial/finished": float(adv.finished),
            "partial/paused": float(len(self.carry)),
            "partial/dropped_span": float(drop_span),
            "staleness/dropped_before_resume": float(drop_stale),
            "partial/groups_completed": float(len(out)),
            "partial/groups_emptied": float(len(emptied)),
        })
        return out, info

    def run_dynamic(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476) for step ``step``: rounds of
        :meth:`run_call` until the batch holds ``prompts_per_step`` groups whose valid rewards differ,
        or ``sampling.max_sampling_rounds`` is reached.

        A group whose rewards are all equal carries no group signal and is dropped; infra errors
        are excluded from that judgement and stay in the batch (counted, never trained) as in every
        other call. The shortfall is reported (``sampling/shortfall_groups``), never hidden.
        """
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
                    out.extend(t for t in g if t.status is Status.INFRA_ERROR)
            need = self.N - kept
        info = merge_infos(infos)
        info.update({"sampling/rounds": float(rounds), "sampling/dropped_groups": float(dropped),
                     "sampling/shortfall_groups": float(max(need, 0))})
        return out, info


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
