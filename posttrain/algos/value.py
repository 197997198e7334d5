"""Critic value loss, clipped and unclipped."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["value_loss"]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    clip_eps: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO value loss ``[B, T]`` and diagnostics (Schulman et al. 2017, arXiv:1707.06347).

    Unclipped (``clip_eps=None``):  L = 0.5 * (V - R)^2.
    Clipped:  V_clip = V_old + clip(V - V_old, -eps, eps),
              L = 0.5 * max((V - R)^2, (V_clip - R)^2)
    (the value clipping of the OpenAI baselines PPO2 implementation). ``values`` V are the current critic outputs, ``old_values`` V_old the critic
    outputs frozen before the update, ``returns`` R the value targets (e.g. GAE returns), all
    ``[B, T]`` at action positions; everything is 0 off ``action_mask``. The three inputs are
    zeroed off the mask *before* any arithmetic: selecting only the output with ``torch.where`` is
    not enough, because the backward of ``err * err`` at a masked position with ``V = inf`` (or NaN)
    is ``0 * inf = NaN`` — so garbage at masked positions never reaches the loss or its gradient.

    Diagnostics (all ``[B, T]``, 0 off the mask; reduce them with the same reduction as the loss):
    ``clipped`` 1.0 where the clipped branch is strictly larger (its gradient w.r.t. V is 0 there),
    ``value_error`` V - R.
    """
    if not (values.shape == old_values.shape == returns.shape == action_mask.shape):
        raise ValueError(
            "value_loss: shapes differ: values "
            f"{tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)}, "
            f"action_mask {tuple(action_mask.shape)}"
        )
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"value_loss: clip_eps must be > 0 or None, got {clip_eps}")
    on = action_mask > 0
    zeros = torch.zeros_like(values)
    values = torch.where(on, values, zeros)
    old_values = torch.where(on, old_values, zeros.detach())
    returns = torch.where(on, returns, zeros.detach())
    err = values - returns
    unclipped = err * err
    if clip_eps is None:
        loss = 0.5 * unclipped
        clipped = torch.zeros_like(values)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clip = v_clip - returns
        clipped_sq = err_clip * err_clip
        loss = 0.5 * torch.maximum(unclipped, clipped_sq)
        clipped = (clipped_sq > unclipped).to(values.dtype)
    loss = torch.where(on, loss, zeros)
    diagnostics = {
        "clipped": torch.where(on, clipped, zeros).detach(),
        "value_error": torch.where(on, err, zeros).detach(),
    }
    return loss, diagnostics
