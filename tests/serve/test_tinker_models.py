"""Training models share one base network as separate peft adapters: training one leaves another's
outputs exactly as they were, and a new adapter starts as the base model."""

from __future__ import annotations

import torch

from posttrain.serve.tinker_app import load_base
from posttrain.serve.tinker_models import AdamStep, LoraSpec, ModelHub
from posttrain.serve.wire import DatumIn

TOKENS = list(range(5, 17))


def _datum() -> DatumIn:
    return DatumIn(TOKENS[:-1], {"target_tokens": torch.tensor(TOKENS[1:]), "weights": torch.ones(len(TOKENS) - 1)})


def _lp(hub: ModelHub, model_id: str) -> torch.Tensor:
    return hub.forward_backward(model_id, [_datum()], "cross_entropy", {}, forward_only=True).logprobs[0]


def test_adapters_are_isolated_and_start_at_the_base() -> None:
    _, net = load_base("builtin:tiny")
    assert isinstance(net, torch.nn.Module)
    with torch.no_grad():
        base_lp = torch.log_softmax(net(input_ids=torch.tensor([TOKENS[:-1]])).logits[0], -1)
        base_lp = base_lp.gather(-1, torch.tensor(TOKENS[1:]).view(-1, 1)).squeeze(-1)
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
