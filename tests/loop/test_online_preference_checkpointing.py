"""``optim.gradient_checkpointing`` in online preference optimisation (``trainer: preference``, online).

The policy learner enables transformers' activation checkpointing, which acts only in train mode; the RL
update enters train mode around its gradient forward, but the online preference step ran its pair loss on
the learner's model in eval mode, so the setting was accepted and did nothing (autograd kept every
activation). The step's pair loss now runs under the learner's grad mode (``forward_backward_custom``): the layers' activations are
recomputed in the backward instead of kept, and the gradients are those without checkpointing.
"""

from __future__ import annotations

import copy

import torch

from posttrain.loop.builders import build_model, build_policy_learner
from posttrain.loop.preference_batch import EncodedPair, pair_logprobs
from posttrain.loop.preference_step import PairBatch
from posttrain.loop.validate import load_run_config
from tests._tolerance import assert_grads_close, shape_rtol

PAIRS = [EncodedPair(f"p{i}", (5 + i, 6, 7), (8, 9 + i, 2), (10, 11, 12 + i, 2), None, f"pair {i}") for i in range(3)]


def _grads(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Parameter gradients of one online pair loss, and the elements autograd saved for its backward."""
    from posttrain.loop.online_preference import online_pair_loss

    cfg = load_run_config("dpo_online", ["model.path=builtin:micro", "sft.steps=0", "sft.examples=2000",
                                         "sft.batch_size=64", "sft.lr=0.003", "model.dtype=float64",
                                         f"optim.gradient_checkpointing={str(checkpointing).lower()}"])
    torch.manual_seed(0)
    _, model = build_model(cfg)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    learner = build_policy_learner(cfg, model)
    batch = PairBatch(PAIRS, *pair_logprobs(ref, PAIRS, pad_id=0, microbatch_tokens=4096))
    with torch.no_grad():  # move the policy off the reference, so the loss has a gradient
        for p in learner.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    learner.model.zero_grad()
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        learner.forward_backward_custom(list(range(len(PAIRS))), online_pair_loss(learner, batch, cfg, pad_id=0))
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}, saved[0]


def test_online_pair_loss_checkpoints_activations_and_keeps_the_gradients() -> None:
    plain, plain_saved = _grads(False)
    ckpt, ckpt_saved = _grads(True)
    # activations recomputed in the backward instead of kept (measured: ~10x fewer saved elements on micro)
    assert ckpt_saved < plain_saved / 3, (ckpt_saved, plain_saved)
    assert plain.keys() == ckpt.keys() and plain
    # the same computation recomputed: within float32 rounding (the attention softmax runs in float32)
    assert_grads_close(ckpt, plain, rtol=shape_rtol(8), msg="checkpointed vs kept activations")
