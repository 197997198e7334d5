"""The composed policy objective of the RL update, as pure tensor functions.

For a mini-batch ``M`` (``B = |M|`` rows, ``N`` loss tokens) the learner minimises

    L(M) = sum_{b,t} w[b,t] * ( c[b,t] * l_pg[b,t] + beta * kl[b,t] - alpha * H[b,t] )

- ``l_pg`` from ``POLICY_LOSSES[policy_loss]`` over the log-probs ``logprob`` (pi_theta), ``old_logprob``
  (pi_old), ``advantages`` and ``behavior_logprob`` (mu): PPO's clipped surrogate (Schulman et al. 2017,
  arXiv:1707.06347) and the other registered losses;
- ``c`` the behaviour-correction weight (``CORRECTIONS``; 1 without one) and the correction's kept-token
  mask, which with DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476, sec. 3.4: a truncated row
  gets no loss token) forms the loss mask (:func:`loss_mask`);
- ``kl`` from ``KL_ESTIMATORS`` between ``logprob`` and ``ref_logprob`` — the KL penalty in the loss of
  GRPO (Shao et al. 2024, arXiv:2402.03300) — with coefficient ``beta``;
- ``H`` the token entropy with coefficient ``alpha`` (``entropy_coef``);
- ``w = REDUCTIONS[reduction](loss_mask, num_sequences=B, num_tokens=N, ...)``, the reduction weights from
  the *mini-batch's* counts: a row enters ``w`` only through itself and the global counts, so the losses
  of any split of ``M`` into micro-batches or shards sum exactly to ``L(M)``.

:func:`policy_objective` is that sum for the rows one forward saw; :func:`logkappa_metrics` the
|log mu - log pi_old| audit the update logs. Nothing here runs a model (the learner does,
``posttrain/learner/policy_loss.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from posttrain.algos.policy_losses import PolicyLossInputs


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """The resolved terms of the objective: ``policy_loss`` (a ``POLICY_LOSSES`` function) and ``reduction``
    (a ``REDUCTIONS`` function) with their validated keyword arguments, ``kl`` (a ``KL_ESTIMATORS`` function,
    or None: no KL term), ``beta`` (its coefficient this update) and ``entropy_coef`` (``alpha``)."""

    policy_loss: Callable[..., Any]
    reduction: Callable[..., Tensor]
    policy_loss_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    reduction_kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    kl: Callable[[Tensor, Tensor], Tensor] | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0


@dataclasses.dataclass(frozen=True)
class PolicyObjectiveInputs:
    """One forward's rows, every tensor ``[b, t]`` (``b`` rows of the mini-batch, ``t`` columns).

    ``logprob``: pi_theta of the tokens (with grad); ``old_logprob``: pi_old; ``behavior_logprob``: mu;
    ``advantages``; ``loss_mask``: 1 on the tokens the loss counts (:func:`loss_mask`); ``correction_weight``:
    ``c``; ``ref_logprob``: pi_ref (None without a KL term); ``entropy``: ``H`` (None when not computed; with
    grad when ``entropy_coef != 0``). ``num_sequences`` / ``num_tokens``: the *mini-batch's* counts ``B``, ``N``.
    """

    logprob: Tensor
    old_logprob: Tensor
    behavior_logprob: Tensor
    advantages: Tensor
    loss_mask: Tensor
    correction_weight: Tensor
    num_sequences: int
    num_tokens: float
    ref_logprob: Tensor | None = None
    entropy: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class PolicyObjectiveOutput:
    """``loss``: the scalar ``sum w (c l_pg + beta kl - alpha H)`` of these rows (with grad); ``pg`` / ``kl`` /
    ``entropy``: its three reduced terms before their coefficients (``kl`` / ``entropy`` None when the term is
    absent from the loss); ``kl_token``: ``kl[b,t] * loss_mask`` (None without a KL term); ``entropy_token``:
    ``H * loss_mask`` (None when not computed); ``diagnostics``: the policy loss's own."""

    loss: Tensor
    pg: Tensor
    kl: Tensor | None
    entropy: Tensor | None
    kl_token: Tensor | None
    entropy_token: Tensor | None
    diagnostics: Mapping[str, Tensor]


def policy_objective(x: PolicyObjectiveInputs, obj: PolicyObjective) -> PolicyObjectiveOutput:
    """``L = sum w * (c * l_pg + beta * kl - alpha * H)`` over ``x``'s rows (module docstring).

    ``w`` comes from ``x.num_sequences`` / ``x.num_tokens``, the mini-batch's counts, never these rows' own:
    that is what makes the micro-batch losses sum to the mini-batch loss."""
    mask = x.loss_mask
    out = obj.policy_loss(PolicyLossInputs(logprob=x.logprob, old_logprob=x.old_logprob, advantages=x.advantages,
                                           action_mask=mask, behavior_logprob=x.behavior_logprob),
                          **obj.policy_loss_kwargs)
    w = obj.reduction(mask, num_sequences=x.num_sequences, num_tokens=x.num_tokens, **obj.reduction_kwargs)
    pg = (out.loss * x.correction_weight * w).sum()
    total, kl_term, kl_tok, ent_term, ent_tok = pg, None, None, None, None
    if obj.kl is not None:
        if x.ref_logprob is None:
            raise ValueError("policy_objective: a KL term needs ref_logprob")
        kl_tok = obj.kl(x.logprob, x.ref_logprob) * mask
        kl_term = (kl_tok * w).sum()
        total = total + obj.beta * kl_term
    if x.entropy is not None:
        ent_tok = x.entropy.to(x.logprob.dtype) * mask
        if obj.entropy_coef != 0.0:
            ent_term = (ent_tok * w).sum()
            total = total - obj.entropy_coef * ent_term
    return PolicyObjectiveOutput(loss=total, pg=pg, kl=kl_term, entropy=ent_term, kl_token=kl_tok,
                                 entropy_token=ent_tok, diagnostics=dict(out.diagnostics))


@dataclasses.dataclass(frozen=True)
class LossMask:
    """``mask``: the loss tokens ``action_mask * keep * (1 - truncated row)``; ``weight``: the correction's ``c``
    (ones without one); ``info``: ``correction/<k>`` (token means of its diagnostics),
    ``correction/kept_token_frac`` and ``truncated_rows_masked`` (with ``mask_truncated``)."""

    mask: Tensor
    weight: Tensor
    info: dict[str, float]


def loss_mask(action_mask: Tensor, behavior_logprob: Tensor, old_logprob: Tensor | None, *,
              correction: Callable[..., Any] | None = None, correction_kwargs: Mapping[str, object] | None = None,
              behavior_version: Tensor | None = None, current_version: int = 0,
              truncated: Tensor | None = None) -> LossMask:
    """The loss mask and correction weights of a batch, ``[B, T]`` in ``action_mask``'s dtype.

    ``correction`` (a ``CORRECTIONS`` function) gets ``(behavior_logprob, old_logprob, action_mask,
    **correction_kwargs)``, plus ``behavior_version`` / ``current_version`` when its signature takes them
    (staleness-type corrections); its ``keep`` multiplies the mask, its ``weights`` are ``c``.
    ``truncated`` (``[B]`` bool, DAPO's overlong filtering, Yu et al. 2025 sec. 3.4): those rows get no loss
    token; every row still counts in the reduction's ``B`` (the reductions' contract)."""
    dt = action_mask.dtype
    weights, keep = torch.ones_like(action_mask), torch.ones_like(action_mask)
    info: dict[str, float] = {}
    if correction is not None:
        kw = dict(correction_kwargs or {})
        params = inspect.signature(correction).parameters
        if "behavior_version" in params and behavior_version is not None:
            kw.setdefault("behavior_version", behavior_version)
        if "current_version" in params:
            kw.setdefault("current_version", current_version)
        out = correction(behavior_logprob, old_logprob, action_mask, **kw)
        weights, keep = out.weights.to(dt).detach(), out.keep.to(dt).detach()
        n = action_mask.sum().clamp(min=1)
        for k, v in out.diagnostics.items():
            v = torch.as_tensor(v, dtype=dt, device=action_mask.device)
            info[f"correction/{k}"] = float((v * action_mask).sum() / n if v.shape == action_mask.shape else v.mean())
        info["correction/kept_token_frac"] = float((keep * action_mask).sum() / n)
    mask = action_mask * keep
    if truncated is not None:
        mask = mask * (~truncated).to(dt)[:, None]
        info["truncated_rows_masked"] = float(truncated.sum())
    return LossMask(mask=mask, weight=weights, info=info)


def logkappa_metrics(behavior: Tensor, old: Tensor, action_mask: Tensor, behavior_version: Tensor,
                     version: int) -> dict[str, float]:
    """|log mu - log pi_old| over action tokens, split by what it measures.

    Tokens sampled under the learner's own weights (``behavior_version == version``): engine mismatch only,
    ``logkappa_abs_mean`` / ``logkappa_abs_max`` (absent when the batch has no such token;
    ``logkappa/tokens`` counts them). Tokens sampled under older weights: engine mismatch plus policy lag,
    ``lag/logratio_abs_mean`` / ``lag/logratio_abs_max`` (absent when none) and ``lag/tokens``."""
    log_kappa = (behavior - old).abs() * action_mask
    live = action_mask > 0
    same = live & (behavior_version == version)
    stale = live & ~same
    out: dict[str, float] = {"logkappa/tokens": float(same.sum()), "lag/tokens": float(stale.sum())}
    for prefix, sel in (("logkappa_abs", same), ("lag/logratio_abs", stale)):
        n = int(sel.sum())
        if n:
            out[f"{prefix}_mean"] = float(log_kappa[sel].sum() / n)
            out[f"{prefix}_max"] = float(log_kappa[sel].max())
    return out


__all__ = ["LossMask", "PolicyObjective", "PolicyObjectiveInputs", "PolicyObjectiveOutput", "logkappa_metrics",
           "loss_mask", "policy_objective"]
