"""Engine-agnostic conformance suite: every rollout engine must pass it.

The parametrisation lists the built-in engine and vLLM (its own environment, ``make vllm-env``, CPU
or CUDA build, driven as the ``rollout.engine=vllm`` server; one engine for the module, reloaded
with the test model's weights by each test). Without that environment the vLLM cases fail with the
command that builds it; ``POSTTRAIN_TEST_VLLM=0`` leaves them out explicitly (tests/rollout/_vllm_env.py).
The test model has head_dim 32 (vLLM's CPU attention needs >= 32). Reference values are computed independently of the engine:
a plain full-sequence forward pass of the same weights, and a hand-written numpy version of the
behaviour distribution ``mu`` (temperature, then top-k, then top-p over the kept set, renormalised).
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from posttrain.models import build_tiny_model
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _vllm_env import spawn_vllm, vllm_wanted  # noqa: E402

CONTEXT = 64  # max_position_embeddings of the test model
EOS = 1
# A resumed sample re-runs its prefix as one prefill (another shape than step-by-step decoding):
# its log-probs match the uninterrupted ones to float32 rounding over the longest reduction of the
# micro model (intermediate size 64), scaled by |log mu| <= 10 (V = 106 at T >= 0.5). A wrong token
# or a log-prob of the wrong position is off by >= 1e-2.
RESUME_LP_ATOL = shape_rtol(64) * 10


def _make_builtin(model: torch.nn.Module) -> Any:
    return BuiltinEngine(copy.deepcopy(model), eos_token_id=EOS)


ENGINES = ["builtin", "vllm"] if vllm_wanted() else ["builtin"]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # micro with one head of 32 (head_dim 32) instead of 4 heads of 8: vLLM's CPU attention needs >= 32
    return build_tiny_model("micro", seed=3, max_position_embeddings=CONTEXT, eos_token_id=EOS,
                            num_attention_heads=1, num_key_value_heads=1)


@pytest.fixture(scope="module")
def vllm_engine(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    eng = spawn_vllm(model, tmp_path_factory.mktemp("vllm"), eos_token_id=EOS, max_model_len=CONTEXT)
    yield eng
    eng.close()


@pytest.fixture(params=ENGINES)
def make_engine(request: pytest.FixtureRequest) -> Callable[[torch.nn.Module], Any]:
    if request.param == "builtin":
        return _make_builtin
    eng = request.getfixturevalue("vllm_engine")

    def make(model: torch.nn.Module) -> Any:
        # the module's one vLLM engine, reloaded (checksummed) with the test's weights under a new version
        eng.update_weights(model.state_dict(), version=eng.version + 1)
        return eng

    return make


def _prompts(k: int, seed: int = 0, lo: int = 3, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        n = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(3, 106, (n,), generator=g).tolist())
    return out


def _reference_logits(model: torch.nn.Module, c: Completion) -> np.ndarray:
    """Next-token logits ``[len(tokens), V]`` float64 from one plain forward over prompt + tokens."""
    ids = torch.tensor([list(c.prompt_ids) + list(c.token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    P = len(c.prompt_ids)
    return logits[P - 1 : P - 1 + len(c.token_ids)].numpy()


def _reference_logmu(z: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Hand-written ``log mu`` of one logits row (module docstring of posttrain.rollout.sampling)."""
    V = z.shape[0]
    if p.temperature == 0:
        out = np.full(V, -np.inf)
        out[int(np.argmax(z))] = 0.0
        return out
    z = z / p.temperature
    keep = np.ones(V, dtype=bool)
    if 0 < p.top_k < V:
        kth = np.sort(z)[::-1][p.top_k - 1]
        keep &= z >= kth
    if p.top_p < 1:
        q = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        q /= q.sum()
        mass = 0.0
        keep_p = np.zeros(V, dtype=bool)
        for rank, v in enumerate(np.argsort(-z, kind="stable")):
            if rank == 0 or mass < p.top_p:
                keep_p[v] = keep[v]
            mass += q[v]
        keep &= keep_p
    out = np.full(V, -np.inf)
    m = z[keep].max()
    out[keep] = z[keep] - m - np.log(np.exp(z[keep] - m).sum())
    return out


# ---------------------------------------------------------------------------------------------- shape
def test_n_completions_per_request_in_order(model: torch.nn.Module, make_engine: Callable) -> None:
    eng = make_engine(model)
    prompts = _prompts(3)
    ns = [1, 3, 2]
    reqs = [
        GenerationRequest(f"q{i}", p, SamplingParams(n=n, max_new_tokens=7, seed=11)) for i, (p, n) in enumerate(zip(prompts, ns, strict=True))
    ]
    out = eng.generate(reqs)
    assert [(c.request_id, c.sample_index) for c in out] == [
        ("q0", 0), ("q1", 0), ("q1", 1), ("q1", 2), ("q2", 0), ("q2", 1)
    ]
    for c in out:
        assert c.prompt_ids == prompts[int(c.request_id[1])]
        assert 1 <= len(c.token_ids) <= 7
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert all(v == eng.version for v in c.versions)
        assert all(lp <= 0.0 for lp in c.logprobs)
        if c.finish_reason == "eos":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 7 and EOS not in c.token_ids


# ---------------------------------------------------------------------------------------------- behaviour log-probs
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=5),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=12, n=2, seed=6),
        SamplingParams(temperature=1.3, top_p=0.6, max_new_tokens=12, n=2, seed=7),
        SamplingParams(temperature=0.5, top_k=8, top_p=0.8, max_new_tokens=12, n=2, seed=8),
    ],
    ids=["T1", "T0.7-k5", "T1.3-p0.6", "T0.5-k8-p0.8"],
)
def test_behaviour_logprob_is_kept_set_renormalised_tempered(
    model: torch.nn.Module, make_engine: Callable, params: SamplingParams
) -> None:
    eng = make_engine(model)
    reqs = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(_prompts(3, seed=1))]
    out = eng.generate(reqs)
    n_checked = 0
    for c in out:
        logits = _reference_logits(model, c)
        for i, t in enumerate(c.token_ids):
            ref = _reference_logmu(logits[i], params)
            assert np.isfinite(ref[t]), f"{c.request_id}/{c.sample_index} step {i}: token {t} outside the kept set"
            assert c.logprobs[i] == pytest.approx(ref[t], abs=1e-4)
            n_checked += 1
    assert n_checked >= 3 * 2  # every sample has at least one token


def test_greedy_is_argmax_with_zero_logprob(model: torch.nn.Module, make_engine: Callable) -> None:
    eng = make_engine(model)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    out = eng.generate([GenerationRequest(f"g{i}", p, params) for i, p in enumerate(_prompts(3, seed=2))])
    for c in out:
        logits = _reference_logits(model, c)
        assert c.token_ids == [int(np.argmax(row)) for row in logits]
        assert c.logprobs == [0.0] * len(c.token_ids)


# ---------------------------------------------------------------------------------------------- reproducibility
def test_seeded_sampling_is_reproducible(model: torch.nn.Module, make_engine: Callable) -> None:
    eng = make_engine(model)
    prompts = _prompts(3, seed=3)

    def run(seed: int) -> list[tuple[list[int], list[float]]]:
        params = SamplingParams(temperature=1.0, max_new_tokens=15, n=2, seed=seed)
        return [(c.token_ids, c.logprobs) for c in eng.generate([GenerationRequest(f"s{i}", p, params) for i, p in enumerate(prompts)])]

    a, b, other = run(123), run(123), run(124)
    assert a == b
    assert [t for t, _ in a] != [t for t, _ in other]
    # the n samples of one request are different streams
    assert a[0][0] != a[1][0] or a[2][0] != a[3][0]


# ---------------------------------------------------------------------------------------------- pause / resume
def _resume_requests(out: list[Completion]) -> list[GenerationRequest]:
    return [GenerationRequest(c.request_id, c.prompt_ids, c.params, resume=c) for c in out if not c.finished]  # type: ignore[arg-type]


def test_finish_target_pause_then_resume_matches_uninterrupted(model: torch.nn.Module, make_engine: Callable) -> None:
    prompts = _prompts(3, seed=4)
    short = SamplingParams(temperature=1.0, max_new_tokens=2, seed=9)
    long = SamplingParams(temperature=1.0, max_new_tokens=25, n=2, seed=10)

    def reqs() -> list[GenerationRequest]:
        return [GenerationRequest("short", prompts[0], short)] + [
            GenerationRequest(f"long{i}", p, long) for i, p in enumerate(prompts[1:])
        ]

    full = make_engine(model).generate(reqs())
    eng = make_engine(model)
    part = eng.generate(reqs(), finish_target=1)
    assert sum(c.finished for c in part) >= 1
    paused = [c for c in part if not c.finished]
    assert paused, "some samples must be paused (max_new_tokens 25 vs 2)"
    for c in paused:
        assert c.finish_reason == "paused" and len(c.token_ids) < 25
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
    resumed = {(c.request_id, c.sample_index): c for c in eng.generate(_resume_requests(part))}
    assert set(resumed) == {(c.request_id, c.sample_index) for c in paused}
    for f in full:
        key = (f.request_id, f.sample_index)
        got = resumed.get(key) or next(c for c in part if (c.request_id, c.sample_index) == key)
        assert got.finished
        p = next(c for c in part if (c.request_id, c.sample_index) == key)
        assert got.token_ids[: len(p.token_ids)] == p.token_ids  # a resume extends, never rewrites
        if getattr(eng, "reproducible_resume", False):
            assert got.token_ids == f.token_ids
            assert got.logprobs == pytest.approx(f.logprobs, abs=RESUME_LP_ATOL)
            assert got.finish_reason == f.finish_reason


def test_pause_from_another_thread(model: torch.nn.Module, make_engine: Callable) -> None:
    prompts = _prompts(2, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=CONTEXT - 10, seed=3)
    eng = make_engine(model)
    reqs = [GenerationRequest(f"t{i}", p, params) for i, p in enumerate(prompts)]
    full = {c.request_id: c for c in make_engine(model).generate(reqs)}
    assert all(len(c.token_ids) > 20 for c in full.values())  # long enough to be caught mid-way
    done = threading.Event()

    def pauser() -> None:  # keeps asking until generate returns: the first request lands at a step boundary
        while not done.is_set():
            eng.pause()
            time.sleep(0.001)

    th = threading.Thread(target=pauser)
    th.start()
    try:
        part = eng.generate(reqs)
    finally:
        done.set()
        th.join()
    assert all(c.finish_reason == "paused" for c in part)
    assert all(len(c.token_ids) < len(full[c.request_id].token_ids) for c in part)
    resumed = eng.generate(_resume_requests(part))
    assert all(c.finished for c in resumed)
    for c in resumed:
        p = next(x for x in part if x.request_id == c.request_id)
        assert c.token_ids[: len(p.token_ids)] == p.token_ids
        if getattr(eng, "reproducible_resume", False):
            assert c.token_ids == full[c.request_id].token_ids
            assert c.logprobs == pytest.approx(full[c.request_id].logprobs, abs=RESUME_LP_ATOL)


# ---------------------------------------------------------------------------------------------- bad input
_GOOD = [5, 6, 7]
_BAD_CASES: dict[str, tuple[str, list[int], SamplingParams]] = {
    "empty_prompt": ("req-empty", [], SamplingParams()),
    "prompt_longer_than_context": ("req-long", [5] * (CONTEXT + 3), SamplingParams()),
    "max_new_tokens_zero": ("req-mnt0", _GOOD, SamplingParams(max_new_tokens=0)),
    "max_new_tokens_negative": ("req-mnt-", _GOOD, SamplingParams(max_new_tokens=-4)),
    "top_p_zero": ("req-p0", _GOOD, SamplingParams(top_p=0.0)),
    "top_p_above_one": ("req-p2", _GOOD, SamplingParams(top_p=1.5)),
    "negative_temperature": ("req-t", _GOOD, SamplingParams(temperature=-0.5)),
    "unknown_stop_token": ("req-stop", _GOOD, SamplingParams(stop_token_ids=(10**6,))),
}


@pytest.mark.parametrize("case", list(_BAD_CASES))
def test_bad_input_raises_value_error_naming_the_request(model: torch.nn.Module, make_engine: Callable, case: str) -> None:
    eng = make_engine(model)
    rid, prompt, params = _BAD_CASES[case]
    good = GenerationRequest("fine", _GOOD, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=rid):
        eng.generate([good, GenerationRequest(rid, prompt, params)])
    # nothing was generated for the good request either (validation precedes compute), and the engine still works
    assert len(eng.generate([good])) == 1


def test_empty_request_list_raises(model: torch.nn.Module, make_engine: Callable) -> None:
    with pytest.raises(ValueError, match="empty"):
        make_engine(model).generate([])


# ---------------------------------------------------------------------------------------------- trajectory contract
def test_completion_trajectory_round_trip_is_lossless(model: torch.nn.Module, make_engine: Callable) -> None:
    eng = make_engine(model)
    prompts = _prompts(2, seed=7)
    params = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=20, n=2, seed=4, stop_token_ids=(17,))
    part = eng.generate([GenerationRequest("a", prompts[0], SamplingParams(max_new_tokens=1, seed=1)),
                         GenerationRequest("b", prompts[1], params)], finish_target=1)
    eng.update_weights({}, version=eng.version + 1)
    out = part + eng.generate(_resume_requests(part))
    assert {c.finish_reason for c in out} >= {"length", "paused"}
    for j, c in enumerate(out):
        traj = c.to_trajectory(traj_id=f"t{j}", prompt_id=c.request_id, group_id=c.request_id)
        back = Completion.from_trajectory(traj)
        for f in ("request_id", "sample_index", "prompt_ids", "token_ids", "logprobs", "versions",
                  "finish_reason", "params", "seed"):
            assert getattr(back, f) == getattr(c, f), f
        assert traj.finish.value == {"eos": "terminal", "stop": "terminal", "length": "truncated",
                                     "paused": "paused"}[c.finish_reason]
