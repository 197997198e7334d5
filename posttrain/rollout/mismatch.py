"""Engine / learner consistency: the per-token ratio ``kappa = pi_old / mu`` of sampled tokens.

``mu`` is the behaviour distribution the engine recorded (``Completion.logprobs``); ``pi_old`` is
the same weights evaluated by a plain, cache-free forward pass of the full sequence, turned into a
distribution with the *same* sampler transform (temperature, top-k, top-p, min-p; see
:func:`posttrain.rollout.sampling.behaviour_logprobs`). With identical arithmetic
``log kappa = log pi_old - log mu = 0``; any KV-cache, kernel, batching or precision difference
shows up here. Large ``|log kappa|`` biases importance ratios silently, which is why decoupled /
truncated corrections exist (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; Fu et al. 2025, AReaL, arXiv:2505.24298).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.rollout.sampling import SamplingParams, behaviour_logprobs
from posttrain.rollout.types import Completion


@dataclasses.dataclass
class MismatchReport:
    """Per-token ``|log kappa|`` statistics and per-sequence log-ratios.

    ``mean``, ``p99``, ``max`` are over all generated tokens of all completions (0 when there are
    none); ``seq_log_ratio[j] = sum_t (log pi_old - log mu)`` of completion ``j``, i.e. the log of
    the sequence-level ratio ``prod_t kappa_t``; ``n_tokens`` counts the tokens; ``stale_tokens``
    counts tokens whose recorded version differs from the engine's current one (their ``mu`` came
    from other weights, so their kappa measures staleness too, not only the engine).
    """

    mean: float
    p99: float
    max: float
    seq_log_ratio: list[float]
    n_tokens: int
    stale_tokens: int

    def as_dict(self) -> dict[str, Any]:
        """Plain-JSON view (for logs and benchmark output)."""
        return dataclasses.asdict(self)


@torch.no_grad()
def recompute_logprobs(model: Any, completions: Sequence[Completion], batch_size: int = 32) -> list[torch.Tensor]:
    """``log pi(token_ids[i] | prompt, token_ids[:i])`` float64 ``[len(token_ids)]`` per completion.

    One right-padded forward pass per ``batch_size`` completions (``attention_mask`` marks real
    tokens; default position ids are correct under right padding). The next-token logits at
    position ``P - 1 + i`` give token ``i``; they pass through :func:`behaviour_logprobs` with the
    completion's own ``params`` (default :class:`SamplingParams` when absent), so greedy
    completions get ``0`` for the argmax token and ``-inf`` otherwise.
    """
    dev = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for s in range(0, len(completions), batch_size):
        chunk = list(completions[s : s + batch_size])
        seqs = [list(c.prompt_ids) + list(c.token_ids) for c in chunk]
        T = max(len(x) for x in seqs)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, x in enumerate(seqs):
            ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[b, : len(x)] = 1
        logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
        for b, c in enumerate(chunk):
            L = len(c.token_ids)
            if L == 0:
                out.append(torch.zeros(0, dtype=torch.float64))
                continue
            P = len(c.prompt_ids)
            rows = logits[b, P - 1 : P - 1 + L]
            p = c.params or SamplingParams()
            logp = behaviour_logprobs(
                rows,
                torch.full((L,), float(p.temperature), dtype=torch.float64, device=dev),
                torch.full((L,), int(p.top_k), dtype=torch.long, device=dev),
                torch.full((L,), float(p.top_p), dtype=torch.float64, device=dev),
                torch.full((L,), float(p.min_p), dtype=torch.float64, device=dev),
            )
            tok = torch.tensor(c.token_ids, dtype=torch.long, device=dev)
            out.append(logp.gather(1, tok[:, None]).squeeze(1).cpu())
    return out


def measure_mismatch(engine: Any, model: Any, completions: Sequence[Completion]) -> MismatchReport:
    """Compare the engine's recorded ``log mu`` with a plain forward pass of ``model``.

    ``log kappa_t = log pi_old(y_t) - log mu(y_t)`` where ``pi_old`` is :func:`recompute_logprobs`
    (same temperature / truncation as each completion's params). Returns |log kappa| mean, 99th
    percentile (linear interpolation, ``torch.quantile``) and max over all tokens, plus the
    per-sequence log-ratio ``sum_t log kappa_t``. A token outside the recomputed kept set gets
    ``|log kappa| = inf`` (the sampler's support differs). ``engine`` supplies ``version`` to count
    stale tokens; pass the model whose weights the engine holds for a pure engine check.
    """
    lp = recompute_logprobs(model, completions)
    version = getattr(engine, "version", None)
    per_token: list[torch.Tensor] = []
    seq: list[float] = []
    stale = 0
    for c, pi in zip(completions, lp, strict=True):
        mu = torch.tensor(c.logprobs, dtype=torch.float64)
        lk = pi - mu
        per_token.append(lk.abs())
        seq.append(float(lk.sum()))
        if version is not None:
            stale += sum(1 for v in c.versions if v != version)
    flat = torch.cat(per_token) if per_token else torch.zeros(0, dtype=torch.float64)
    if flat.numel() == 0:
        return MismatchReport(0.0, 0.0, 0.0, seq, 0, stale)
    big = torch.finfo(torch.float64).max
    q = float(torch.quantile(torch.nan_to_num(flat, posinf=big), 0.99))
    return MismatchReport(
        mean=float(flat.mean()),
        p99=float("inf") if q >= big else q,
        max=float(flat.max()),
        seq_log_ratio=seq,
        n_tokens=int(flat.numel()),
        stale_tokens=stale,
    )
