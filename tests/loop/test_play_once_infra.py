"""A request that fails in a distributed rollout backend is an ``infra_error`` row on every single-turn path.

``play_once`` (held-out evaluation, ReMax's greedy baseline, rejection sampling, ``posttrain check``) is a thin
call through the training player (:class:`~posttrain.loop.single_turn.SingleTurn`): a worker set's failed
requests (``generate_detailed``) and the :class:`~posttrain.loop.backends.base.RolloutInfraError` a plain
``generate`` raises both become ``infra_error`` samples (no reward, out of the accuracy denominator, counted),
never an exception, as in training.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from posttrain.loop.backends.base import FailedRequest, RolloutInfraError, RolloutResult
from posttrain.loop.heldout import evaluate
from posttrain.loop.single_turn import play_once
from posttrain.rewards import Verdict
from posttrain.rewards.scoring import ScoringSpec
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.trajectory import Status
from tests.loop._heldout_stubs import CodePointTokenizer, Example, StubTask


@dataclasses.dataclass(frozen=True)
class _Verifier:
    """Correct iff the response is the reference."""

    name: str = "stub"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        ok = response == str(reference)
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)})


TASK = StubTask(_Verifier())


def _result(reqs: list[GenerationRequest], dead: str) -> RolloutResult:
    """Every request answered with its prompt (the reference), but those whose id contains ``dead``: failed."""
    comps = [Completion(request_id=r.request_id, sample_index=j, prompt_ids=list(r.prompt_ids),
                        token_ids=list(r.prompt_ids), logprobs=[0.0] * len(r.prompt_ids), versions=[0] * len(r.prompt_ids),
                        finish_reason="eos")
             for r in reqs if dead not in r.request_id for j in range(r.params.n)]
    failed = [FailedRequest(r, "rollout worker rollout-0 died mid-generation (ActorDiedError)", 3)
              for r in reqs if dead in r.request_id]
    return RolloutResult(comps, failed)


class _RaisingEngine:
    """A plain engine over a worker set: ``generate`` raises RolloutInfraError when a request failed."""

    def __init__(self, dead: str) -> None:
        self.dead = dead

    def generate(self, reqs: list[GenerationRequest], *, finish_target: int | None = None) -> list[Completion]:
        res = _result(reqs, self.dead)
        if res.failed:
            raise RolloutInfraError(res)
        return res.completions


class _WorkerSet(_RaisingEngine):
    """The Ray worker set's shape: ``generate_detailed`` gives the failed requests, ``generate`` raises."""

    def generate_detailed(self, reqs: list[GenerationRequest], *, finish_target: int | None = None) -> RolloutResult:
        return _result(reqs, self.dead)


EXAMPLES = [Example("a", "12", "12"), Example("b", "7", "7"), Example("c", "9", "x")]


@pytest.mark.parametrize("engine", [_RaisingEngine("-b"), _WorkerSet("-b")], ids=["generate_raises", "detailed"])
def test_heldout_evaluation_turns_a_failed_request_into_infra_error_rows(engine: _RaisingEngine) -> None:
    res = evaluate(engine, CodePointTokenizer(), TASK, EXAMPLES, max_new_tokens=4, temperature=1.0, samples=2, k=2,
                   hidden_verifier=_Verifier())
    assert res.status_counts == {"correct": 2, "infra_error": 2, "wrong": 2}
    assert res.infra_errors == 2 and res.as_metrics()["heldout/infra_errors"] == 2.0
    assert res.accuracy == pytest.approx(2 / 4)  # the failed request's samples leave the denominator
    assert res.per_prompt == ((2, 2), (0, 0), (2, 0))
    # the hidden verifier re-judges the responses that exist: the failed request has none
    assert res.hidden["infra_errors"] == 0.0 and res.hidden["accuracy"] == pytest.approx(2 / 4)


def test_play_once_rows_of_a_failed_request_are_unrewarded_infra_error_trajectories() -> None:
    played = play_once(_RaisingEngine("r1"), EXAMPLES[:2], SamplingParams(temperature=0.0, max_new_tokens=4, n=1),
                       request_ids=["r0", "r1"], renderer=_Renderer(), verifier=_Verifier(), tokenizer=CodePointTokenizer())
    assert played.failed == [False, True] and played.rows == [0, 1] and played.request_ids == ["r0", "r1"]
    assert [v.status for v in played.verdicts] == [Status.CORRECT, Status.INFRA_ERROR]
    assert "rollout worker rollout-0 died" in played.verdicts[1].explanation
    trajs = played.trajectories(verifier=_Verifier(), spec=ScoringSpec({"task": 1.0}))
    assert [t.status for t in trajs] == [Status.CORRECT, Status.INFRA_ERROR]
    assert trajs[0].reward.total == 1.0 and trajs[1].reward.total is None  # no reward, never a zero
    assert [t.traj_id for t in trajs] == ["r0/0", "r1/0"]


def test_play_once_still_refuses_an_engine_that_drops_samples() -> None:
    class _Short:
        def generate(self, reqs: list[GenerationRequest]) -> list[Completion]:
            return _result(reqs, "none").completions[:-1]

    with pytest.raises(RuntimeError, match="engine returned 3 completions for 2 requests x 2 samples"):
        play_once(_Short(), EXAMPLES[:2], SamplingParams(temperature=1.0, max_new_tokens=4, n=2),
                  request_ids=["r0", "r1"], renderer=_Renderer(), verifier=_Verifier(), tokenizer=CodePointTokenizer())


class _Renderer:
    def ids(self, example: Any) -> list[int]:
        return [ord(ch) for ch in example.prompt]

    def record(self, example: Any) -> dict[str, str]:
        return {}
