"""Single-turn rollout: the :class:`SingleTurn` player of the rollout driver, and :func:`play_once`.

A single-turn task is a one-turn episode: :class:`SingleTurn` tells the driver
(:class:`~posttrain.loop.rollout.Rollout`) how its members — samples — are requested (one
request of ``group_size`` samples per fresh group, one request per resumed sample), advanced (one
engine call, returning at the driver's finish target) and scored (one verification batch for the
groups a call completes).

:func:`play_once` is a thin call through the same player: one group per prompt, named by its
request id and sampled with the caller's ``params`` (:meth:`SingleTurn.request`), one engine call
without a finish target (:meth:`SingleTurn.advance`, so a request that failed in a distributed
backend — a :class:`~posttrain.loop.backends.base.FailedRequest`, or the
:class:`~posttrain.loop.backends.base.RolloutInfraError` of a plain ``generate`` — ends as
``infra_error`` samples, as in training), then one guarded verification batch
(:meth:`SingleTurn.played`, :func:`posttrain.rewards.scoring.judge`). Held-out evaluation
(:func:`posttrain.loop.heldout.evaluate`), ReMax's greedy baseline
(:func:`posttrain.loop.targets.greedy_baseline`), rejection sampling and ``posttrain check`` call it
with their own request ids and sampling settings.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from posttrain.envs.task import TaskExample
from posttrain.loop.backends.base import FailedRequest, RolloutInfraError, generate_detailed
from posttrain.loop.rollout import Advanced, Group
from posttrain.rewards.scoring import (
    Decoder,
    HasVerifier,
    ScoredCompletion,
    ScoringSpec,
    VerifyBatch,
    judge,
    to_trajectories,
)
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.rewards.verifier import Verifier
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.trajectory import Reward, Status, Trajectory
from posttrain.trajectory.record import JSONScalar


class Sampled(ScoredCompletion, Protocol):
    """A completion naming its request (met by :class:`~posttrain.rollout.types.Completion`)."""

    @property
    def request_id(self) -> str: ...


class Sampler(Protocol):
    """The engine as a one-shot rollout uses it (met by every :class:`~posttrain.rollout.engine.RolloutEngine`)."""

    def generate(self, requests: Sequence[GenerationRequest]) -> Sequence[Sampled]:
        """Completions of ``requests``: ``params.n`` per request (engine contract)."""
        ...


class Renderer(Protocol):
    """How a prompt becomes token ids (met by :class:`~posttrain.envs.prompt_render.PromptRenderer`)."""

    def ids(self, example: TaskExample) -> list[int]:
        """Prompt token ids of ``example``."""
        ...

    def record(self, example: TaskExample) -> dict[str, str]:
        """What the ledger records about the rendering of ``example``."""
        ...


@dataclasses.dataclass(frozen=True)
class Played:
    """The judged samples of :func:`play_once`, in request order, each request's samples by sample index
    (``rows[i]``: the prompt of sample ``i``). A sample whose request failed in the backend
    (``failed[i]``) has an empty completion, an empty text and an ``infra_error`` verdict."""

    completions: list[Sampled]
    rows: list[int]
    examples: list[TaskExample]  # examples[i] is the prompt of completions[i]
    request_ids: list[str]  # the request of each sample
    texts: list[str]
    verdicts: list[Verdict]
    failed: list[bool]  # failed[i]: sample i's request failed in the backend (no response)

    def trajectories(self, *, verifier: Verifier, spec: ScoringSpec,
                     metas: Sequence[Mapping[str, JSONScalar]] | None = None) -> list[Trajectory]:
        """Rewarded trajectories (:func:`~posttrain.rewards.scoring.to_trajectories`); group id = request id,
        trajectory id = ``{request id}/{i}`` (``i`` counts the request's samples)."""
        seen: dict[str, int] = {}
        tids = []
        for rid in self.request_ids:
            seen[rid] = seen.get(rid, -1) + 1
            tids.append(f"{rid}/{seen[rid]}")
        return to_trajectories(self.completions, self.examples, self.texts, self.verdicts, verifier=verifier,
                               spec=spec, group_ids=self.request_ids, traj_ids=tids, metas=metas)


@dataclasses.dataclass(frozen=True)
class _Engine:
    """A bare engine as the player's run (:class:`_Source`)."""

    engine: Sampler


@dataclasses.dataclass(frozen=True)
class _Verifying:
    """A bare verifier as the player's task (:class:`~posttrain.rewards.scoring.HasVerifier`)."""

    verifier: Verifier


def request_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of request ``index`` of a :func:`play_once` call: seed ``params.seed + index``
    (``None`` stays ``None``: the engine draws one).

    An engine's random stream is a function of (seed, sample index, token index)
    (:func:`~posttrain.rollout.sampling.uniforms`), so requests that shared one seed would draw the same
    uniforms at every position: their samples would be correlated across prompts (the same held-out
    problems all lucky or all unlucky together), which narrows the bootstrap intervals of sampled
    accuracy and the diversity of rejection-sampled data. The RL player offsets by group the same way
    (:meth:`SingleTurn.start`).
    """
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + index)


def play_once(engine: Sampler, examples: Sequence[TaskExample], params: SamplingParams, *, request_ids: Sequence[str],
              renderer: Renderer, verifier: Verifier, tokenizer: Decoder, verify_batch: VerifyBatch | None = None
              ) -> Played:
    """One request of ``params.n`` samples per example (``request_ids[i]`` names example ``i``'s), played
    to the end under the engine's current weights by the single-turn player and judged in one
    verification batch (see the module docstring). Request ``i`` samples with seed ``params.seed + i``
    (:func:`request_params`), so no two requests of a call share a random stream.

    Completions come back in request order, each request's by sample index, whatever order the
    engine returns them in (an engine may reorder), so ``rows`` maps each to its example.
    ``RuntimeError`` when the engine returns other than ``params.n`` completions per request. Neither
    a verifier's failure nor a request that failed in the backend raises: each is an ``infra_error``
    verdict (:func:`~posttrain.rewards.scoring.judge`, :meth:`SingleTurn.played`).
    """
    player = SingleTurn(_Engine(engine), renderer=renderer, task=_Verifying(verifier), tokenizer=tokenizer,
                        spec=ScoringSpec(weights={}), params=params, seed=0, verify_batch=verify_batch)
    groups: list[Group[_Sample]] = [Group(rid, ex, 0, []) for rid, ex in zip(request_ids, examples, strict=True)]
    for i, g in enumerate(groups):
        g.members = player.request(g, request_params(params, i))
    fresh = [s for g in groups for s in g.members]
    adv = player.advance([], fresh, None, 0)
    if len(adv.members) != len(fresh) or any(s.completion is None for s in fresh):
        raise RuntimeError(f"engine returned {len(adv.members)} completions for {len(groups)} requests x "
                           f"{params.n} samples")
    return player.played(groups)


# ---------------------------------------------------------------------------------------------
# the driver's single-turn player


class _Source(Protocol):
    """What the player reads of a run: its engine (a :class:`~posttrain.rollout.engine.RolloutEngine`, a
    worker set with ``generate_detailed``, or :func:`play_once`'s :class:`Sampler`)."""

    @property
    def engine(self) -> RolloutEngine | Sampler: ...


@dataclasses.dataclass(eq=False)
class _Sample:
    """One sample of a group: requested (no completion yet), paused, or ended."""

    group_id: str
    index: int  # sample_index within its group's request
    completion: Completion | _InfraCompletion | None = None
    pauses: int = 0  # times this sample was paused
    first_pause_call: int | None = None


class _InfraCompletion:
    """A sample whose request failed in the backend (no usable completion): becomes infra_error."""

    def __init__(self, completion: Completion, reason: str) -> None:
        self.completion, self.reason = completion, reason
        self.request_id, self.sample_index = completion.request_id, completion.sample_index
        self.token_ids, self.versions = completion.token_ids, completion.versions

    def trajectory(self, traj_id: str, group_id: str, example: TaskExample, spec: ScoringSpec, verifier: Verifier,
                   meta: dict[str, JSONScalar]) -> Trajectory:
        """The ``infra_error`` record of the sample (no reward, never zero)."""
        return self.completion.to_trajectory(
            traj_id=traj_id, prompt_id=example.prompt_id, group_id=group_id, status=Status.INFRA_ERROR,
            reward=Reward(components={}, weights=dict(spec.weights), total=None),
            verifier=f"{verifier.name}@{verifier.version}",
            meta={**meta, "explanation": f"rollout infra error: {self.reason}"[:500]})


def _empty_completion(request: GenerationRequest, sample_index: int) -> Completion:
    return Completion(request_id=request.request_id, sample_index=sample_index, prompt_ids=list(request.prompt_ids),
                      token_ids=[], logprobs=[], versions=[], finish_reason="paused", params=request.params,
                      seed=request.params.seed)


def _span(versions: list[int]) -> int:
    return (max(versions) - min(versions)) if versions else 0


def _mean(xs: list[int] | list[float]) -> float:
    return float(sum(xs)) / len(xs) if xs else 0.0


def engine_call(engine: RolloutEngine | Sampler, requests: Sequence[GenerationRequest], finish_target: int | None
                ) -> tuple[list[Completion], list[FailedRequest]]:
    """``(completions, failed requests)`` of one engine call over ``requests``.

    A worker set's ``generate_detailed`` gives both (:func:`~posttrain.loop.backends.base.generate_detailed`);
    a plain engine's ``generate`` gives completions only (``finish_target`` passed only when set), and a
    :class:`~posttrain.loop.backends.base.RolloutInfraError` it raises (some request failed after
    retries) gives back the completions and failed requests it carries: never an exception for a
    request that failed in the backend (the caller turns it into ``infra_error`` samples).
    """
    try:
        if finish_target is None and getattr(engine, "generate_detailed", None) is None:
            # a plain engine (or play_once's Sampler): its completions are the Completion-shaped records
            return list(engine.generate(list(requests))), []  # type: ignore[arg-type]
        return generate_detailed(engine, requests, finish_target)  # type: ignore[arg-type]  # a RolloutEngine
    except RolloutInfraError as e:
        return list(e.result.completions), list(e.result.failed)


_Result = tuple["_Sample", "Completion | _InfraCompletion", int]  # (sample, its result, new tokens this call)


def _call_metrics(results: list[_Result]) -> dict[str, float]:
    """The player's metrics of one engine call over ``results`` (see :class:`SingleTurn`)."""
    new_tokens = [n for _, _, n in results]
    finished_lens = [len(c.token_ids) for _, c, _ in results if isinstance(c, Completion) and c.finished]
    paused_lens = [len(c.token_ids) for _, c, _ in results if isinstance(c, Completion) and not c.finished]
    rows, longest = len(results), max(new_tokens, default=0)
    return {
        "rollout/new_tokens": float(sum(new_tokens)),
        "rollout/rows": float(rows),
        # Fraction of the call's sample-slots (rows x decode steps of its longest sample) in which
        # a sample had already finished and waited for the call's stragglers (the barrier's idle).
        "rollout/group_idle_frac": 1.0 - sum(new_tokens) / (rows * longest) if rows and longest else 0.0,
        "partial/finished_len_mean": _mean(finished_lens),
        "partial/paused_len_mean": _mean(paused_lens),
    }


class SingleTurn:
    """The single-turn :class:`~posttrain.loop.rollout.Player` (see the module docstring).

    Fresh group ``i`` of slot ``step``, round ``r``: one request named by the group id with
    ``params.n = group_size`` and seed ``seed * 1_000_003 + step * 101 + r + i``; a resumed sample:
    one request ``{request id}#{sample index}`` continuing its paused completion. The engine call
    sends the fresh requests, then the resumed ones, and returns once the driver's finish target
    has finished; a request that failed in a distributed backend ends as ``infra_error`` samples.
    """

    def __init__(self, run: _Source, *, renderer: Renderer, task: HasVerifier, tokenizer: Decoder,
                 spec: ScoringSpec, params: SamplingParams, seed: int, verify_batch: VerifyBatch | None) -> None:
        self.run, self.renderer, self.task, self.tokenizer = run, renderer, task, tokenizer
        self.spec, self.params, self.seed, self.verify_batch = spec, params, seed, verify_batch
        self._requests: dict[str, GenerationRequest] = {}  # fresh requests of the coming call

    def start(self, group: Group[_Sample], index: int, step: int, round_idx: int) -> list[_Sample]:
        """One request of ``params.n`` samples for ``group`` with seed
        ``seed * 1_000_003 + step * 101 + round_idx + index`` (:meth:`request`)."""
        seed = self.seed * 1_000_003 + step * 101 + round_idx
        return self.request(group, dataclasses.replace(self.params, seed=seed + index))

    def request(self, group: Group[_Sample], params: SamplingParams) -> list[_Sample]:
        """Register the request of the coming call for ``group`` (request id = group id, the rendered
        prompt of its example, ``params``); its ``params.n`` samples, requested, in sample-index order."""
        self._requests[group.group_id] = GenerationRequest(
            request_id=group.group_id, prompt_ids=self.renderer.ids(group.example), params=params)
        return [_Sample(group.group_id, j) for j in range(params.n)]

    def versions(self, member: _Sample) -> list[int]:
        """The versions of the sample's tokens so far."""
        return list(member.completion.versions) if member.completion is not None else []

    def ended(self, member: _Sample) -> bool:
        """Finished or failed (a requested or paused sample has not ended)."""
        c = member.completion
        return isinstance(c, _InfraCompletion) or (c is not None and c.finished)

    def resume(self, member: _Sample) -> None:
        """Nothing to prepare: the call sends the paused completion back to the engine."""

    def suspend(self, member: _Sample, call: int) -> None:
        """Count the pause (and the call of the first one)."""
        member.pauses += 1
        if member.first_pause_call is None:
            member.first_pause_call = call

    def advance(self, resumed: list[_Sample], fresh: list[_Sample], finish_target: int | None, call: int
                ) -> Advanced[_Sample]:
        """One engine call over the fresh requests, then the resumed samples (:func:`engine_call`): each
        sample it answered gets its completion, or an ``infra_error`` stand-in when its request failed."""
        resumed_reqs, by_rid, before = self._resumed_requests(resumed)
        fresh_of = {(s.group_id, s.index): s for s in fresh}
        fresh_reqs = [self._requests.pop(gid) for gid in dict.fromkeys(s.group_id for s in fresh)]
        comps, failed = engine_call(self.run.engine, fresh_reqs + resumed_reqs, finish_target)
        results = self._answered(comps, by_rid, before, fresh_of) + self._failed(failed, by_rid, fresh_of)
        for s, c, _ in results:
            s.completion = c
        return Advanced([s for s, _, _ in results], sum(isinstance(c, Completion) and c.finished
                                                        for _, c, _ in results), _call_metrics(results))

    def _resumed_requests(self, resumed: list[_Sample]
                          ) -> tuple[list[GenerationRequest], dict[str, _Sample], dict[str, int]]:
        """One request ``{request id}#{sample index}`` per resumed sample, continuing its paused completion:
        ``(requests, sample of each request id, tokens each had before the call)``."""
        by_rid: dict[str, _Sample] = {}
        reqs: list[GenerationRequest] = []
        before: dict[str, int] = {}
        for s in resumed:
            c = s.completion
            assert isinstance(c, Completion)  # a carried sample holds its paused completion
            rid = f"{c.request_id}#{c.sample_index}"  # one sample per resumed request, unique ids
            by_rid[rid] = s
            before[rid] = len(c.token_ids)
            params = c.params if c.params is not None else self.params  # engines record the request's params
            reqs.append(GenerationRequest(request_id=rid, prompt_ids=list(c.prompt_ids), params=params,
                                          resume=dataclasses.replace(c, request_id=rid)))
        return reqs, by_rid, before

    @staticmethod
    def _answered(comps: list[Completion], by_rid: dict[str, _Sample], before: dict[str, int],
                  fresh_of: dict[tuple[str, int], _Sample]) -> list[_Result]:
        """``(sample, completion, new tokens)`` of each completion: a resumed sample's under its original
        request id; a fresh one matched by (request id, sample index), ``RuntimeError`` for none."""
        results: list[_Result] = []
        for c in comps:
            if c.request_id in by_rid:
                s = by_rid[c.request_id]
                orig = s.completion.request_id  # type: ignore[union-attr]  # resumed: set
                results.append((s, dataclasses.replace(c, request_id=orig), len(c.token_ids) - before[c.request_id]))
            elif (c.request_id, c.sample_index) in fresh_of:
                results.append((fresh_of[(c.request_id, c.sample_index)], c, len(c.token_ids)))
            else:
                raise RuntimeError(f"engine returned a completion for request {c.request_id!r} sample "
                                   f"{c.sample_index}, which it was not asked for")
        return results

    @staticmethod
    def _failed(failed: list[FailedRequest], by_rid: dict[str, _Sample], fresh_of: dict[tuple[str, int], _Sample]
                ) -> list[_Result]:
        """``(sample, infra_error stand-in, 0)`` for each sample of a failed request: a resumed sample keeps
        its paused completion, a fresh request's ``params.n`` samples get empty ones."""
        results: list[_Result] = []
        for f in failed:
            r = f.request
            if r.request_id in by_rid:
                s = by_rid[r.request_id]
                assert isinstance(s.completion, Completion)
                results.append((s, _InfraCompletion(s.completion, f.reason), 0))
            else:
                results.extend((fresh_of[(r.request_id, j)], _InfraCompletion(_empty_completion(r, j), f.reason), 0)
                               for j in range(int(r.params.n)))
        return results

    def emit(self, groups: list[Group[_Sample]], call: int, step: int
             ) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """Score the samples of complete ``groups`` in one verification batch (infra errors unscored)."""
        ok_c: list[Completion] = []
        ok_i: list[int] = []
        rows: list[tuple[_Sample, TaskExample, dict[str, JSONScalar]]] = []
        pause_ages: list[int] = []
        for g in groups:
            ex = g.example
            for s in g.members:
                c = s.completion
                assert c is not None  # an ended sample
                age = 0 if s.first_pause_call is None else call - s.first_pause_call
                if s.pauses:
                    pause_ages.append(age)
                meta: dict[str, JSONScalar] = {"pauses": s.pauses, "pause_age": age, "version_span": _span(c.versions),
                                               "rollout_call": call, **self.renderer.record(ex)}
                if isinstance(c, Completion):
                    ok_i.append(len(rows))
                    ok_c.append(c)
                rows.append((s, ex, meta))
        t0 = time.perf_counter()
        scored: dict[int, Trajectory] = {}
        if ok_c:
            exs = [rows[i][1] for i in ok_i]
            texts, verdicts = judge(ok_c, exs, verifier=self.task.verifier, tokenizer=self.tokenizer,
                                    verify_batch=self.verify_batch)
            trajs = to_trajectories(ok_c, exs, texts, verdicts, verifier=self.task.verifier, spec=self.spec,
                                    group_ids=[rows[i][0].group_id for i in ok_i],
                                    traj_ids=[f"{rows[i][0].group_id}/{rows[i][0].index}" for i in ok_i],
                                    metas=[rows[i][2] for i in ok_i])
            scored = dict(zip(ok_i, trajs, strict=True))
        t_rew = time.perf_counter() - t0 if ok_c else 0.0
        by_group: dict[str, list[Trajectory]] = {}
        for i, (s, ex, meta) in enumerate(rows):
            c = s.completion
            t = scored[i] if i in scored else c.trajectory(  # type: ignore[union-attr]  # unscored: infra
                f"{s.group_id}/{s.index}", s.group_id, ex, self.spec, self.task.verifier, meta)
            by_group.setdefault(s.group_id, []).append(t)
        return [by_group[g.group_id] for g in groups], {
            "time/reward_s": t_rew,
            "partial/pause_age_mean": _mean(pause_ages),
            "partial/pause_age_max": float(max(pause_ages)) if pause_ages else 0.0,
        }

    def played(self, groups: list[Group[_Sample]]) -> Played:
        """The ended samples of ``groups`` as :func:`play_once` returns them: in group order, each group's
        members in order, judged in one verification batch (:func:`~posttrain.rewards.scoring.judge`; the
        samples of a failed request are not judged: empty text, ``infra_error`` verdict)."""
        rows = [i for i, g in enumerate(groups) for _ in g.members]
        members = [s for g in groups for s in g.members]
        exs = [groups[i].example for i in rows]
        failed = [isinstance(s.completion, _InfraCompletion) for s in members]
        comps: list[Sampled] = [s.completion.completion if isinstance(s.completion, _InfraCompletion)
                                else s.completion for s in members]  # type: ignore[misc]  # all ended
        ok = [k for k, bad in enumerate(failed) if not bad]
        texts, verdicts = judge([comps[k] for k in ok], [exs[k] for k in ok], verifier=self.task.verifier,
                                tokenizer=self.tokenizer, verify_batch=self.verify_batch)
        text_of, verdict_of = dict(zip(ok, texts, strict=True)), dict(zip(ok, verdicts, strict=True))
        reasons = {k: s.completion.reason for k, s in enumerate(members) if isinstance(s.completion, _InfraCompletion)}
        return Played(comps, rows, exs, [groups[i].group_id for i in rows],
                      [text_of.get(k, "") for k in range(len(members))],
                      [verdict_of[k] if k in verdict_of else infra_error(f"rollout infra error: {reasons[k]}"[:500])
                       for k in range(len(members))], failed)
