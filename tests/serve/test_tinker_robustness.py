"""What goes wrong, driven with the unmodified official SDK (issue 42): a refused request takes its turn
and the client's later requests run; DELETE / PUT / the REST listing routes answer (or fail at once);
non-finite losses, negative learning rates and over-long inputs are refused with the adapter intact;
compute_logprobs names itself; checkpoint folders after a load are numbered from the loaded step.
Every wait is bounded (``result(timeout=...)``), so a regression fails instead of hanging."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker", reason="needs the extra posttrain[tinker]")
from tinker import types  # noqa: E402

from posttrain.learner.checkpoint import latest_checkpoint  # noqa: E402
from posttrain.serve.tinker_app import TinkerServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _sdk_server import sdk_server, tensor_data  # noqa: E402

BASE = "builtin:tiny"  # context 512, vocabulary 106
SEQ = list(range(5, 21))
T = 60  # seconds: a bound no healthy call on builtin:tiny comes near


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TinkerServer]:
    yield from sdk_server(tmp_path, monkeypatch, BASE)


def _td(xs: list[int] | list[float], dtype: torch.dtype = torch.float32) -> types.TensorData:
    td: types.TensorData = tensor_data(xs, dtype)  # type: ignore[assignment]
    return td


def _sft(tokens: list[int] = SEQ, weight: float = 1.0) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": _td(tokens[1:], torch.int64),
                                       "weights": _td([weight] * (len(tokens) - 1))})


def _rl(advantage: float, sampled_logprob: float = -1.0) -> types.Datum:
    n = len(SEQ) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs={
        "target_tokens": _td(SEQ[1:], torch.int64), "logprobs": _td([sampled_logprob] * n),
        "advantages": _td([advantage] * n)})


def _user_failure(fut: object, match: str) -> None:
    with pytest.raises(tinker.RequestFailedError, match=match) as err:
        fut.result(timeout=T)  # type: ignore[attr-defined]
    assert err.value.category == types.RequestErrorCategory.User


def _logprobs(tc: object) -> list[float]:
    out = tc.forward([_sft()], "cross_entropy").result(timeout=T)  # type: ignore[attr-defined]
    return list(out.loss_fn_outputs[0]["logprobs"].data)


@pytest.mark.timeout(240)
def test_a_refused_request_takes_its_turn_and_later_requests_run(server: TinkerServer) -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result(timeout=T)
    image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png",
                                                                              expected_tokens=4)]),
                        loss_fn_inputs={"target_tokens": _td([1, 2, 3, 4], torch.int64)})
    _user_failure(tc.forward([image], "cross_entropy"), "image chunks are not supported")
    two_d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs={
        "target_tokens": _td(SEQ[1:], torch.int64),
        "weights": types.TensorData.from_torch(torch.ones(3, len(SEQ) - 1))})
    _user_failure(tc.forward_backward([two_d], "cross_entropy"), "1-D loss_fn_inputs")
    _user_failure(tc.save_weights_external("x"), "save_weights_external is not implemented")
    _user_failure(tc.optim_step(types.AdamParams(learning_rate=-1e-3)), "learning_rate=-0.001")
    # every later request of the client runs, in order
    fb = tc.forward_backward([_sft()], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    assert fb.result(timeout=T).metrics["loss:sum"] > 0
    assert opt.result(timeout=T).metrics["grad_norm:mean"] > 0
    assert len(_logprobs(tc)) == len(SEQ) - 1
    sc.close("success").result(timeout=T)


@pytest.mark.timeout(240)
def test_non_finite_losses_are_refused_and_the_adapter_stays_intact(server: TinkerServer) -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result(timeout=T)
    tc.forward_backward([_sft()], "cross_entropy").result(timeout=T)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)  # B != 0: the adapter matters
    before = _logprobs(tc)
    _user_failure(tc.forward_backward([_rl(float("nan"))], "importance_sampling"), "NaN or infinite")
    _user_failure(tc.forward_backward([_sft(weight=float("nan"))], "cross_entropy"), "NaN or infinite")
    # finite inputs, a loss that overflows float32 (ratio exp(lp + 10) > 1 times 3e38): refused, and the
    # gradient of the datum before it in the same request is not kept either
    _user_failure(tc.forward_backward([_rl(1.0), _rl(3e38, -10.0)], "importance_sampling"), "loss is not finite")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)  # valid JSON: no NaN
    assert step.metrics["grad_norm:mean"] == 0.0  # the refused requests left no gradient behind
    after = _logprobs(tc)
    assert after == before and all(x == x for x in after)  # the adapter is unchanged, and finite


@pytest.mark.timeout(240)
def test_the_context_holds_on_every_route(server: TinkerServer) -> None:
    sc = tinker.ServiceClient()
    assert sc.get_server_capabilities().supported_models[0].max_context_length == 512
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result(timeout=T)
    long = [5 + i % 90 for i in range(514)]  # 513 inputs
    _user_failure(tc.forward([_sft(long)], "cross_entropy"), r"513 tokens exceed the model's context of 512")
    _user_failure(tc.forward_backward([_sft(long)], "cross_entropy"), "exceed the model's context")
    assert len(_logprobs(tc)) == len(SEQ) - 1  # the client goes on
    sampler = sc.create_sampling_client(base_model=BASE)
    with pytest.raises(tinker.BadRequestError, match=r"sample: prompt of 510 tokens \+ max_tokens 10 exceeds"):
        sampler.sample(types.ModelInput.from_ints(long[:510]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=10)).result(timeout=T)
    with pytest.raises(tinker.BadRequestError, match="compute_logprobs: prompt of 512 tokens"):
        sampler.compute_logprobs(types.ModelInput.from_ints(long[:512])).result(timeout=T)
    with pytest.raises(tinker.BadRequestError, match="compute_logprobs: empty prompt"):
        sampler.compute_logprobs(types.ModelInput.from_ints([])).result(timeout=T)
    res = sampler.sample(types.ModelInput.from_ints(long[:500]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=12, seed=0)).result(timeout=T)
    assert 1 <= len(res.sequences[0].tokens) <= 12


@pytest.mark.timeout(240)
def test_a_datum_over_the_servers_limit_is_refused_naming_it(server: TinkerServer) -> None:
    """``max_datum_tokens`` (``posttrain serve --max-datum-tokens``) bounds a ``forward_backward`` datum below
    the context: refused with the user category, naming the datum, its length and the setting; the
    adapter's gradients are untouched and the client goes on. ``forward`` (no activations kept) is not bound."""
    server.service.max_datum_tokens = 40
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result(timeout=T)
    long = [5 + i % 90 for i in range(42)]  # 41 inputs
    _user_failure(tc.forward_backward([_sft(), _sft(long)], "cross_entropy"),
                  r"forward_backward datum 1: 41 tokens exceed this server's limit of 40 tokens per forward_backward "
                  r"datum \(posttrain serve --max-datum-tokens\)")
    assert all(p.grad is None for p in server.service.hub.get(tc.model_id).params)
    assert len(tc.forward([_sft(long)], "cross_entropy").result(timeout=T).loss_fn_outputs[0]["logprobs"].data) == 41
    out = tc.forward_backward([_sft(long[:41])], "cross_entropy").result(timeout=T)  # 40 inputs: at the limit
    assert len(out.loss_fn_outputs[0]["logprobs"].data) == 40


@pytest.mark.timeout(240)
def test_one_bad_sample_fails_only_itself(server: TinkerServer) -> None:
    import concurrent.futures as cf

    sc = tinker.ServiceClient()
    sampler = sc.create_sampling_client(base_model=BASE)
    params = types.SamplingParams(max_tokens=4, seed=1)
    prompts = [SEQ[:4], SEQ[2:6], [1000, 5, 6], SEQ[4:8]]  # 1000 is outside the vocabulary of 106
    futs = [sampler.sample(types.ModelInput.from_ints(p), num_samples=1, sampling_params=params) for p in prompts]

    def outcome(f: object) -> str:
        try:
            f.result(timeout=T)  # type: ignore[attr-defined]
            return "ok"
        except (tinker.BadRequestError, tinker.RequestFailedError) as e:
            return "outside the vocabulary" if "outside the vocabulary" in str(e) else str(e)

    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(outcome, futs))
    assert got == ["ok", "ok", "outside the vocabulary", "ok"]


@pytest.mark.timeout(240)
def test_every_route_the_sdk_calls_answers(server: TinkerServer) -> None:
    sc = tinker.ServiceClient()
    rc = sc.create_rest_client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=3, seed=0, train_mlp=False,
                                        user_metadata={"renderer_name": "role_colon"}).result(timeout=T)
    state = tc.save_state("s1").result(timeout=T).path
    samp = tc.save_weights_for_sampler("w1").result(timeout=T).path
    mid = tc.model_id

    runs = rc.list_training_runs().result(timeout=T)
    assert [r.training_run_id for r in runs.training_runs] == [mid] and runs.cursor.total_count == 1
    run = rc.get_training_run(mid).result(timeout=T)
    assert run.lora_rank == 3 and run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == samp
    assert rc.get_training_run_by_tinker_path(samp).result(timeout=T).user_metadata == {"renderer_name": "role_colon"}
    listed = rc.list_checkpoints(mid).result(timeout=T).checkpoints
    assert sorted((c.checkpoint_type, c.tinker_path) for c in listed) == [("sampler", samp), ("training", state)]
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    assert len(rc.list_user_checkpoints().result(timeout=T).checkpoints) == 2
    info = rc.get_weights_info_by_tinker_path(state).result(timeout=T)
    assert (info.base_model, info.lora_rank, info.train_mlp, info.train_attn) == (BASE, 3, False, True)
    session = rc.list_sessions().result(timeout=T).sessions
    assert len(session) == 1 and rc.get_session(session[0]).result(timeout=T).training_run_ids == [mid]

    rc.set_checkpoint_ttl_from_tinker_path(state, 3600).result(timeout=T)  # PUT
    (c,) = [c for c in rc.list_checkpoints(mid).result(timeout=T).checkpoints if c.tinker_path == state]
    assert c.expires_at is not None
    rc.delete_checkpoint_from_tinker_path(samp).result(timeout=T)  # DELETE
    assert [c.tinker_path for c in rc.list_checkpoints(mid).result(timeout=T).checkpoints] == [state]
    with pytest.raises(tinker.BadRequestError, match="no checkpoint at"):
        rc.delete_checkpoint_from_tinker_path(samp).result(timeout=T)
    # a route this server does not serve fails at once, naming itself (not retried)
    with pytest.raises(tinker.NotFoundError, match="publish is not implemented by posttrain serve"):
        rc.publish_checkpoint_from_tinker_path(state).result(timeout=T)


@pytest.mark.timeout(120)
def test_delete_and_put_never_answer_501(server: TinkerServer) -> None:
    import urllib.error
    import urllib.request

    for method in ("DELETE", "PUT", "PATCH"):
        req = urllib.request.Request(f"{server.url}/api/v1/nowhere", method=method, data=b"{}")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 404
        assert json.loads(err.value.read())["detail"] == f"{method} /api/v1/nowhere is not implemented by posttrain serve"


@pytest.mark.timeout(240)
def test_checkpoint_folders_after_a_load_count_from_the_loaded_step(server: TinkerServer) -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result(timeout=T)
    for _ in range(2):
        tc.forward_backward([_sft()], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    saved = tc.save_state("two").result(timeout=T).path
    restored = sc.create_training_client_from_state_with_optimizer(saved).result(timeout=T)
    restored.forward_backward([_sft()], "cross_entropy")
    restored.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    again = restored.save_state("three").result(timeout=T).path

    def step_dir(path: str) -> str:
        model_id, kind, name = path.removeprefix("tinker://").split("/")
        ckpt = latest_checkpoint(server.service.state_dir / model_id.replace(":", "_") / kind / name)
        assert ckpt is not None
        return ckpt.name

    assert (step_dir(saved), step_dir(again)) == ("step_000002", "step_000003")


@pytest.mark.timeout(240)
def test_sampled_logprobs_are_of_the_tempered_distribution_compute_logprobs_of_t1(server: TinkerServer) -> None:
    """The documented semantics (docs/tinker.md, "Which log-probs"): at T = 0.5 a sampled token's log-prob is
    ``log softmax(z / 0.5)``, compute_logprobs' is ``log softmax(z)``; so they differ on-policy."""
    sc = tinker.ServiceClient()
    sampler = sc.create_sampling_client(base_model=BASE)
    prompt = SEQ[:4]
    s = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=3, temperature=0.5, seed=3)).result(timeout=T).sequences[0]
    toks = prompt + list(s.tokens)
    with torch.no_grad():
        z = server.service.sampler.model(input_ids=torch.tensor([toks])).logits[0].double()
    at = [len(prompt) - 1 + i for i in range(len(s.tokens))]  # the logits that predict each sampled token
    tempered = [float(torch.log_softmax(z[p] / 0.5, -1)[t]) for p, t in zip(at, s.tokens, strict=True)]
    plain = [float(torch.log_softmax(z[p], -1)[t]) for p, t in zip(at, s.tokens, strict=True)]
    assert list(s.logprobs) == pytest.approx(tempered, abs=1e-4)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(toks)).result(timeout=T)[len(prompt):]
    assert scored == pytest.approx(plain, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(tempered, plain, strict=True)) > 1e-2
