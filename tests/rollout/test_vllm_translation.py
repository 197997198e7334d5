"""vLLM adapter: request/response translation and the step/abort loop, on recorded shapes with fakes.

Runs on CPU without vllm: the fakes mirror vLLM's objects (``Logprob(logprob, rank,
decoded_token)``, ``CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs,
finish_reason, stop_reason)``, ``RequestOutput(request_id, prompt_token_ids, outputs, finished)``
and ``LLMEngine.add_request / step / abort_request / has_unfinished_requests``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import pytest
import torch

from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.rollout.vllm_engine import (
    INSTALL_HINT,
    VLLMEngine,
    _load_weights_on_worker,
    completion_from_output,
    finish_reason_of,
    sample_seed,
    sampled_logprobs,
    to_vllm_sampling_kwargs,
)


@dataclasses.dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestOutput:  # vllm.outputs.RequestOutput (the fields we read)
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class FakeSP:
    """Records the keyword arguments a vllm.SamplingParams would get."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw


class FakeCore:
    """A deterministic LLMEngine: one token per running request per step; token = f(seed, position)."""

    def __init__(self, eos: int = 1) -> None:
        self.eos = eos
        self.running: dict[str, tuple[list[int], FakeSP, CompletionOutput]] = {}
        self.added: list[tuple[str, list[int], dict[str, Any]]] = []
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt: dict[str, list[int]], params: FakeSP) -> None:
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params.kw))
        self.running[request_id] = (prompt["prompt_token_ids"], params, CompletionOutput(0, "", [], 0.0, []))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def abort_request(self, ids: list[str]) -> None:
        self.aborted.extend(ids)
        for i in ids:
            self.running.pop(i, None)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid, (prompt, sp, co) in list(self.running.items()):
            kw = sp.kw
            tok = 3 + (kw["seed"] + len(prompt) + len(co.token_ids)) % 90
            co.token_ids.append(tok)
            co.logprobs.append({tok: Logprob(-0.1 * (1 + len(co.token_ids) % 4), rank=2), 99: Logprob(-0.05, rank=1)})
            if tok in kw["stop_token_ids"]:
                co.finish_reason, co.stop_reason = "stop", tok
            elif len(co.token_ids) >= kw["max_tokens"]:
                co.finish_reason = "length"
            done = co.finish_reason is not None
            outs.append(RequestOutput(rid, list(prompt), [dataclasses.replace(co, token_ids=list(co.token_ids),
                                                                               logprobs=list(co.logprobs))], done))
            if done:
                del self.running[rid]
        return outs


class FakeLLM:
    def __init__(self) -> None:
        self.llm_engine = FakeCore()
        self.rpc: list[tuple[Any, tuple[Any, ...]]] = []
        self.resets = 0

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        self.rpc.append((method, args))
        return [None]

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


def _engine() -> tuple[VLLMEngine, FakeLLM]:
    llm = FakeLLM()
    return VLLMEngine(llm=llm, eos_token_id=1, vocab_size=106, context=64, has_tokenizer=False,
                      sampling_params_cls=FakeSP), llm


# ---------------------------------------------------------------------------------------------- pure translation
def test_sample_seed_is_deterministic_distinct_and_small() -> None:
    seeds = {sample_seed(7, i, s) for i in range(8) for s in (0, 5)}
    assert len(seeds) == 16
    assert sample_seed(7, 3, 5) == sample_seed(7, 3, 5)
    assert all(0 <= s < 2**31 for s in seeds)


def test_sampling_kwargs_translation() -> None:
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, max_new_tokens=20,
                       stop_token_ids=(4, 9), stop_strings=("##",), n=4, seed=3)
    kw = to_vllm_sampling_kwargs(p, seed=11)
    assert kw == dict(n=1, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, max_tokens=20, stop_token_ids=[4, 9],
                      stop=["##"], seed=11, logprobs=1, include_stop_str_in_output=True, detokenize=True)
    kw = to_vllm_sampling_kwargs(dataclasses.replace(p, top_k=5, stop_strings=(), temperature=0.0), seed=1, done_tokens=15)
    assert (kw["top_k"], kw["max_tokens"], kw["temperature"], kw["detokenize"]) == (5, 5, 0.0, False)
    with pytest.raises(ValueError, match="no token budget"):
        to_vllm_sampling_kwargs(p, seed=1, done_tokens=20)


@pytest.mark.parametrize(
    ("finish", "stop", "expected"),
    [(None, None, "paused"), ("abort", None, "paused"), ("length", None, "length"), ("stop", None, "eos"),
     ("stop", 1, "eos"), ("stop", 7, "stop"), ("stop", "</s>", "stop")],
)
def test_finish_reason_mapping(finish: str | None, stop: int | str | None, expected: str) -> None:
    assert finish_reason_of(finish, stop, frozenset({1, 2})) == expected


def test_finish_reason_unknown_raises() -> None:
    with pytest.raises(ValueError, match="unknown vLLM finish_reason"):
        finish_reason_of("weird", None, frozenset())


def test_sampled_logprobs_pick_the_sampled_token() -> None:
    # recorded shape: the sampled token (rank 3) next to the top-1 token of logprobs=1
    lps = [{10: Logprob(-2.5, 3, "a"), 4: Logprob(-0.3, 1, "b")}, {4: Logprob(-0.7, 1, "b")}]
    assert sampled_logprobs([10, 4], lps) == [-2.5, -0.7]
    assert sampled_logprobs([5], [{5: -1.25}]) == [-1.25]  # plain floats too
    with pytest.raises(ValueError, match="lacks the sampled token 7"):
        sampled_logprobs([10, 7], lps)
    with pytest.raises(ValueError, match="no logprobs"):
        sampled_logprobs([10], None)
    with pytest.raises(ValueError, match="1 log-prob entries for 2 tokens"):
        sampled_logprobs([10, 4], lps[:1])


def test_completion_from_output_fresh_and_resumed() -> None:
    params = SamplingParams(max_new_tokens=10, seed=5)
    req = GenerationRequest("q", [5, 6], params)
    out = CompletionOutput(0, "", [8, 9], -1.0, [{8: Logprob(-0.4)}, {9: Logprob(-0.6)}], "stop", 9)
    c = completion_from_output(out, request=req, sample_index=2, seed=5, version=3, eos_ids=frozenset({1}))
    assert (c.token_ids, c.logprobs, c.versions, c.finish_reason, c.sample_index) == ([8, 9], [-0.4, -0.6], [3, 3], "stop", 2)
    paused = Completion("q", 2, [5, 6], [7], [-0.1], [1], "paused", params=params, seed=5)
    rreq = GenerationRequest("q", [5, 6], params, resume=paused)
    c2 = completion_from_output(out, request=rreq, sample_index=2, seed=5, version=3, eos_ids=frozenset({1}))
    assert (c2.token_ids, c2.logprobs, c2.versions) == ([7, 8, 9], [-0.1, -0.4, -0.6], [1, 3, 3])
    c3 = completion_from_output(dataclasses.replace(out, finish_reason=None), request=req, sample_index=0, seed=5,
                                version=3, eos_ids=frozenset(), finished=False)
    assert c3.finish_reason == "paused"


def test_greedy_completion_records_log_prob_zero() -> None:
    # vLLM reports log_softmax(logits) of the argmax at temperature 0; the protocol's mu is a point mass
    req = GenerationRequest("g", [5, 6], SamplingParams(temperature=0.0, max_new_tokens=4))
    out = CompletionOutput(0, "", [8, 9], -1.0, [{8: Logprob(-0.4)}, {9: Logprob(-0.6)}], "length", None)
    c = completion_from_output(out, request=req, sample_index=0, seed=0, version=0, eos_ids=frozenset())
    assert c.logprobs == [0.0, 0.0] and c.token_ids == [8, 9]


def test_reload_weights_is_preferred_over_load_weights() -> None:
    # vLLM's CPU build repacks linear weights and drops the plain parameters after loading, so an
    # update must go through model_runner.reload_weights (restore, load, repack) when it exists.
    got: list[Any] = []

    class Runner:
        model = type("M", (), {"load_weights": lambda self, weights: pytest.fail("bare load_weights used")})()

        def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
            got.extend(weights_iterator)
            assert is_checkpoint_format

    worker = type("W", (), {"model_runner": Runner()})()
    items = [("model.embed_tokens.weight", torch.zeros(2))]
    _load_weights_on_worker(worker, items)
    assert got == items


def test_load_weights_on_worker_calls_model_load_weights() -> None:
    got: list[Any] = []
    model = type("M", (), {"load_weights": lambda self, weights: got.extend(weights)})()
    worker = type("W", (), {"model_runner": type("R", (), {"model": model})()})()
    items = [("model.embed_tokens.weight", torch.zeros(2))]
    _load_weights_on_worker(worker, items)
    assert got == items


# ---------------------------------------------------------------------------------------------- engine loop on a fake
def test_generate_one_vllm_request_per_sample_in_order() -> None:
    eng, llm = _engine()
    out = eng.generate([GenerationRequest("a", [5, 6, 7], SamplingParams(n=3, max_new_tokens=4, seed=2)),
                        GenerationRequest("b", [8], SamplingParams(max_new_tokens=2, seed=9))])
    assert [(c.request_id, c.sample_index) for c in out] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert [len(c.token_ids) for c in out] == [4, 4, 4, 2]
    assert all(c.finish_reason == "length" and c.versions == [0] * len(c.token_ids) for c in out)
    added = llm.llm_engine.added
    assert [a[0] for a in added] == ["a#0#0", "a#1#0", "a#2#0", "b#0#0"]
    assert [a[2]["seed"] for a in added[:3]] == [sample_seed(2, i, 0) for i in range(3)]
    assert all(a[2]["n"] == 1 and a[2]["logprobs"] == 1 for a in added)
    # log-probs are the sampled token's, not the top-1 (token 99) entry
    assert out[0].logprobs[0] == pytest.approx(-0.2)


def test_finish_target_aborts_the_rest_and_resume_resubmits_prompt_plus_tokens() -> None:
    eng, llm = _engine()
    part = eng.generate([GenerationRequest("short", [5], SamplingParams(max_new_tokens=1, seed=1)),
                         GenerationRequest("long", [6, 7], SamplingParams(max_new_tokens=9, n=2, seed=4))],
                        finish_target=1)
    assert [c.finish_reason for c in part] == ["length", "paused", "paused"]
    assert sorted(llm.llm_engine.aborted) == ["long#0#0", "long#1#0"]
    paused = part[1]
    k = len(paused.token_ids)
    assert 1 <= k < 9
    eng.update_weights({"w": torch.ones(1)})
    assert eng.version == 1 and llm.resets == 1
    assert llm.rpc[0][0] is _load_weights_on_worker and llm.rpc[0][1][0][0][0] == "w"
    (done,) = eng.generate([GenerationRequest("long", [6, 7], paused.params, resume=paused)])  # type: ignore[arg-type]
    vid, prompt, kw = llm.llm_engine.added[-1]
    assert vid == f"long#0#{k}" and prompt == [6, 7] + paused.token_ids and kw["max_tokens"] == 9 - k
    assert kw["seed"] == sample_seed(4, 0, k)
    assert done.token_ids[:k] == paused.token_ids and len(done.token_ids) == 9
    assert done.versions == [0] * k + [1] * (9 - k)
    assert done.finish_reason == "length"


def test_pause_aborts_everything_unfinished() -> None:
    eng, llm = _engine()
    eng.pause()  # a pause before generate is cleared at its start ...
    core = llm.llm_engine
    step = core.step
    calls = {"n": 0}

    def step_then_pause() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 3:
            eng.pause()  # ... one during generate stops it at the next step
        return step()

    core.step = step_then_pause  # type: ignore[method-assign]
    out = eng.generate([GenerationRequest("p", [5], SamplingParams(max_new_tokens=30, n=2, seed=1))])
    assert [len(c.token_ids) for c in out] == [3, 3]
    assert all(c.finish_reason == "paused" for c in out)


def test_stop_token_maps_to_stop() -> None:
    eng, _ = _engine()
    # the fake's first token for seed s, prompt length 1 is 3 + (s + 1) % 90
    s = sample_seed(8, 0, 0)
    first = 3 + (s + 1) % 90
    (c,) = eng.generate([GenerationRequest("s", [5], SamplingParams(max_new_tokens=5, seed=8, stop_token_ids=(first,)))])
    assert (c.token_ids, c.finish_reason) == ([first], "stop")


def test_bad_input_is_rejected_before_vllm_sees_it() -> None:
    eng, llm = _engine()
    with pytest.raises(ValueError, match="'bad'"):
        eng.generate([GenerationRequest("ok", [5], SamplingParams()), GenerationRequest("bad", [5], SamplingParams(top_p=2.0))])
    assert llm.llm_engine.added == []


def test_missing_vllm_raises_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"make vllm-env"):
        VLLMEngine("some/model")
    assert "docs/rollout.md" in INSTALL_HINT
