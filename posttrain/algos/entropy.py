"""Token entropy from logits, computed in row chunks so the full softmax is never held at once."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["entropy_from_logits"]


def _entropy_rows(z: Tensor) -> Tensor:
    # H = logsumexp(z) - sum_v softmax(z)_v * z_v  (stable: no log of a tiny probability).
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    return lse - (p * z).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy H(softmax(logits)) over the last (vocabulary) axis: ``[..., V] -> [...]`` in nats.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, which equals ``-sum_v p_v log p_v`` but never
    takes the log of an underflowed probability (the entropy bonus of PPO, Schulman et al. 2017,
    arXiv:1707.06347; also the learner's per-step ``entropy`` metric).

    Memory: the leading axes are flattened to N rows and processed ``chunk_size`` rows at a time,
    so at most ``chunk_size * V`` softmax values exist at once. When a gradient is needed, each
    chunk runs under activation checkpointing (``torch.utils.checkpoint``, non-reentrant), so the
    backward pass recomputes the chunk's softmax instead of keeping all N x V of them alive;
    the gradient is exact. float16/bfloat16 logits are computed (and returned) in float32.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"entropy_from_logits: need logits [..., V] with V >= 1, got shape {tuple(logits.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"entropy_from_logits: chunk_size must be >= 1, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    need_grad = flat.requires_grad and torch.is_grad_enabled()
    parts: list[Tensor] = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size]
        if need_grad:
            parts.append(checkpoint(_entropy_rows, chunk, use_reentrant=False))
        else:
            parts.append(_entropy_rows(chunk))
    if not parts:
        dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        return torch.zeros(lead, dtype=dtype, device=logits.device)
    return torch.cat(parts).reshape(lead)
