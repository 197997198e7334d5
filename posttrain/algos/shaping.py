"""Reward shaping: DAPO soft overlong punishment and the effort/budget penalty.

Both return a *separate* reward component per sequence ``[B]`` (a raw, unweighted value). They
are never folded into the correctness reward here: the reward layer stores each component with
its weight and reports them separately, so a model cannot "optimise cost" by being short and
wrong without it showing.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dapo_overlong_penalty", "effort_penalty"]


def dapo_overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, sec. 3.4), per sequence.

    With L = ``lengths`` (generated tokens, ``[B]``), L_max = ``max_len``, L_cache = ``cache_len``::

        R_length(L) = 0                                  if L <= L_max - L_cache
                      ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
                      -1                                 if L > L_max

    The middle branch falls linearly from 0 to -1 over the cache window. Requires
    ``0 < cache_len <= max_len``. Returns float32 ``[B]`` (float64 if ``lengths`` is float64).
    """
    if max_len < 1:
        raise ValueError(f"dapo_overlong_penalty: max_len must be >= 1, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"dapo_overlong_penalty: need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    if lengths.dim() != 1:
        raise ValueError(f"dapo_overlong_penalty: lengths must be [B], got shape {tuple(lengths.shape)}")
    dtype = torch.float64 if lengths.dtype == torch.float64 else torch.float32
    L = lengths.to(dtype)
    if bool((L < 0).any()):
        raise ValueError(
            f"dapo_overlong_penalty: negative lengths at rows {torch.nonzero(L < 0).flatten().tolist()}"
        )
    soft_start = float(max_len - cache_len)
    window = (soft_start - L) / float(cache_len)
    out = torch.where(L <= soft_start, torch.zeros_like(L), window)
    return torch.where(L > max_len, torch.full_like(L, -1.0), out)


def effort_penalty(lengths: Tensor, budget: Tensor, tau: float) -> Tensor:
    """Effort/budget penalty per sequence: -1 beyond a per-prompt token budget, 0 within it.

    ``r_budget(x, y) = -1 if T(y) > tau * b0(x) else 0`` with T(y) = ``lengths`` (the counted
    tokens of the response — which tokens count is the caller's declared choice), b0(x) =
    ``budget`` (the prompt's base budget, ``[B]``, > 0) and ``tau`` > 0 the curriculum/effort
    coefficient. Returns float32 ``[B]`` with values in {-1, 0}.
    """
    if tau <= 0:
        raise ValueError(f"effort_penalty: tau must be > 0, got {tau}")
    if lengths.shape != budget.shape or lengths.dim() != 1:
        raise ValueError(
            f"effort_penalty: lengths {tuple(lengths.shape)} and budget {tuple(budget.shape)} must both be [B]"
        )
    b = budget.to(torch.float64)
    if bool((b <= 0).any()):
        raise ValueError(
            f"effort_penalty: budget must be > 0, bad rows {torch.nonzero(b <= 0).flatten().tolist()}"
        )
    over = lengths.to(torch.float64) > tau * b
    return torch.where(over, -1.0, 0.0).to(torch.float32)
