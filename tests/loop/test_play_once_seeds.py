"""Issue 43: the requests of one :func:`~posttrain.loop.single_turn.play_once` call do not share a random stream.

The built-in engine draws sample ``j``'s token ``t`` with the uniform of ``(seed, j, t)``
(:func:`posttrain.rollout.sampling.uniforms`). When every request of a call carried the caller's seed, sample
``j`` of every prompt drew the same uniforms: two requests of the same prompt came back token for token equal,
and samples of different prompts were correlated (``posttrain sample``, sampled held-out evaluation,
``posttrain check``). Request ``i`` now samples with seed ``params.seed + i`` (:func:`request_params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from posttrain.loop.single_turn import Played, play_once, request_params
from posttrain.models import build_tiny_model
from posttrain.rewards import Verdict
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.trajectory import Status
from tests.loop._heldout_stubs import CodePointTokenizer, Example


@dataclasses.dataclass(frozen=True)
class _Verifier:
    """Correct iff the response is the reference (the verdicts play no part here)."""

    name: str = "stub"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        ok = response == str(reference)
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)})


class _Renderer:
    """A prompt's characters as ids ``ord(ch) - 90`` (inside the micro model's 106-token vocabulary)."""

    def ids(self, example: Any) -> list[int]:
        return [ord(ch) - 90 for ch in example.prompt]

    def record(self, example: Any) -> dict[str, str]:
        return {}


class _Recording:
    """A fake engine: records the requests it is given, answers each sample with its prompt."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    def generate(self, reqs: Sequence[GenerationRequest]) -> list[Completion]:
        self.requests.extend(reqs)
        return [Completion(request_id=r.request_id, sample_index=j, prompt_ids=list(r.prompt_ids),
                           token_ids=list(r.prompt_ids), logprobs=[0.0] * len(r.prompt_ids),
                           versions=[0] * len(r.prompt_ids), finish_reason="eos")
                for r in reqs for j in range(r.params.n)]


def _play(engine: Any, examples: list[Any], params: SamplingParams) -> Played:
    return play_once(engine, examples, params, request_ids=[f"r{i}" for i in range(len(examples))],
                     renderer=_Renderer(), verifier=_Verifier(), tokenizer=CodePointTokenizer())


def test_request_params_offsets_the_seed_by_the_request_index() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=9, n=3, seed=11)
    assert request_params(p, 0) == p
    assert request_params(p, 4) == dataclasses.replace(p, seed=15)  # 11 + 4; every other field kept
    assert request_params(SamplingParams(seed=-2), 2).seed == 0
    unseeded = SamplingParams(temperature=1.0, n=2)
    assert request_params(unseeded, 0) is unseeded and request_params(unseeded, 3) is unseeded  # None stays None


def test_each_request_of_a_call_reaches_the_engine_with_its_own_seed() -> None:
    eng = _Recording()
    exs = [Example("a", "abc", "x"), Example("b", "de", "x"), Example("c", "f", "x")]
    _play(eng, exs, SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=7))
    assert [(r.request_id, r.params.seed, r.params.n) for r in eng.requests] == [("r0", 7, 2), ("r1", 8, 2),
                                                                               ("r2", 9, 2)]
    eng = _Recording()
    _play(eng, exs, SamplingParams(temperature=1.0, max_new_tokens=4, n=2))
    assert [r.params.seed for r in eng.requests] == [None, None, None]  # the engine draws its own


def test_the_same_prompt_twice_in_one_call_gets_two_different_sample_sets() -> None:
    """Two requests of one prompt, sampled at temperature 1 on the micro model: with a shared seed their samples
    were equal token for token (sample j of each drew the same uniforms); now request 1 samples with seed + 1."""
    engine = BuiltinEngine(build_tiny_model("micro", seed=1, max_position_embeddings=128), eos_token_id=[])
    ex = Example("p", "hello", "x")
    played = _play(engine, [ex, ex], SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=3))
    assert played.request_ids == ["r0", "r0", "r1", "r1"] and played.rows == [0, 0, 1, 1]
    toks = [list(c.token_ids) for c in played.completions]
    assert all(len(t) == 24 for t in toks)  # no eos: every sample runs to the limit
    assert toks[0] != toks[2] and toks[1] != toks[3]  # sample j of request 0 vs sample j of request 1
    assert toks[0] != toks[1]  # the samples of one request differ (sample index), as before
    # request 1 draws exactly what a lone request seeded 3 + 1 draws
    lone = engine.generate([GenerationRequest("r1", _Renderer().ids(ex), SamplingParams(
        temperature=1.0, max_new_tokens=24, n=2, seed=4))])
    assert [list(c.token_ids) for c in sorted(lone, key=lambda c: c.sample_index)] == toks[2:]
