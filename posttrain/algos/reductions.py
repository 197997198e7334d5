"""Loss reductions over a ragged token batch (registry REDUCTIONS).

A reduction is a *weight function*: ``w = fn(action_mask, num_sequences=, num_tokens=, max_len=)``
returns per-token weights ``[B, T]`` (0 off the mask) and the scalar loss is
``(per_token_loss * w).sum()``. Because the loss is a plain weighted sum, a batch split into
micro-batches gives exactly the full-batch loss when every micro-batch is weighted with the
GLOBAL counts (``num_sequences`` = rows in the full batch, ``num_tokens`` = action tokens in the
full batch): the learner passes them; by default they are this batch's own B and mask sum.

Names and weights, for row i with ``len_i = sum_t mask[i, t]``:

- ``token_mean``              w = mask / N_tokens                (DAPO "token-level" loss, Yu et al.
  2025, arXiv:2503.14476, sec. 3.3; a row's total weight grows with its length);
- ``seq_mean_token_mean``     w = mask / (len_i * B)             (original GRPO, Shao et al. 2024,
  arXiv:2402.03300, eq. 3: the 1/|o_i| inside, 1/G outside; every row weighs the same);
- ``seq_mean_token_sum``      w = mask / B                       (sum over tokens, mean over rows);
- ``seq_mean_token_sum_norm`` w = mask / (B * L_max)             (Dr. GRPO, Liu et al. 2025,
  arXiv:2503.20783: a constant denominator independent of the generated length).

A row's total weight sum_t w[i, t] is len_i / N_tokens (token_mean), 1/B (seq_mean_token_mean),
len_i / B (seq_mean_token_sum) and len_i / (B * L_max) (seq_mean_token_sum_norm): a sequence-level
advantage broadcast to the tokens is weighted by the answer's length under every reduction except
``seq_mean_token_mean`` — that is each reduction's documented choice, never the estimator's.

A row with no action tokens gets weight 0 everywhere but still counts in B (it was sampled; it
just has nothing to learn from), so no reduction ever divides by a zero length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algos.registry import REDUCTIONS

__all__ = [
    "reduce_loss",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]


def _mask(action_mask: Tensor) -> Tensor:
    if action_mask.dim() != 2:
        raise ValueError(f"reduction: action_mask must be [B, T], got shape {tuple(action_mask.shape)}")
    m = action_mask.to(torch.float64 if action_mask.dtype == torch.float64 else torch.float32)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("reduction: action_mask must hold only 0/1 values")
    return m


def _num_sequences(m: Tensor, num_sequences: int | None) -> int:
    if num_sequences is None:
        return int(m.shape[0])
    if num_sequences < max(int(m.shape[0]), 1):
        raise ValueError(
            f"reduction: num_sequences={num_sequences} is smaller than this batch's {m.shape[0]} rows "
            "(pass the GLOBAL row count of the full batch)"
        )
    return int(num_sequences)


@REDUCTIONS.register("token_mean")
def token_mean(
    action_mask: Tensor,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """w[i, t] = mask[i, t] / N_tokens, N_tokens = total action tokens (global if given).

    The mean over every action token of the batch (DAPO token-level loss, arXiv:2503.14476).
    A long row's tokens each weigh as much as a short row's, so a row's total weight is
    proportional to its length — this is the reduction that *chooses* length weighting.
    All-zero mask -> all-zero weights. ``num_sequences``/``max_len`` are accepted and unused.
    """
    m = _mask(action_mask)
    local = float(m.sum().item())
    n = local if num_tokens is None else float(num_tokens)
    if n < local - 1e-6 * max(local, 1.0):
        raise ValueError(
            f"token_mean: num_tokens={num_tokens} is smaller than this batch's {local:g} action tokens "
            "(pass the GLOBAL token count of the full batch)"
        )
    if n <= 0:
        return torch.zeros_like(m)
    return m / n


@REDUCTIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    action_mask: Tensor,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """w[i, t] = mask[i, t] / (len_i * B): mean over each row's tokens, then mean over rows.

    GRPO's reduction (arXiv:2402.03300, eq. 3). Every row with at least one action token has
    total weight exactly 1/B regardless of its length; a zero-length row gets weight 0 but still
    counts in B. ``B`` is ``num_sequences`` (global) when given.
    """
    m = _mask(action_mask)
    b = _num_sequences(m, num_sequences)
    lengths = m.sum(dim=1, keepdim=True)
    return torch.where(lengths > 0, m / (lengths.clamp(min=1.0) * b), torch.zeros_like(m))


@REDUCTIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(
    action_mask: Tensor,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """w[i, t] = mask[i, t] / B: sum over each row's tokens, mean over rows.

    A row's total weight is len_i / B, i.e. proportional to its length (like ``token_mean``
    but with a length-independent denominator). ``B`` is ``num_sequences`` (global) when given.
    """
    m = _mask(action_mask)
    b = _num_sequences(m, num_sequences)
    return m / max(b, 1)


@REDUCTIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    action_mask: Tensor,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """w[i, t] = mask[i, t] / (B * L_max), L_max = the fixed generation budget ``max_len``.

    Dr. GRPO's constant normaliser (Liu et al. 2025, arXiv:2503.20783): the denominator does
    not depend on how many tokens were generated, so no length bias enters through it.
    ``max_len`` is required (``ValueError`` if None or < 1); it must be the configured budget,
    not the batch's padded width. ``B`` is ``num_sequences`` (global) when given.
    """
    if max_len is None or max_len < 1:
        raise ValueError(
            f"seq_mean_token_sum_norm needs max_len = the fixed generation budget L_max >= 1, got {max_len}"
        )
    m = _mask(action_mask)
    b = _num_sequences(m, num_sequences)
    return m / (max(b, 1) * float(max_len))


def reduce_loss(
    per_token_loss: Tensor,
    action_mask: Tensor,
    reduction: str,
    *,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Scalar loss = sum_{i,t} per_token_loss[i, t] * w[i, t], w = REDUCTIONS[reduction](mask, ...).

    Positions with weight 0 are selected away with ``torch.where`` (not multiplied), so a NaN/inf
    in a masked-out position never reaches the loss value, and finite values there get exactly
    zero gradient. (A NaN produced upstream still yields a NaN *gradient* through 0 * NaN in its
    own backward: keep masked positions finite before they enter differentiable ops.) Unknown
    ``reduction`` names raise a ``KeyError`` listing the valid ones.
    """
    if per_token_loss.shape != action_mask.shape:
        raise ValueError(
            f"reduce_loss: per_token_loss shape {tuple(per_token_loss.shape)} != "
            f"action_mask shape {tuple(action_mask.shape)}"
        )
    w = REDUCTIONS[reduction](
        action_mask, num_sequences=num_sequences, num_tokens=num_tokens, max_len=max_len
    ).to(per_token_loss.dtype)
    contrib = torch.where(w != 0, per_token_loss * w, torch.zeros_like(per_token_loss))
    return contrib.sum()
