"""Supervised fine-tuning's loss: the negative log-likelihood of the demonstration's target tokens.

With ``lp[b, t] = log pi_theta(y[b, t] | y[b, <t])`` the log-prob of token ``t`` of row ``b`` given the
tokens before it and ``m[b, t]`` its loss mask (1 = a target: an assistant turn's token, or a completion's;
0 = prompt, template text between turns, padding), the token-mean cross-entropy is

    L = -sum_{b,t} m[b, t] * lp[b, t] / N,      N = sum_{b,t} m[b, t]

(the maximum-likelihood objective of instruction tuning: Ouyang et al. 2022, arXiv:2203.02155, sec. 3.5;
TRL's ``SFTTrainer`` with ``assistant_only_loss`` / ``completion_only_loss``). Every target token of the
batch weighs the same, whatever its row's length. A caller that splits one batch into micro-batches passes
the whole batch's ``N`` as ``num_tokens`` to each, so the micro-batches' losses add up to the batch's ``L``.
Not registered: there is one SFT loss, and no recipe chooses among alternatives.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sft_cross_entropy(logprobs: Tensor, loss_mask: Tensor, num_tokens: float | None = None) -> Tensor:
    """``-sum(m * lp) / N`` (module docstring), a scalar of ``logprobs``' dtype.

    ``logprobs`` ``[B, T]``: each position's log-prob of its token; ``loss_mask`` ``[B, T]`` of 0 / 1;
    ``num_tokens``: ``N``, default ``loss_mask.sum()`` (a batch without a target token is a ``ValueError``:
    its mean is undefined). Masked positions may hold anything finite or not (``-inf`` of a padded
    position): they are replaced before the sum and reach neither the value nor the gradient.
    """
    if logprobs.dim() != 2 or loss_mask.shape != logprobs.shape:
        raise ValueError(f"sft_cross_entropy: logprobs and loss_mask must both be [B, T], got "
                         f"{tuple(logprobs.shape)} and {tuple(loss_mask.shape)}")
    if not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
        raise ValueError("sft_cross_entropy: loss_mask must hold only 0/1 values")
    m = loss_mask.bool()
    n = float(m.sum()) if num_tokens is None else float(num_tokens)
    if not n > 0:
        raise ValueError(f"sft_cross_entropy: no target token to average over (num_tokens={n})")
    picked = torch.where(m, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    return -picked.sum() / n


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """``lp [B, T]``: ``lp[b, t] = log softmax(logits[b, t - 1])[input_ids[b, t]]`` for ``t >= 1`` (computed in
    float32 or wider) and ``lp[b, 0] = 0`` (the first token has no context: it is never a target).
    ``logits`` ``[B, T, V]`` of a causal LM over ``input_ids`` ``[B, T]``."""
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"token_logprobs: logits [B, T, V] over input_ids [B, T], got {tuple(logits.shape)} and "
                         f"{tuple(input_ids.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    lp = torch.log_softmax(logits[:, :-1].to(dtype), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


__all__ = ["sft_cross_entropy", "token_logprobs"]
