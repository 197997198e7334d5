"""Behavior corrections for train/inference mismatch and staleness (registry ``CORRECTIONS``).

Every correction is ``fn(behavior_logprob, old_logprob, action_mask, **hyperparams) ->
CorrectionOutputs``; all inputs are ``[B, T]``. The learner multiplies ``weights`` into the
per-token policy loss and ``keep`` into the action mask.

The token log-ratio is ``log kappa_t = old_logprob_t - behavior_logprob_t``, i.e.
kappa = pi_old / mu: the learner's recomputed probability of the sampled token over the
sampler's: the train-inference mismatch between the behavior policy and the proximal one. It is a
separate factor from the pi_theta / pi_old ratio that the policy loss clips, as in decoupled PPO
(Hilton, Cobbe, Schulman 2022, "Batch size-invariance for policy optimization", arXiv:2110.00641).

Masking: positions with ``action_mask == 0`` are ignored entirely (their values may be
``inf`` / ``nan``): they never drop or veto a row, never enter a sequence ratio, always get
``keep = 0`` and ``weight = 1``. ``keep`` is a subset of the action mask; ``weights`` are 1
wherever ``keep`` is 0. Everything returned is detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.registry import CORRECTIONS


@dataclass(frozen=True)
class CorrectionOutputs:
    """Result of a behavior correction (all ``[B, T]``, detached, same dtype as the log-probs).

    - ``weights``: token weights to multiply into the per-token loss (1 where no correction)
    - ``keep``: 0/1 mask of kept tokens (multiplied into the action mask); 0 off the action mask
    - ``diagnostics``: per-token ``[B, T]`` tensors, 0 off the action mask
    """

    weights: Tensor
    keep: Tensor
    diagnostics: dict[str, Tensor]


def _log_kappa(
    behavior_logprob: Tensor, old_logprob: Tensor, action_mask: Tensor, name: str
) -> tuple[Tensor, Tensor]:
    """Validate and return ``(mask bool [B, T], log kappa [B, T] with 0 off the mask)``."""
    if old_logprob.dim() != 2:
        raise ValueError(
            f"correction {name!r}: old_logprob must be [B, T], got shape {tuple(old_logprob.shape)}"
        )
    for field, t in (("behavior_logprob", behavior_logprob), ("action_mask", action_mask)):
        if t.shape != old_logprob.shape:
            raise ValueError(
                f"correction {name!r}: {field} has shape {tuple(t.shape)}, old_logprob has {tuple(old_logprob.shape)}"
            )
    if not bool(((action_mask == 0) | (action_mask == 1)).all()):
        raise ValueError(f"correction {name!r}: action_mask must hold only 0/1 values")
    mask = action_mask.bool()
    dtype = old_logprob.dtype if old_logprob.is_floating_point() else torch.float32
    zero = torch.zeros((), dtype=dtype, device=old_logprob.device)
    old = torch.where(mask, old_logprob.detach().to(dtype), zero)
    beh = torch.where(mask, behavior_logprob.detach().to(dtype), zero)
    return mask, old - beh


def _out(mask: Tensor, keep: Tensor, weights: Tensor, diagnostics: dict[str, Tensor]) -> CorrectionOutputs:
    """Enforce the contract: keep within the mask, weight 1 where not kept, diagnostics 0 off mask."""
    keep = keep & mask
    one = torch.ones((), dtype=weights.dtype, device=weights.device)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    diag = {k: torch.where(mask, v.to(weights.dtype), zero) for k, v in diagnostics.items()}
    return CorrectionOutputs(
        weights=torch.where(keep, weights, one), keep=keep.to(weights.dtype), diagnostics=diag
    )


def _row_any(mask: Tensor) -> Tensor:
    return mask.any(dim=1, keepdim=True)


@CORRECTIONS.register("tis")
def tis(
    behavior_logprob: Tensor, old_logprob: Tensor, action_mask: Tensor, *, cap: float = 2.0
) -> CorrectionOutputs:
    """Token-level truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", fengyao.notion.site blog).

    ``w_t = min(kappa_t, C)``, ``kappa_t = pi_old(a_t) / mu(a_t)``; keep = action mask. Only large
    ratios are truncated, small ones are kept as they are. ``min`` is taken in log space so huge
    ratios never overflow. Default C = 2 is this project's choice (the blog sweeps C).
    Diagnostics: ``log_ratio`` (log kappa), ``truncated`` (kappa > C).
    """
    if not cap > 0.0:
        raise ValueError(f"correction 'tis': cap must be > 0, got {cap}")
    mask, log_k = _log_kappa(behavior_logprob, old_logprob, action_mask, "tis")
    log_cap = math.log(cap)
    w = torch.exp(log_k.clamp(max=log_cap))
    return _out(mask, mask, w, {"log_ratio": log_k, "truncated": log_k > log_cap})


@CORRECTIONS.register("icepop")
def icepop(
    behavior_logprob: Tensor,
    old_logprob: Tensor,
    action_mask: Tensor,
    *,
    alpha: float = 0.5,
    beta: float = 5.0,
) -> CorrectionOutputs:
    """IcePop two-sided token mask (Ling Team, Ant Group 2025, "Every Step Evolves: Scaling
    Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T), arXiv:2510.18855).

    ``keep_t = 1[alpha <= kappa_t <= beta]``, weight 1: tokens whose train/inference probability
    ratio is extreme on either side are removed from the gradient instead of reweighted.
    Defaults [0.5, 5] are this project's choice (the band commonly quoted for IcePop; not pinned
    from the report, set them explicitly in a recipe that reproduces Ring-1T).
    Diagnostics: ``log_ratio``, ``masked_low`` (kappa < alpha), ``masked_high`` (kappa > beta).
    """
    if not 0.0 < alpha <= beta:
        raise ValueError(f"correction 'icepop': need 0 < alpha <= beta, got alpha={alpha}, beta={beta}")
    mask, log_k = _log_kappa(behavior_logprob, old_logprob, action_mask, "icepop")
    low = log_k < math.log(alpha)
    high = log_k > math.log(beta)
    keep = ~(low | high)
    return _out(
        mask, keep, torch.ones_like(log_k), {"log_ratio": log_k, "masked_low": low, "masked_high": high}
    )


@CORRECTIONS.register("mis")
def mis(
    behavior_logprob: Tensor,
    old_logprob: Tensor,
    action_mask: Tensor,
    *,
    threshold: float = 2.0,
    aggregation: str = "sum",
    lower: float | None = None,
) -> CorrectionOutputs:
    """Sequence-level masked importance sampling, MIS (Liu, Li, Fu, Wang, Liu, Shen 2025, "When Speed
    Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch", blog).

    ``rho(y|x) = prod_{t in y} kappa_t = exp(sum_t log kappa_t)`` — the ratio of SEQUENCE
    probabilities, masked as ``rho(y|x) <- rho(y|x) * 1{rho(y|x) <= C}``;
    ``aggregation="mean"`` gives the geometric mean ``exp(mean_t log kappa_t)`` instead.
    Rows with ``rho > threshold`` (or ``rho < lower`` when given) are dropped whole (keep = 0);
    kept rows get ``weight = rho`` on every action token (the sequence IS correction is kept).
    A row without action tokens has rho = 1. Comparisons are in log space (no overflow).
    Diagnostics: ``seq_log_ratio`` (log rho, broadcast), ``dropped`` (row dropped, broadcast).
    """
    if not threshold > 0.0:
        raise ValueError(f"correction 'mis': threshold must be > 0, got {threshold}")
    if lower is not None and not 0.0 < lower <= threshold:
        raise ValueError(f"correction 'mis': need 0 < lower <= threshold, got lower={lower}")
    if aggregation not in ("sum", "mean"):
        raise ValueError(f"correction 'mis': aggregation must be 'sum' or 'mean', got {aggregation!r}")
    mask, log_k = _log_kappa(behavior_logprob, old_logprob, action_mask, "mis")
    seq = log_k.sum(dim=1, keepdim=True)
    if aggregation == "mean":
        seq = seq / mask.sum(dim=1, keepdim=True).clamp(min=1).to(seq.dtype)
    drop = seq > math.log(threshold)
    if lower is not None:
        drop = drop | (seq < math.log(lower))
    drop = drop.expand_as(log_k)
    seq_b = seq.expand_as(log_k)
    # exp only where kept: there log rho <= log threshold, so it cannot overflow.
    w = torch.exp(torch.where(drop, torch.zeros_like(seq_b), seq_b))
    return _out(mask, ~drop, w, {"seq_log_ratio": seq_b, "dropped": drop})


@CORRECTIONS.register("token_veto")
def token_veto(
    behavior_logprob: Tensor, old_logprob: Tensor, action_mask: Tensor, *, threshold: float = 1e-4
) -> CorrectionOutputs:
    """Token veto: drop a whole sequence if any action token has ``kappa_t < threshold``.

    ``keep(y) = 1[min_{t in y} kappa_t >= threshold]``: token-level detection, sequence-level
    rejection (the token veto of verl's rollout-correction module; the same rule masks rollouts in
    Prime Intellect's INTELLECT-3 technical report, 2025). Weight 1. Only action tokens are
    inspected, so a padding or prompt position can never veto. Default 1e-4 is this project's choice.
    Diagnostics: ``log_ratio``, ``vetoed`` (row vetoed, broadcast), ``veto_token`` (the token(s)
    below the threshold).
    """
    if not threshold > 0.0:
        raise ValueError(f"correction 'token_veto': threshold must be > 0, got {threshold}")
    mask, log_k = _log_kappa(behavior_logprob, old_logprob, action_mask, "token_veto")
    bad = mask & (log_k < math.log(threshold))
    vetoed = _row_any(bad).expand_as(log_k)
    return _out(
        mask, ~vetoed, torch.ones_like(log_k), {"log_ratio": log_k, "vetoed": vetoed, "veto_token": bad}
    )


@CORRECTIONS.register("staleness")
def staleness(
    behavior_logprob: Tensor,
    old_logprob: Tensor,
    action_mask: Tensor,
    *,
    behavior_version: Tensor,
    current_version: int,
    max_staleness: int,
) -> CorrectionOutputs:
    """Staleness filter: drop rows whose oldest action token lags more than ``max_staleness``.

    ``lag_i = current_version - min_{t in action tokens of row i} behavior_version_{i,t}``;
    ``keep`` = action mask of rows with ``lag_i <= max_staleness``; weight 1. Because versions are
    per token, a paused-and-resumed trajectory is judged by its OLDEST part (AReaL's
    max-staleness bound, Fu et al. 2025, arXiv:2505.24298).
    ``max_staleness = 0`` keeps only fully on-policy rows. A row without action tokens has lag 0.
    A token version newer than ``current_version`` is a ValueError (versions are out of order).
    Diagnostics: ``lag`` (row lag, broadcast), ``dropped``.
    """
    if max_staleness < 0:
        raise ValueError(f"correction 'staleness': max_staleness must be >= 0, got {max_staleness}")
    mask, log_k = _log_kappa(behavior_logprob, old_logprob, action_mask, "staleness")
    if behavior_version.shape != mask.shape:
        raise ValueError(
            f"correction 'staleness': behavior_version has shape {tuple(behavior_version.shape)}, "
            f"old_logprob has {tuple(mask.shape)}"
        )
    version = behavior_version.detach().to(torch.int64)
    ahead = mask & (version > current_version)
    if bool(ahead.any()):
        rows = sorted({int(r) for r in ahead.nonzero()[:, 0]})
        raise ValueError(
            f"correction 'staleness': rows {rows} have behavior_version > current_version={current_version}"
        )
    big = torch.full_like(version, current_version)
    oldest = torch.where(mask, version, big).min(dim=1, keepdim=True).values
    lag = (current_version - oldest).expand_as(version)
    drop = lag > max_staleness
    return _out(mask, ~drop, torch.ones_like(log_k), {"lag": lag, "dropped": drop})
