"""The SFT warm-up honours ``optim.microbatch_tokens`` as every other update does.

The RL update, the critic and the preference losses cut each mini-batch into micro-batches of at most
``optim.microbatch_tokens`` padded tokens; the SFT warm-up ran its whole ``sft.batch_size`` batch in one
forward whatever the budget, so lowering the budget to fit memory did nothing there. Now its answer NLL
accumulates micro-batches within the budget, normalised by the mini-batch's answer tokens, so the gradient
is the one-pass gradient (within float rounding).
"""

from __future__ import annotations

import copy

import torch

from posttrain.learner import PolicyLearner
from posttrain.learner.sft import AnswerNLL, run_sft, sft_batch
from posttrain.loop.builders import build_model
from posttrain.loop.validate import load_run_config
from tests._tolerance import assert_grads_close, shape_rtol

# (prompt ids, answer ids + eos): row lengths 6, 8, 10, 9, 7, 9, 8, 10 (padded width 10)
PAIRS = [([5 + i, 6, 7, 8][: 2 + i % 3], [9, 10 + i, 11, 12, 13, 2][: 3 + i % 4] + [2]) for i in range(8)]


def _model() -> torch.nn.Module:
    _, model = build_model(load_run_config(None, ["model.path=builtin:micro", "model.dtype=float64"]))
    return model


def _forwards(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_hook(lambda _m, args, kwargs, _out: calls.append(int(kwargs["input_ids"].numel())),
                                with_kwargs=True)
    return calls


def test_answer_nll_accumulates_micro_batches_within_the_budget_with_the_one_pass_gradient() -> None:
    base = _model()
    grads = {}
    for budget in (None, 24):
        model = copy.deepcopy(base).train()
        calls = _forwards(model)
        learner = PolicyLearner(model, microbatch_tokens=budget)
        model.train()
        out = learner.forward_backward(sft_batch(PAIRS, 0, torch.device("cpu")), AnswerNLL())
        grads[budget] = ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls,
                         out.loss)
    (g1, calls1, l1), (g2, calls2, l2) = grads[None], grads[24]
    assert calls1 == [8 * 10]  # the whole batch in one forward
    # hand-computed (longest first, each group padded to its first row): [10, 10] -> 20 tokens, [9, 9] -> 18,
    # [8, 8, 7] -> 24, [6] -> 6
    assert calls2 == [20, 18, 24, 6]
    assert_grads_close(g2, g1, rtol=shape_rtol(10, torch.float32), msg="micro-batched SFT vs one pass")
    assert abs(l2 - l1) <= shape_rtol(10, torch.float32) * abs(l1)


def test_run_sft_passes_the_budget_to_every_step() -> None:
    model = _model()
    calls = _forwards(model)
    run_sft(PolicyLearner(model, microbatch_tokens=24), lambda s: PAIRS, steps=2, lr=1e-3, pad_token_id=0)
    assert calls == [20, 18, 24, 6] * 2  # each step's batch in the budget's micro-batches
