"""Truncated sampling replayed on the learner side: pi_old equals the sampler's renormalised mu.

With top-k / top-p the built-in sampler (and vLLM's processed log-probs) record log-probs of the
softmax renormalised over the kept set; a learner that recomputes the full softmax then sees
``log kappa = log pi_old - log mu = log(mass of the kept set) < 0`` on every token. With
``sampling.replay_truncation`` the learner recomputes the kept set and |log kappa| is rounding only.
"""

import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.learner.logprobs import forward_logprobs, kept_set_mask
from posttrain.loop.training_loop import train
from posttrain.rollout.sampling import behaviour_logprobs
from posttrain.trajectory import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol  # noqa: E402


def _mu(logits: torch.Tensor, T: float, k: int, p: float) -> torch.Tensor:
    B = logits.shape[0]
    return behaviour_logprobs(logits, torch.full((B,), T, dtype=torch.float64), torch.full((B,), k),
                              torch.full((B,), p, dtype=torch.float64), torch.zeros(B, dtype=torch.float64))


def test_kept_set_hand_case():
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (logits = log p)
    z = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]], dtype=torch.float64))
    # top-p 0.7: mass before each token 0, 0.5, 0.75, ... -> keep the first two
    assert kept_set_mask(z, top_p=0.7).tolist() == [[True, True, False, False, False]]
    # top-p 0.75: the third token's preceding mass is 0.75 (not < 0.75) -> dropped
    assert kept_set_mask(z, top_p=0.75).tolist() == [[True, True, False, False, False]]
    # top-k 4 keeps the tie at the 4th value (both 0.0625 logits)
    assert kept_set_mask(z, top_k=4).tolist() == [[True, True, True, True, True]]
    assert kept_set_mask(z, top_k=1).tolist() == [[True, False, False, False, False]]
    # top-k then top-p over the renormalised top-3: 4/7, 2/7, 1/7 -> before = 0, 4/7, 6/7; p=0.8 keeps two
    assert kept_set_mask(z, top_k=3, top_p=0.8).tolist() == [[True, True, False, False, False]]
    with pytest.raises(ValueError, match="top_p"):
        kept_set_mask(z, top_p=0.0)


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 0.6), (0.7, 5, 1.0), (1.3, 8, 0.9), (1.0, 0, 1.0)])
def test_kept_set_equals_the_samplers(T, k, p):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 40, generator=g, dtype=torch.float64) * 3
    finite = torch.isfinite(_mu(logits, T, k, p))
    assert torch.equal(kept_set_mask(logits / T, top_k=k, top_p=p), finite)


def test_replayed_logprobs_equal_mu_and_full_softmax_does_not(make_model, make_batch):
    """forward_logprobs with the sampler's top-k/top-p gives mu exactly (float64 model); without, the
    gap is log(kept mass), far above the tolerance, so the test catches a learner that ignores it."""
    model, b = make_model(), make_batch(n=6)
    T, k, p = 0.9, 6, 0.8
    with torch.no_grad():
        # make every recorded token one the sampler could have drawn: the greedy continuation (the argmax
        # is always kept); causal, so L passes fix it position by position
        ids = b.input_ids.clone()
        live = b.attention_mask[:, 1:] > 0
        for _ in range(ids.shape[1]):
            logits = model(input_ids=ids, attention_mask=b.attention_mask).logits[:, :-1]
            ids[:, 1:] = torch.where(live, logits.argmax(-1), ids[:, 1:])
        logits = model(input_ids=ids, attention_mask=b.attention_mask).logits[:, :-1]
        mu = _mu(logits.reshape(-1, logits.shape[-1]), T, k, p).reshape(logits.shape)
        mu_tok = torch.where(live, mu.gather(-1, ids[:, 1:, None]).squeeze(-1), 0.0)
        lp_rep, _ = forward_logprobs(model, ids, b.attention_mask, temperature=T, top_k=k, top_p=p)
        lp_full, _ = forward_logprobs(model, ids, b.attention_mask, temperature=T)
    tol = shape_rtol(logits.shape[-1], torch.float64)
    assert (lp_rep[:, 1:] - mu_tok).abs().max() <= tol
    assert (lp_full[:, 1:] - mu_tok).abs().max() > 1e-3


def test_a_token_outside_the_recomputed_set_stays_finite(make_model, make_batch):
    model, b = make_model(), make_batch(n=4)
    with torch.no_grad():
        lp, _ = forward_logprobs(model, b.input_ids, b.attention_mask, top_k=1)  # random tokens, mostly not argmax
    assert torch.isfinite(lp).all()
    assert (lp[b.attention_mask == 0] == 0).all()


_RUN = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=4",
        "sampling.group_size=4", "sampling.max_new_tokens=4", "eval.size=8", "eval.every=100", "steps=1",
        "logging.progress=false", "guards.max_truncation_rate=1.0", "checkpoint_every=0", "optim.fuse_old_logprob=false",
        "sampling.top_p=0.7", "sampling.top_k=8", "guards.action=warn", "sft.steps=0"]


def test_run_with_top_p_keeps_kappa_at_rounding_only_with_replay(tmp_path):
    train(load_config("grpo", [*_RUN, f"run_dir={tmp_path / 'replay'}"]))
    train(load_config("grpo", [*_RUN, "sampling.replay_truncation=false", f"run_dir={tmp_path / 'full'}"]))
    rep = Ledger(tmp_path / "replay" / "ledger").read_metrics()[0]
    full = Ledger(tmp_path / "full" / "ledger").read_metrics()[0]
    # built-in engine vs learner, float32 micro model: rounding of a V=~100 softmax in two code paths
    assert rep["logkappa_abs_max"] < 1e-4
    assert full["logkappa_abs_max"] > 1e-2  # log of the kept mass: what the replay removes
