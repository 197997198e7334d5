"""The unmodified official Tinker SDK (pinned 0.38.0, extra ``posttrain[tinker]``) drives
``posttrain serve --tinker`` on builtin:tiny: create a LoRA model, cross-entropy steps (the loss
falls), PPO / importance-sampling steps, save for the sampler and sample, compute_logprobs (equal to
posttrain's own token_logprobs of the saved checkpoint), save_state / load_state, finish."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker", reason="needs the extra posttrain[tinker]")
from tinker import types  # noqa: E402

from posttrain.learner.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from posttrain.learner.logprobs import token_logprobs  # noqa: E402
from posttrain.serve.tinker_app import TinkerServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _sdk_server import sdk_server, tensor_data  # noqa: E402
from _tolerance import shape_rtol  # noqa: E402

BASE = "builtin:tiny"
SEQ = list(range(5, 29))  # a fixed token sequence the model learns


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TinkerServer]:
    yield from sdk_server(tmp_path, monkeypatch, BASE)


def _td(xs: list[int] | list[float], dtype: torch.dtype = torch.float32) -> types.TensorData:
    td: types.TensorData = tensor_data(xs, dtype)  # type: ignore[assignment]
    return td


def _sft_datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                       loss_fn_inputs={"target_tokens": _td(SEQ[1:], torch.int64), "weights": _td([1.0] * (len(SEQ) - 1))})


def _run_dir(srv: TinkerServer, path: str) -> Path:
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    ckpt = latest_checkpoint(srv.service.state_dir / model_id.replace(":", "_") / kind / name)
    assert ckpt is not None, path
    return ckpt


@pytest.mark.timeout(300)
def test_official_sdk_probe(server: TinkerServer) -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    assert tc.get_info().lora_rank == 4

    # cross-entropy on a fixed batch: the summed NLL falls step after step
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([_sft_datum()], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))  # queued before the result is fetched
        out = fb.result()
        opt.result()
        assert len(out.loss_fn_outputs[0]["logprobs"].data) == len(SEQ) - 1
        losses.append(out.metrics["loss:sum"])
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.85 * losses[0], losses

    # sample from the current weights: num_samples, max_tokens, temperature, seed
    path = tc.save_weights_for_sampler(name="rl").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints(SEQ[:4])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    res = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
    assert all(1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens) for s in res.sequences)
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # same seed, same tokens
    first = res.sequences[0].tokens[0]
    stopped = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, seed=7, stop=[first])).result().sequences[0]
    assert stopped.tokens == [first] and stopped.stop_reason == "stop"

    # compute_logprobs (prompt_logprobs) = posttrain's token_logprobs of the saved checkpoint's actor/
    from transformers import AutoModelForCausalLM

    got = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ[:12])).result()
    assert got[0] is None
    actor = AutoModelForCausalLM.from_pretrained(load_checkpoint(_run_dir(server, path)).actor_dir)  # in eval mode
    ids = torch.tensor([SEQ[:12]])
    ref, _ = token_logprobs(actor, ids, torch.ones_like(ids))
    diff = (torch.tensor(got[1:], dtype=torch.float64) - ref[0, 1:].double()).abs().max()
    assert float(diff) <= shape_rtol(12) * float(ref[0, 1:].abs().max()), diff
    last3 = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ[:12]), prompt_logprobs_last_n=3).result()
    assert last3[:9] == [None] * 9 and last3[9:] == pytest.approx(got[9:], abs=1e-6)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs is not supported"):
        sampler.sample(prompt, num_samples=1, sampling_params=params, include_prompt_logprobs=True,
                       topk_prompt_logprobs=2).result()

    # PPO and importance sampling on the sampled tokens: same weights -> ratio 1, loss = -sum(A)
    seq = res.sequences[0]
    toks = SEQ[:4] + seq.tokens
    adv = [1.0] * len(seq.tokens)
    n_prompt = 3  # inputs toks[:-1]; the targets of the prompt positions get weight 0 via advantage 0
    rl = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
        "target_tokens": _td(toks[1:], torch.int64), "logprobs": _td([0.0] * n_prompt + list(seq.logprobs)),
        "advantages": _td([0.0] * n_prompt + adv)})
    for loss_fn in ("ppo", "importance_sampling"):
        out = tc.forward_backward([rl], loss_fn).result()
        lp = out.loss_fn_outputs[0]["logprobs"].data[n_prompt:]
        assert lp == pytest.approx(list(seq.logprobs), abs=1e-4)  # learner and sampler agree
        assert out.metrics["loss:sum"] == pytest.approx(-sum(adv), rel=1e-3)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    # an unsupported loss is the SDK's user-category failure, not an approximation
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward_backward([rl], "dro").result()
    assert err.value.category == types.RequestErrorCategory.User

    # save_state / load (create_training_client_from_state): the adapter comes back exactly (a copy)
    saved = tc.save_state("a").result().path
    tc.forward_backward([_sft_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    restored = sc.create_training_client_from_state_with_optimizer(saved).result()  # a new model, loaded
    after = restored.save_weights_for_sampler(name="after").result().path
    a = load_checkpoint(_run_dir(server, saved)).learner_state
    b = load_checkpoint(_run_dir(server, after)).learner_state
    assert set(a["adapter"]) == set(b["adapter"]) and "optimizer" in a
    assert all(torch.equal(a["adapter"][k], b["adapter"][k]) for k in a["adapter"])

    sc.close("success").result()
    assert list(server.service.sessions.values()) == [True]
