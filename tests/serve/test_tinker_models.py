"""Training models share one base network as separate peft adapters: training one leaves another's
outputs exactly as they were, and a new adapter starts as the base model. A long datum runs through the
chunked LM head with activation checkpointing and gives the plain forward's log-probs and gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import posttrain.learner.primitives as primitives
from posttrain.learner.chunked_head import chunked_token_logprobs
from posttrain.serve.tinker_app import load_base
from posttrain.serve.tinker_models import AdamStep, LoraSpec, ModelHub
from posttrain.serve.wire import DatumIn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, assert_scaled_close, shape_rtol  # noqa: E402

TOKENS = list(range(5, 17))


def _datum(tokens: list[int] = TOKENS, weights: torch.Tensor | None = None) -> DatumIn:
    w = torch.ones(len(tokens) - 1) if weights is None else weights
    return DatumIn(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": w})


def _lp(hub: ModelHub, model_id: str) -> torch.Tensor:
    return hub.forward_backward(model_id, [_datum()], "cross_entropy", {}, forward_only=True).logprobs[0]


def test_adapters_are_isolated_and_start_at_the_base() -> None:
    _, net = load_base("builtin:tiny")
    assert isinstance(net, torch.nn.Module)
    ids, targets = torch.tensor([TOKENS[:-1]]), torch.tensor(TOKENS[1:])
    with torch.no_grad():
        full = torch.log_softmax(net(input_ids=ids).logits[0], -1).gather(-1, targets.view(-1, 1)).squeeze(-1)
        hidden = net.get_decoder()(input_ids=ids).last_hidden_state[0]
        base_lp, _ = chunked_token_logprobs(hidden, net.get_output_embeddings().weight, targets)
    assert_scaled_close(base_lp, full, shape_rtol(len(targets)), "chunked head vs transformers' logits")
    hub = ModelHub("builtin:tiny", net)
    hub.create("a", LoraSpec(rank=2, seed=0))
    hub.create("b", LoraSpec(rank=4, seed=1, train_mlp=False, train_unembed=False))
    before_b = _lp(hub, "b")
    assert torch.equal(_lp(hub, "a"), base_lp)  # B = 0: an adapter adds exactly nothing at first
    loss0 = hub.forward_backward("a", [_datum()], "cross_entropy", {}, forward_only=False).loss_sum
    hub.optim_step("a", AdamStep(learning_rate=0.05))
    loss1 = hub.forward_backward("a", [_datum()], "cross_entropy", {}, forward_only=True).loss_sum
    assert loss1 < loss0  # a trained
    assert torch.equal(_lp(hub, "b"), before_b)  # b untouched: same computation, same result
    assert hub.get("b").steps == 0 and hub.get("a").steps == 1


@pytest.mark.parametrize("train_unembed", [True, False])
def test_a_long_datum_chunked_and_checkpointed_equals_the_plain_forward(
        train_unembed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 300-token datum (over ``checkpoint_above_tokens=16``, head chunks of 7 tokens) gives the log-probs
    and the gradient of every LoRA factor of transformers' own forward (full ``[T, V]`` logits, no
    checkpointing) within tests/_tolerance.py; a 11-token datum runs without checkpointing."""
    _, net = load_base("builtin:tiny")
    assert isinstance(net, torch.nn.Module)
    hub = ModelHub("builtin:tiny", net, checkpoint_above_tokens=16, head_chunk_tokens=7)
    assert hub.checkpointing
    tm = hub.create("a", LoraSpec(rank=4, seed=0, train_unembed=train_unembed))
    hub.create("b", LoraSpec(rank=2, seed=1))  # another adapter on every layer: inactive, must not count
    hub.forward_backward("a", [_datum()], "cross_entropy", {}, forward_only=False)
    hub.optim_step("a", AdamStep(learning_rate=0.05))  # B != 0: every factor has a gradient
    long = [5 + (7 * i) % 100 for i in range(301)]
    weights = torch.linspace(0.5, 1.5, 300)

    peft = hub.module
    peft.set_adapter(tm.adapter)  # type: ignore[operator]
    logits = peft(input_ids=torch.tensor([long[:-1]]), use_cache=False).logits[0]
    ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(long[1:]).view(-1, 1)).squeeze(-1)
    ref_grads = torch.autograd.grad(-(weights * ref_lp).sum(), tm.params)

    calls = {"head": 0, "layer0": 0}

    def spy(*args: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls["head"] += 1
        return chunked_token_logprobs(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(primitives, "chunked_token_logprobs", spy)
    # the attention module runs inside the checkpointed layer: once more in the backward when checkpointed
    hook = net.get_decoder().layers[0].self_attn.register_forward_hook(
        lambda *_: calls.__setitem__("layer0", calls["layer0"] + 1))
    try:
        res = hub.forward_backward("a", [_datum(long, weights)], "cross_entropy", {}, forward_only=False)
        assert calls == {"head": 1, "layer0": 2}
        hub.forward_backward("a", [_datum()], "cross_entropy", {}, forward_only=True)
        assert calls == {"head": 2, "layer0": 3}  # short: no recompute
    finally:
        hook.remove()
    assert_scaled_close(res.logprobs[0], ref_lp.detach(), shape_rtol(300), "log-probs")
    assert res.loss_sum == pytest.approx(float(-(weights * ref_lp).sum()), rel=shape_rtol(300))
    names = [str(i) for i in range(len(tm.params))]
    assert all(p.grad is not None for p in tm.params)
    assert_grads_close({n: p.grad for n, p in zip(names, tm.params, strict=True)},  # type: ignore[misc]
                       dict(zip(names, ref_grads, strict=True)), shape_rtol(300), "LoRA gradients")


def test_short_data_share_a_micro_batch_and_a_long_one_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request of two short data and one long: the short ones run as one padded micro-batch without
    checkpointing, the long one alone and checkpointed (the head runs twice, attention layer 0 three
    times); each datum's log-probs and the summed loss and gradient are those of the data run one by one."""
    _, net = load_base("builtin:tiny")
    assert isinstance(net, torch.nn.Module)
    hub = ModelHub("builtin:tiny", net, checkpoint_above_tokens=16, head_chunk_tokens=7)
    tm = hub.create("a", LoraSpec(rank=4, seed=0))
    hub.forward_backward("a", [_datum()], "cross_entropy", {}, forward_only=False)
    hub.optim_step("a", AdamStep(learning_rate=0.05))
    data = [_datum(TOKENS[:6]), _datum([5 + (3 * i) % 90 for i in range(41)]), _datum(TOKENS[:8])]
    alone = [hub.forward_backward("a", [d], "cross_entropy", {}, forward_only=False) for d in data]
    ref_grads = {str(i): p.grad.clone() for i, p in enumerate(tm.params)}  # type: ignore[union-attr]
    for p in tm.params:
        p.grad = None
    calls = {"head": 0, "layer0": 0}

    def spy(*args: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls["head"] += 1
        return chunked_token_logprobs(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(primitives, "chunked_token_logprobs", spy)
    hook = net.get_decoder().layers[0].self_attn.register_forward_hook(
        lambda *_: calls.__setitem__("layer0", calls["layer0"] + 1))
    try:
        res = hub.forward_backward("a", data, "cross_entropy", {}, forward_only=False)
    finally:
        hook.remove()
    assert calls == {"head": 2, "layer0": 3}
    for got, one in zip(res.logprobs, alone, strict=True):
        assert_scaled_close(got, one.logprobs[0], shape_rtol(40), "log-probs in a shared micro-batch")
    assert res.loss_sum == pytest.approx(sum(r.loss_sum for r in alone), rel=shape_rtol(40))
    assert_grads_close({str(i): p.grad for i, p in enumerate(tm.params)},  # type: ignore[misc]
                       ref_grads, shape_rtol(40), "accumulated gradient")
