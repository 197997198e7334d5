"""``posttrain check`` for ``trainer: sft``: the supervised trainer's invariants on a few rows of ``sft.data``.

On the first ``prompts`` training rows and the model of ``model.path`` (no training):

1. ``data_loads``: every row of ``sft.data`` (and ``sft.heldout_data``) parses, both sides of the split are
   non-empty, and the checked rows render and fit ``sft.max_length`` (a bad row fails here naming file and row);
2. ``loss_mask``: every checked row has target tokens, and only assistant text carries loss: the masked tokens
   decode to text found in the row's assistant turns (completion), never in its prompt-only text;
3. ``packing_invariance``: each row's summed negative log-likelihood is the same padded alone, padded beside the
   other rows and packed into one block with them (position ids restarting per row, no cross-row attention);
4. ``microbatch_split``: through the learner's ``forward_backward`` (the path a training step runs), padded and
   packed (blocks of at most the longest checked row's tokens: at least two blocks), the loss and gradient of the
   token-mean cross-entropy with one batch row per micro-batch equal the whole batch's in one micro-batch (the
   loss is reduced with the mini-batch's token count, Trainer contract).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from posttrain.commands.check_result import CheckResult, gradients, max_rel
from posttrain.config import RunConfig
from posttrain.envs.sft_data import EncodedRow, SFTRow
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.loop.sft_training import Layout

GRAD_RTOL = 1e-4
"""Largest relative gradient difference accepted between micro-batch splits (float32 reductions)."""

NLL_RTOL = 1e-4
"""Largest relative difference of a row's summed NLL between layouts (float32 forwards of other shapes)."""


def _trained_text(row: SFTRow) -> str:
    return "\n".join(m["content"] for m, t in zip(row.messages, row.trained, strict=True) if t)


def check_loss_mask(rows: Sequence[SFTRow], enc: Sequence[EncodedRow], tokenizer: object) -> CheckResult:
    """Check 2 of the module docstring (every whitespace-separated word of the masked tokens' text, special
    tokens left out, must occur in the row's trained turns)."""
    bad: list[str] = []
    for i, (row, e) in enumerate(zip(rows, enc, strict=True)):
        if e.targets == 0:
            bad.append(f"row {i}: no target token")
            continue
        ids = [t for t, m in zip(e.input_ids, e.loss_mask, strict=True) if m]
        text = tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        words = [w for w in text.split() if w]
        answer = _trained_text(row)
        if any(w not in answer for w in words):
            bad.append(f"row {i}: masked text {text[:60]!r} is not assistant text")
    return ("loss_mask", not bad, "; ".join(bad[:3]) if bad else
            f"{len(rows)} rows: every masked token is assistant text ({sum(e.targets for e in enc)} target tokens)")


def check_packing_invariance(model: torch.nn.Module, enc: Sequence[EncodedRow], cfg: RunConfig,
                             pad_id: int) -> CheckResult:
    """Check 3 of the module docstring."""
    from posttrain.loop.sft_training import Layout, row_losses

    big = 10**9
    alone = [row_losses(model, [e], Layout(False, cfg.sft.max_length, big, pad_id))[0][0] for e in enc]
    padded = [s for s, _, _ in row_losses(model, enc, Layout(False, cfg.sft.max_length, big, pad_id))]
    block = sum(len(e.input_ids) for e in enc)
    packed = [s for s, _, _ in row_losses(model, enc, Layout(True, block, big, pad_id))]
    worst = max(max(abs(a - b), abs(a - c)) / max(1.0, abs(a)) for a, b, c in zip(alone, padded, packed, strict=True))
    return ("packing_invariance", worst <= NLL_RTOL,
            f"{len(enc)} rows alone / padded together / packed in one block: max rel |d NLL| = {worst:.2e}")


def _grads(model: torch.nn.Module, enc: Sequence[EncodedRow], layout: Layout) -> tuple[float, dict[str, torch.Tensor]]:
    """The step loss of ``enc`` and its gradient through a learner's ``forward_backward`` in ``layout``'s batch
    and micro-batches (:func:`~posttrain.loop.sft_training.sft_step` without the optimiser step)."""
    from posttrain.learner.actor import PolicyLearner
    from posttrain.learner.settings import BatchingSettings
    from posttrain.loop.sft_training import SFTTokenLoss

    learner = PolicyLearner(model, batching=BatchingSettings(microbatch_tokens=layout.budget))
    model.zero_grad(set_to_none=True)
    out = learner.forward_backward(layout.batch(enc, learner.device), SFTTokenLoss())
    g = gradients(model)
    model.zero_grad(set_to_none=True)
    return out.loss, g


def check_microbatch_split(model: torch.nn.Module, enc: Sequence[EncodedRow], cfg: RunConfig,
                           pad_id: int) -> CheckResult:
    """Check 4 of the module docstring (``cfg``: unused, the checks' common signature; the block is the longest
    checked row, so the packed batch has at least two blocks)."""
    from posttrain.loop.sft_training import Layout

    block = max(len(e.input_ids) for e in enc)
    worst_loss = worst_grad = 0.0
    ok = True
    for packing in (False, True):
        la, ga = _grads(model, enc, Layout(packing, block, 10**9, pad_id))
        lb, gb = _grads(model, enc, Layout(packing, block, 1, pad_id))
        d_loss, rel = abs(la - lb), max_rel(ga, gb)
        ok = ok and rel < GRAD_RTOL and d_loss <= 1e-5 * max(1.0, abs(la))
        worst_loss, worst_grad = max(worst_loss, d_loss), max(worst_grad, rel)
    return ("microbatch_split", ok, f"1 row / 1 block vs whole batch, padded and packed: |d loss| <= "
            f"{worst_loss:.2e}, max rel |d grad| = {worst_grad:.2e}")


def sft_checks(cfg: RunConfig, prompts: int = 4) -> list[CheckResult]:
    """The four checks of the module docstring on the first ``prompts`` (at least 2) training rows."""
    from posttrain.loop.builders import build_model
    from posttrain.loop.sft_training import encode_rows, load_rows

    try:
        train, held = load_rows(cfg)
        rows = train[: max(2, prompts)]
        torch.manual_seed(cfg.seed)
        tokenizer, model = build_model(cfg)
        enc = encode_rows(cfg, tokenizer, rows)
    except UserError as e:
        return [("data_loads", False, str(e))]
    model.eval()
    pad_id = int(tokenizer.pad_token_id or 0)
    return [
        ("data_loads", True, f"{len(train)} training / {len(held)} held-out rows; {len(rows)} checked"),
        check_loss_mask(rows, enc, tokenizer),
        check_packing_invariance(model, enc, cfg, pad_id),
        check_microbatch_split(model, enc, cfg, pad_id),
    ]


__all__ = ["check_loss_mask", "check_microbatch_split", "check_packing_invariance", "sft_checks"]
