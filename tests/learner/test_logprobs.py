"""Per-token log-probs: the shifted gather of log_softmax(z / T), zeros where no token."""

import sys
from pathlib import Path

import pytest
import torch

from posttrain.learner.logprobs import FullLogits, forward_logprobs, linear_head_of, token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_scaled_close, shape_rtol  # noqa: E402


def _hand(model, ids, am, T):
    """Reference: loop over rows and positions; logprob[b, t] = log_softmax(z[b, t-1] / T)[id[b, t]]."""
    logits = model(input_ids=ids, attention_mask=am).logits
    B, L = ids.shape
    out = torch.zeros(B, L, dtype=logits.dtype)
    ent = torch.zeros(B, L, dtype=logits.dtype)
    for b in range(B):
        for t in range(1, L):
            if am[b, t]:
                lp = torch.log_softmax(logits[b, t - 1] / T, dim=-1)
                out[b, t] = lp[ids[b, t]]
                ent[b, t] = -(lp.exp() * lp).sum()
    return out, ent


# Both paths of forward_logprobs: the chunked LM head (the micro preset is a Qwen2 causal LM with a
# plain head) and the model's own forward to full logits (the same model behind FullLogits).
PATHS = {"chunked": lambda m: m, "full": FullLogits}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [1.0, 0.7, 1.5])
def test_matches_hand_gather_and_zeros(make_model, make_batch, T, path):
    model, b = PATHS[path](make_model()), make_batch(n=5)
    assert (linear_head_of(model) is not None) is (path == "chunked")
    with torch.no_grad():
        lp, ent = forward_logprobs(model, b.input_ids, b.attention_mask, temperature=T, with_entropy=True)
        ref, ref_ent = _hand(model, b.input_ids, b.attention_mask, T)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    assert (lp[:, 0] == 0).all()
    assert (lp[b.attention_mask == 0] == 0).all() and (ent[b.attention_mask == 0] == 0).all()
    assert (lp[:, 1:][b.attention_mask[:, 1:] == 1] < 0).all()


def test_temperature_is_division_of_logits(make_model, make_batch):
    # T = 2 on the model equals T = 1 on a model whose logits are halved: check one token by hand.
    model, b = make_model(), make_batch(n=2)
    with torch.no_grad():
        lp2, _ = forward_logprobs(model, b.input_ids, b.attention_mask, temperature=2.0)
        z = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[0, 0]
    tok = b.input_ids[0, 1]
    expected = z[tok] / 2 - torch.logsumexp(z / 2, dim=-1)
    assert float(lp2[0, 1]) == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("budget", [1, 7, 20, 10_000])
def test_microbatched_equals_single_forward(make_model, make_batch, budget):
    model, b = make_model(), make_batch(n=9)
    full, full_ent = token_logprobs(model, b.input_ids, b.attention_mask, with_entropy=True)
    mb, mb_ent = token_logprobs(
        model, b.input_ids, b.attention_mask, microbatch_tokens=budget, with_entropy=True
    )
    # Micro-batches have other shapes than the whole batch: equal up to the float32 attention
    # softmax's rounding (tests/_tolerance.py), scaled by the largest |log-prob| / entropy.
    rtol = shape_rtol(int(b.lengths.max()))
    assert_scaled_close(mb, full, rtol, "logprob")
    assert_scaled_close(mb_ent, full_ent, rtol, "entropy")
    assert ((mb == 0) == (full == 0)).all()  # the same positions are empty (no token / masked)
    assert not mb.requires_grad


def test_microbatch_tolerance_catches_a_shifted_row(make_model, make_batch):
    """The tolerance above still catches a real bug: one row's log-probs from another row."""
    model, b = make_model(), make_batch(n=9)
    full, _ = token_logprobs(model, b.input_ids, b.attention_mask)
    wrong = full.clone()
    wrong[0], wrong[1] = full[1], full[0]
    with pytest.raises(AssertionError):
        assert_scaled_close(wrong, full, shape_rtol(int(b.lengths.max())))


@pytest.mark.parametrize("path", PATHS)
def test_grad_variant_carries_grad(make_model, make_batch, path):
    model, b = PATHS[path](make_model()), make_batch(n=3)
    lp, ent = forward_logprobs(model, b.input_ids, b.attention_mask, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_bad_input_is_a_clear_error(make_model, make_batch):
    model, b = make_model(), make_batch(n=2)
    with pytest.raises(ValueError, match="temperature"):
        forward_logprobs(model, b.input_ids, b.attention_mask, temperature=0.0)
    with pytest.raises(ValueError, match="attention_mask"):
        forward_logprobs(model, b.input_ids, b.attention_mask[:, :-1])


class _NoKeep(torch.nn.Module):
    """The same model behind a forward that does not take ``logits_to_keep`` (the slicing fallback)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


@pytest.mark.parametrize("wrap", [False, True])
def test_first_position_keeps_the_scored_columns_and_zeros_the_rest(make_model, make_batch, wrap):
    from posttrain.learner.logprobs import accepts_logits_to_keep, first_scored_position

    model, b = make_model(), make_batch(n=6)
    if wrap:
        model = _NoKeep(model)
    assert accepts_logits_to_keep(model) is (not wrap)
    f = first_scored_position(b.action_mask)
    assert f == int(b.action_mask.ne(0).any(dim=0).nonzero()[0]) and f > 1  # prompts are >= 2 tokens
    with torch.no_grad():
        full, ent_full = forward_logprobs(model, b.input_ids, b.attention_mask, with_entropy=True)
        lp, ent = forward_logprobs(model, b.input_ids, b.attention_mask, first_position=f, with_entropy=True)
    assert lp.shape == full.shape and (lp[:, :f] == 0).all() and (ent[:, :f] == 0).all()
    # another LM-head shape: equal up to rounding (float64 model, float32 attention softmax)
    rtol = shape_rtol(b.input_ids.shape[1])
    assert_scaled_close(lp[:, f:], full[:, f:], rtol, "kept columns")
    assert_scaled_close(ent[:, f:], ent_full[:, f:], rtol, "kept entropies")
    # every action token is at or after f: the masked log-probs agree everywhere
    am = b.action_mask.to(lp.dtype)
    assert_scaled_close(lp * am, full * am, rtol, "action tokens")
    # and the tolerance catches an off-by-one (log-probs of the neighbouring position)
    shifted = torch.zeros_like(full)
    shifted[:, f:] = full[:, f - 1:-1]
    with pytest.raises(AssertionError):
        assert_scaled_close(lp[:, f:], shifted[:, f:], rtol)


def test_first_scored_position_edge_cases():
    from posttrain.learner.logprobs import first_scored_position

    assert first_scored_position(None) == 1
    assert first_scored_position(torch.zeros(2, 5)) == 1
    m = torch.zeros(2, 6)
    m[0, 4:] = 1
    m[1, 3:5] = 1
    assert first_scored_position(m) == 3
    m[:, 0] = 1  # column 0 has no prediction: never a scored position
    assert first_scored_position(m) == 3
