"""The single-turn rollout of a set of prompts, played to the end and judged: one path for every caller.

:func:`play_once` sends one request of ``params.n`` samples per prompt, waits for all of them,
puts the completions in request order and judges them in one guarded verification batch
(:func:`posttrain.rewards.scoring.judge`). Held-out evaluation
(:func:`posttrain.evaluation.heldout.evaluate`), ReMax's greedy baseline
(:func:`posttrain.loop.targets.greedy_baseline`) and ``posttrain check`` call it with their own
request ids and sampling settings; the training rollout (:class:`posttrain.loop.producer.GroupRollout`)
plans, suspends and resumes its samples itself and scores through the same
:func:`~posttrain.rewards.scoring.to_trajectories`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from posttrain.envs.task import TaskExample
from posttrain.rewards.scoring import (
    Decoder,
    ScoredCompletion,
    ScoringSpec,
    VerifyBatch,
    judge,
    to_trajectories,
)
from posttrain.rewards.verdict import Verdict
from posttrain.rewards.verifier import Verifier
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.trajectory import Trajectory
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
    """The judged samples of :func:`play_once`, in request order (``rows[i]``: the prompt of sample ``i``)."""

    completions: list[Sampled]
    rows: list[int]
    examples: list[TaskExample]  # examples[i] is the prompt of completions[i]
    request_ids: list[str]  # the request of each sample
    texts: list[str]
    verdicts: list[Verdict]

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


def play_once(engine: Sampler, examples: Sequence[TaskExample], params: SamplingParams, *, request_ids: Sequence[str],
              renderer: Renderer, verifier: Verifier, tokenizer: Decoder, verify_batch: VerifyBatch | None = None
              ) -> Played:
    """One request of ``params.n`` samples per example (``request_ids[i]`` names example ``i``'s), played
    to the end under the engine's current weights and judged in one verification batch.

    Completions come back in request order whatever order the engine returns them in (an engine
    may reorder), so ``rows`` maps each to its example. ``RuntimeError`` when the engine returns
    other than ``params.n`` completions per request. A verifier's failure is an ``infra_error``
    verdict, never an exception (:func:`~posttrain.rewards.scoring.judge`).
    """
    reqs = [GenerationRequest(request_id=rid, prompt_ids=renderer.ids(ex), params=params)
            for rid, ex in zip(request_ids, examples, strict=True)]
    comps = list(engine.generate(reqs))
    if len(comps) != params.n * len(reqs):
        raise RuntimeError(f"engine returned {len(comps)} completions for {len(reqs)} requests x {params.n} samples")
    row_of = {r.request_id: i for i, r in enumerate(reqs)}

    def row(c: Sampled) -> int:
        return row_of[c.request_id]

    comps.sort(key=row)  # stable: a request's samples keep the engine's order
    rows = [row(c) for c in comps]
    exs = [examples[i] for i in rows]
    texts, verdicts = judge(comps, exs, verifier=verifier, tokenizer=tokenizer, verify_batch=verify_batch)
    return Played(comps, rows, exs, [reqs[i].request_id for i in rows], texts, verdicts)
