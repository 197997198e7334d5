"""Packed rows through the primitives' plain forward (posttrain/learner/primitives.py ``plain_logprobs`` /
``forward_backward`` with a ``position_ids`` batch tensor): several sequences per batch row, position ids restarting
at 0 at each, get the log-probs and gradients each sequence has alone, through the full logits and the chunked head,
on the model families posttrain trains (Qwen2: the builtin tiny models; Llama: SmolLM2), whole blocks per
micro-batch. Tolerances: tests/_tolerance.py (the two sides differ in attention shapes over at most ``T`` keys)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.microbatch import Microbatch
from posttrain.learner.primitives import ForwardSpec, LossBatch, LossTerms, plain_logprobs
from posttrain.learner.settings import BatchingSettings
from posttrain.models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, assert_scaled_close, shape_rtol  # noqa: E402

VOCAB = 64
BLOCKS = [[5, 9, 3], [11]]
"""Sequence lengths per batch row: a block of three sequences (then tail padding) and one of a single sequence."""


def _model(family: str) -> torch.nn.Module:
    if family == "qwen2":
        return build_tiny_model("micro", vocab_size=VOCAB, seed=3)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # SmolLM2's shape
    return LlamaForCausalLM(cfg).eval()


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n,), generator=g) for block in BLOCKS for n in block]


def _packed(seqs: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor | None], list[tuple[int, int, int]]]:
    """The batch tensors of :data:`BLOCKS` (``T`` = the longest block + 2 columns of tail padding) and each
    sequence's ``(row, start, end)``."""
    T = max(sum(b) for b in BLOCKS) + 2
    ids, am, pos, mask = (torch.zeros(len(BLOCKS), T, dtype=torch.long) for _ in range(4))
    spans, k = [], 0
    for b, block in enumerate(BLOCKS):
        at = 0
        for n in block:
            ids[b, at:at + n], pos[b, at:at + n], mask[b, at + 1:at + n] = seqs[k], torch.arange(n), 1
            spans.append((b, at, at + n))
            at, k = at + n, k + 1
        am[b, :at], pos[b, at:] = 1, torch.arange(T - at)
    return {"input_ids": ids, "attention_mask": am, "position_ids": pos, "loss_mask": mask}, spans


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_rows_get_the_logprobs_each_row_has_alone(family: str, chunked: bool) -> None:
    model, seqs = _model(family), _sequences()
    t, spans = _packed(seqs)
    with torch.no_grad():
        lp = plain_logprobs(model, t["input_ids"], t["attention_mask"], position_ids=t["position_ids"],
                            chunked=chunked)
        naive = plain_logprobs(model, t["input_ids"], t["attention_mask"], chunked=chunked)  # one causal sequence
        for s, (b, start, end) in zip(seqs, spans, strict=True):
            alone = plain_logprobs(model, s[None], torch.ones_like(s)[None], chunked=chunked)[0]
            assert_scaled_close(lp[b, start:end], alone, shape_rtol(t["input_ids"].shape[1]), f"{family} {start}")
            assert float(lp[b, start]) == 0.0  # a sequence's first token has no context of its own
            if start > 0:  # without the position ids the later sequences see the earlier ones
                assert float((naive[b, start + 1:end] - alone[1:]).abs().max()) > 1e-3
    if chunked:
        assert float(lp[0, sum(BLOCKS[0]):].abs().max()) == 0.0  # tail padding is never scored


class _NLL:
    """``-sum(m * lp) / N`` on the plain forward (the SFT loss's shape)."""

    def __init__(self, chunked: bool) -> None:
        self.spec = ForwardSpec(sampler_replay=False, autocast=False, chunked_head=chunked)

    def __call__(self, logprob: torch.Tensor, entropy: torch.Tensor | None, mb: Microbatch,
                 batch: LossBatch) -> LossTerms:
        return LossTerms(loss=-(logprob * mb["loss_mask"]).sum() / batch.num_tokens)

    def metric_keys(self) -> tuple[list[str], list[str], list[str]]:
        return [], [], []

    def rows_without_gradient(self, batch: LossBatch, rows: Sequence[int]) -> list[int]:
        return []


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("budget", [None, 8])
def test_forward_backward_of_packed_blocks_is_each_row_alone(budget: int | None, chunked: bool) -> None:
    """``forward_backward`` of a batch with ``position_ids`` (budget 8: every block, wider than the budget, is one
    whole micro-batch) returns each sequence's log-probs alone and the gradient of the sum of their losses."""
    seqs = _sequences()
    t, spans = _packed(seqs)
    n = float(sum(len(s) - 1 for s in seqs))
    ref = _model("qwen2")
    for s in seqs:
        alone = plain_logprobs(ref, s[None], torch.ones_like(s)[None], chunked=chunked)
        (-alone[0, 1:].sum() / n).backward()  # type: ignore[no-untyped-call]
    learner = PolicyLearner(_model("qwen2"), batching=BatchingSettings(microbatch_tokens=budget))
    out = learner.forward_backward(LossBatch(t, [0, 1], n), _NLL(chunked))
    assert out.logprob is not None
    rtol = shape_rtol(t["input_ids"].shape[1])
    for s, (b, start, end) in zip(seqs, spans, strict=True):
        with torch.no_grad():
            alone = plain_logprobs(ref, s[None], torch.ones_like(s)[None], chunked=chunked)[0].double()
        assert_scaled_close(out.logprob[b, start:end], alone, rtol, f"row {b} [{start}:{end}]")
    assert_grads_close(_grads(learner.model), _grads(ref), rtol)


def test_the_sampler_replay_refuses_packed_rows() -> None:
    t, _ = _packed(_sequences())
    learner = PolicyLearner(_model("qwen2"))
    loss = _NLL(False)
    loss.spec = ForwardSpec(sampler_replay=True)
    with pytest.raises(ValueError, match="plain forward only"):
        learner.forward_backward(LossBatch(t, [0, 1], 1.0), loss)
