"""``posttrain check`` for ``trainer: preference``: the preference-loss invariants on a few pairs, no training.

On encoded pairs (offline: the first training pairs of ``preference.data``; online: pairs built from
the sampled groups by :func:`~posttrain.loop.online_preference.group_pairs`) and the configured model:

1. ``reference_equals_policy``: at the start the policy is the frozen reference, so every pair's implicit
   reward margin (:func:`~posttrain.loop.preference_loss.implicit_margin`) is 0 and the loss equals its
   value at zero margin: ``log 2`` for DPO (Rafailov et al. 2023, arXiv:2305.18290; any label smoothing),
   ``(1 / (2 tau))^2`` for IPO (Azar et al. 2023, arXiv:2310.12036), ``lambda / 2`` per response for KTO
   (Ethayarajh et al. 2024, arXiv:2402.01306; z0 = 0); ODPO's offset depends on each pair's score, so
   only the margins are checked. SimPO / ORPO read no reference: ``n/a``.
2. ``mask_invariance``: the loss and gradient are unchanged when the padding beyond each row's response
   (the pad token id) changes and when a pair is batched beside a longer one.
3. ``microbatch_split``: gradients with one pair per micro-batch equal the whole-batch gradients.

Offline runs add ``pairs_load`` (both splits non-empty) and ``save_resume`` (a checkpoint round trip
keeps the log-probs and the data cursor).
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from posttrain.commands.check_result import CheckResult, gradients, max_rel
from posttrain.config import RunConfig
from posttrain.loop.preference_batch import EncodedPair, pair_logprobs
from posttrain.loop.preference_loss import (
    implicit_margin,
    kto_reference_point,
    preference_loss,
    uses_reference,
)
from posttrain.loop.preference_step import PairBatch, PairBatchLoss
from posttrain.loop.preference_step import reference_batch as pair_reference_batch

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

GRAD_RTOL = 1e-4
"""Largest relative gradient difference the shape checks accept (float32 reductions over other shapes)."""


def _loss_and_grads(model: torch.nn.Module, batch: PairBatch, cfg: RunConfig, pad_id: int
                    ) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean preference loss of every pair of ``batch`` and its gradient (``optim.microbatch_tokens`` of ``cfg``)."""
    loss = PairBatchLoss(model, batch, cfg, pad_id)
    rows = list(range(len(batch.pairs)))
    model.zero_grad(set_to_none=True)
    loss.backward(rows, loss.normaliser(rows))
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return loss.metrics["loss"], grads


def reference_batch(ref: torch.nn.Module | None, pairs: Sequence[EncodedPair], cfg: RunConfig, pad_id: int) -> PairBatch:
    """``pairs`` with ``ref``'s sequence log-probs (None for a reference-free loss), as the offline trainer
    takes them (:func:`~posttrain.loop.preference_step.reference_batch`, ``optim.microbatch_tokens``)."""
    return pair_reference_batch(ref, pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)


def zero_margin_loss(loss: str, kwargs: dict[str, object]) -> float | None:
    """The mean loss at zero implicit margin (policy = reference), by hand; None where it depends on the data."""
    if loss == "dpo":
        return math.log(2.0)
    if loss == "ipo":
        return float((1.0 / (2.0 * float(kwargs.get("tau", 0.1)))) ** 2)  # type: ignore[arg-type]
    if loss == "kto":  # r = 0, z0 = 0: lambda - lambda * sigmoid(0) per response, chosen and rejected halves
        return (float(kwargs.get("lambda_d", 1.0)) + float(kwargs.get("lambda_u", 1.0))) / 4.0  # type: ignore[arg-type]
    return None


def check_reference_equals_policy(model: torch.nn.Module, ref: torch.nn.Module | None,
                                  pairs: Sequence[EncodedPair], cfg: RunConfig, pad_id: int) -> CheckResult:
    """Check 1 of the module docstring on ``model`` against the frozen ``ref`` (None: the loss has none)."""
    name = "reference_equals_policy"
    loss_name = cfg.preference.loss
    if ref is None or not uses_reference(loss_name):
        return name, None, f"preference.loss={loss_name} reads no reference model (reference-free)"
    batch = reference_batch(ref, pairs, cfg, pad_id)
    c, r = pair_logprobs(model, pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)
    lp = batch.logprobs(range(len(pairs)), c, r)
    margin = float(implicit_margin(loss_name, lp).abs().max())
    z0 = kto_reference_point(lp) if loss_name == "kto" else 0.0
    with torch.no_grad():
        value = float(preference_loss(loss_name, cfg.preference.kwargs, lp, kl_ref_point=z0)[0].mean())
    expect = zero_margin_loss(loss_name, dict(cfg.preference.kwargs))
    ok = margin <= 1e-5
    detail = f"max |margin| = {margin:.2e} over {len(pairs)} pairs"
    if expect is None:
        detail += f"; loss {value:.6f} (no hand value for {loss_name}: its offset depends on each pair's score)"
    else:
        ok = ok and abs(value - expect) <= 1e-5 * max(1.0, expect)
        detail += f"; loss {value:.6f}, at zero margin {expect:.6f}"
    return name, ok, detail


def check_mask_invariance(model: torch.nn.Module, batch: PairBatch, cfg: RunConfig, pad_id: int) -> CheckResult:
    """Check 2 of the module docstring: another pad token id, and each pair alone vs. batched with the others."""
    la, ga = _loss_and_grads(model, batch, cfg, pad_id)
    lb, gb = _loss_and_grads(model, batch, cfg, pad_id - 1 if pad_id > 0 else 1)  # another id in the vocabulary
    rel_pad = max_rel(ga, gb)
    # One pair, then the same pair beside the longest one: padding to the longer row must not move its loss.
    longest = max(range(len(batch.pairs)), key=lambda i: batch.pairs[i].tokens)
    shortest = min(range(len(batch.pairs)), key=lambda i: batch.pairs[i].tokens)
    with torch.no_grad():
        alone = pair_logprobs(model, [batch.pairs[shortest]], pad_id=pad_id, microbatch_tokens=10**9)
        beside = pair_logprobs(model, [batch.pairs[shortest], batch.pairs[longest]], pad_id=pad_id,
                               microbatch_tokens=10**9)
    d_pad_len = max(abs(float(alone[k][0] - beside[k][0])) for k in (0, 1))
    ok = abs(la - lb) <= 1e-6 * max(1.0, abs(la)) and rel_pad < GRAD_RTOL and d_pad_len <= 1e-4
    return ("mask_invariance", ok, f"other pad id: |d loss| = {abs(la - lb):.2e}, max rel |d grad| = {rel_pad:.2e}; "
            f"padded beside a longer pair: |d logprob| = {d_pad_len:.2e}")


def check_microbatch_split(model: torch.nn.Module, batch: PairBatch, cfg: RunConfig, pad_id: int) -> CheckResult:
    """Check 3 of the module docstring (``optim.microbatch_tokens`` 1 vs unbounded)."""
    def with_budget(tokens: int) -> RunConfig:
        return cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"microbatch_tokens": tokens})})

    la, ga = _loss_and_grads(model, batch, with_budget(10**9), pad_id)
    lb, gb = _loss_and_grads(model, batch, with_budget(1), pad_id)
    rel = max_rel(ga, gb)
    return ("microbatch_split", rel < GRAD_RTOL and abs(la - lb) <= 1e-5 * max(1.0, abs(la)),
            f"1 pair vs whole batch: |d loss| = {abs(la - lb):.2e}, max rel |d grad| = {rel:.2e}")


def pair_checks(model: torch.nn.Module, ref: torch.nn.Module | None, pairs: Sequence[EncodedPair], cfg: RunConfig,
                pad_id: int) -> list[CheckResult]:
    """Checks 1-3 of the module docstring on ``pairs`` (the policy ``model`` in eval mode; ``ref`` frozen)."""
    batch = reference_batch(ref, pairs, cfg, pad_id)
    return [check_reference_equals_policy(model, ref, pairs, cfg, pad_id),
            check_mask_invariance(model, batch, cfg, pad_id),
            check_microbatch_split(model, batch, cfg, pad_id)]


def _save_resume(cfg: RunConfig, model: torch.nn.Module, tokenizer: Tokenizer, pairs: Sequence[EncodedPair],
                 pad_id: int) -> CheckResult:
    from posttrain.loop.builders import build_model
    from posttrain.loop.lifecycle import RunParts, restore_run_checkpoint, save_run_checkpoint, step_trainer

    before = pair_logprobs(model, pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)
    extra: dict[str, object] = {"trainer": "preference", "cursor": 123, "wall_seconds": 1.5, "curve": [[0, 0.5]]}
    with tempfile.TemporaryDirectory() as d:  # through the run lifecycle's own saver and loader
        save_run_checkpoint(Path(d), RunParts("preference", model, tokenizer, step_trainer(cfg, model)), 1, extra)
        seed = cfg.model.model_copy(update={"init_seed": cfg.model.init_seed + 1})
        _, fresh = build_model(cfg.model_copy(update={"model": seed}))
        fresh.eval()
        step, got = restore_run_checkpoint(Path(d), RunParts("preference", fresh, tokenizer, step_trainer(cfg, fresh)))
    after = pair_logprobs(fresh, pairs, pad_id=pad_id, microbatch_tokens=cfg.optim.microbatch_tokens)
    dlp = max(float((a - b).abs().max()) for a, b in zip(before, after, strict=True))
    same = step == 1 and got == extra
    return ("save_resume", dlp == 0.0 and same,
            f"max |d logprob| after reload {dlp:.2e}; step/cursor/curve restored: {same}")


def offline_checks(cfg: RunConfig, n_pairs: int = 4) -> list[CheckResult]:
    """``pairs_load``, checks 1-3 on the first ``n_pairs`` training pairs, and ``save_resume`` (offline
    ``trainer: preference``). A pairs file that does not load ends the list at ``pairs_load`` (failed,
    with the error naming the file, row or split)."""
    from posttrain.commands.check_pairs import pairs_load
    from posttrain.loop.builders import build_model, build_renderer
    from posttrain.loop.preference_batch import encode_pair
    from posttrain.loop.preference_training import check_preference_config

    loaded, train = pairs_load(cfg, config_check=check_preference_config)
    if not train:  # the pairs did not load: the list ends at the failed pairs_load
        return [loaded]
    results: list[CheckResult] = [loaded]
    torch.manual_seed(cfg.seed)
    tokenizer, model = build_model(cfg)
    model.eval()
    renderer = build_renderer(cfg, tokenizer)
    pad_id = int(tokenizer.pad_token_id or 0)
    pairs = [encode_pair(p, renderer, tokenizer, max_length=cfg.preference.max_length) for p in train[:max(n_pairs, 2)]]
    ref = copy.deepcopy(model).requires_grad_(False) if uses_reference(cfg.preference.loss) else None
    results += pair_checks(model, ref, pairs, cfg, pad_id)
    results.append(_save_resume(cfg, model, tokenizer, pairs, pad_id))
    return results


__all__ = ["GRAD_RTOL", "check_mask_invariance", "check_microbatch_split", "check_reference_equals_policy",
           "offline_checks", "pair_checks", "reference_batch", "zero_margin_loss"]
