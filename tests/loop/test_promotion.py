"""The revision judgement (loop/promotion.py): promoted at a new best, retained within ``reject_drop`` of it,
rejected below it with the promoted weights restored; a NaN loss rejects without a snapshot to restore."""

from __future__ import annotations

import torch

from posttrain.loop.checkpointing import RunState
from posttrain.loop.promotion import Promotion


def _judge() -> tuple[torch.nn.Linear, RunState, Promotion]:
    model = torch.nn.Linear(2, 1, bias=False)
    state = RunState()
    return model, state, Promotion(model, state, reject_drop=0.1)


def test_promote_retain_reject_restores_the_promoted_weights() -> None:
    model, state, judge = _judge()
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert judge.judge(0, 0.5) == ("promoted", "")
    with torch.no_grad():
        model.weight.fill_(2.0)
    assert judge.judge(1, 0.45) == ("retained", "")  # within reject_drop of the best: the weights stay
    assert torch.equal(model.weight, torch.full((1, 2), 2.0))
    decision, reason = judge.judge(2, 0.3)  # 0.3 < 0.5 - 0.1: a collapse
    assert decision == "rejected" and "0.300" in reason and "0.500" in reason
    assert torch.equal(model.weight, torch.full((1, 2), 1.0))  # the step-0 snapshot is back
    assert (state.best_heldout_accuracy, state.promoted_step) == (0.5, 0)
    assert [d["decision"] for d in state.decisions] == ["promoted", "retained", "rejected"]
    assert judge.judge(3, 0.6) == ("promoted", "") and state.promoted_step == 3


def test_reject_without_a_snapshot_keeps_the_weights_and_records_the_reason() -> None:
    model, state, judge = _judge()
    before = model.weight.detach().clone()
    judge.reject(4, "non-finite loss nan")
    assert torch.equal(model.weight, before)
    assert state.decisions == [{"step": 4, "decision": "rejected", "reason": "non-finite loss nan"}]
