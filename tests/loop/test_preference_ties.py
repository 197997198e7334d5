"""A policy equal to its reference up to rounding has no winning pair: step and held-out accuracy are 0.

The reference's log-probs are computed once (another batch shape than a step's micro-batches), so a policy
equal to it differs by rounding only (~1e-7 relative in float32). Here that rounding is made explicit and
one-signed: the reference is the policy's exact log-probs times (1 + 2 eps) for chosen and (1 - 2 eps) for
rejected, which gives every pair a margin of +2 eps (|pi_c| + |pi_r|) > 0, a "win" before ties existed. The
tie band, shape_rtol(n, float32) = 4 n eps relative with n >= 10 tokens, is 20x wider. A real margin of 0.05
(the rejected response's reference log-prob raised by 0.05) still counts.
"""

from __future__ import annotations

import torch

from posttrain.config import RECIPES_DIR
from posttrain.loop.builders import build_model, build_renderer
from posttrain.loop.preference_batch import encode_pair, pair_logprobs
from posttrain.loop.preference_step import PairBatch, PairBatchLoss
from posttrain.loop.preference_training import evaluate_pairs, load_pairs
from posttrain.loop.validate import load_run_config

PAIRS = RECIPES_DIR / "data" / "shout_pairs.jsonl"
EPS = torch.finfo(torch.float32).eps


def test_noise_level_reference_gives_zero_accuracy_and_a_real_margin_wins() -> None:
    cfg = load_run_config("dpo", [f"preference.data={PAIRS}", "model.path=builtin:micro", "logging.progress=false"])
    torch.manual_seed(0)
    tokenizer, model = build_model(cfg)
    model.eval()
    renderer = build_renderer(cfg, tokenizer)
    pad_id = int(tokenizer.pad_token_id or 0)
    train, _ = load_pairs(cfg)
    pairs = [encode_pair(p, renderer, tokenizer, max_length=cfg.preference.max_length) for p in train[:8]]
    assert min(len(p.prompt) + min(len(p.chosen), len(p.rejected)) for p in pairs) >= 10
    c, r = pair_logprobs(model, pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)
    assert next(model.parameters()).dtype == torch.float32

    noise = PairBatch(pairs, c * (1 + 2 * EPS), r * (1 - 2 * EPS))
    held = evaluate_pairs(model, noise, cfg, pad_id)
    assert held["heldout/margin"] > 0  # every margin is +2 eps (|pi_c| + |pi_r|): positive, within rounding
    assert held["heldout/pair_accuracy"] == 0.0
    step = PairBatchLoss(model, noise, cfg, pad_id)
    step.backward(range(len(pairs)), float(len(pairs)))
    assert step.metrics["reward_accuracy"] == 0.0

    real = PairBatch(pairs, c * (1 + 2 * EPS), r + 0.05)  # h = 0.05 + 2 eps |pi_c|
    assert evaluate_pairs(model, real, cfg, pad_id)["heldout/pair_accuracy"] == 1.0
    model.zero_grad()
    step = PairBatchLoss(model, real, cfg, pad_id)
    step.backward(range(len(pairs)), float(len(pairs)))
    assert step.metrics["reward_accuracy"] == 1.0
