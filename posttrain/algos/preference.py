"""Offline preference losses (registry ``PREFERENCE_LOSSES``).

Paired losses have the signature ``fn(policy_chosen_logp [B], policy_rejected_logp [B],
ref_chosen_logp [B] | None, ref_rejected_logp [B] | None, **hyperparams) -> (loss [B], diagnostics)``
where every log-prob is a SEQUENCE log-prob: the sum over the response's tokens of the token
log-probs (prompt tokens excluded). Reference-free losses (``simpo``, ``orpo``) accept and ignore
the reference arguments, and take the response lengths to form average log-probs.

``kto`` is unpaired and has its own signature (see :func:`kto`).

Notation: ``h = (pi_c - ref_c) - (pi_r - ref_r)``, the difference of the implicit rewards'
log-ratios; ``sigma`` the logistic function. Losses are per pair ``[B]``; the caller averages.
Diagnostics are detached ``[B]`` tensors.

Ties in ``reward_accuracy``: two computations of the same sequence log-prob in other batch shapes
(the reference's, computed once, and the policy's in a step's micro-batches) agree only to rounding
(:mod:`posttrain.diagnostics.tolerance`), so a policy equal to its reference gives margins of
+-1e-8, not 0. Every paired loss takes ``margin_rtol`` (supplied by the caller, not a hyperparameter:
the relative rounding tolerance of one sequence log-prob, ``[B]`` or a float, default 0 = exact): a
pair is a win only when its margin exceeds :func:`margin_tie`, ``margin_rtol`` times the summed
magnitudes of the log-probs the margin is a difference of; within it the pair is a tie (0, as a loss).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.algos.registry import PREFERENCE_LOSSES

Diagnostics = dict[str, Tensor]


def _check_1d(name: str, **tensors: Tensor | None) -> int:
    """All given tensors must be ``[B]`` with the same B; returns B."""
    sizes: dict[str, tuple[int, ...]] = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    shapes = set(sizes.values())
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"preference loss {name!r}: inputs must all be [B] of one size, got {sizes}")
    return next(iter(shapes))[0]


def _need_ref(name: str, ref_c: Tensor | None, ref_r: Tensor | None) -> tuple[Tensor, Tensor]:
    if ref_c is None or ref_r is None:
        raise ValueError(f"preference loss {name!r} needs ref_chosen_logp and ref_rejected_logp, got None")
    return ref_c.detach(), ref_r.detach()


def _log_ratio_margin(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(h, pc - rc, pr - rr)``."""
    c = pc - rc
    r = pr - rr
    return c - r, c, r


def margin_tie(margin_rtol: Tensor | float, *logps: Tensor) -> Tensor:
    """``margin_rtol * sum_i |logps_i|`` ``[B]`` (detached): how far from 0 a difference of the ``logps``
    (sequence log-probs, or their length-normalised values) can land by rounding alone when each is
    known to relative ``margin_rtol`` (the bound on ``|sum_i +-(x_i + e_i)| - |sum_i +-x_i|`` for
    ``|e_i| <= rtol |x_i|``)."""
    total = torch.stack([t.detach().abs() for t in logps]).sum(dim=0)
    return total * torch.as_tensor(margin_rtol, dtype=total.dtype, device=total.device)


def _reward_diag(chosen: Tensor, rejected: Tensor, tie: Tensor | float = 0.0) -> Diagnostics:
    """Rewards, margin and accuracy (margin > ``tie``: a margin within rounding of 0 is no win)."""
    c, r = chosen.detach(), rejected.detach()
    return {
        "chosen_reward": c,
        "rejected_reward": r,
        "reward_margin": c - r,
        "reward_accuracy": (c - r > tie).to(c.dtype),
    }


@PREFERENCE_LOSSES.register("dpo")
def dpo(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None,
    ref_rejected_logp: Tensor | None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    margin_rtol: Tensor | float = 0.0,
) -> tuple[Tensor, Diagnostics]:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7), with conservative label smoothing.

    ``loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``: with ``eps =
    label_smoothing = 0`` this is DPO; ``eps > 0`` assumes each label is flipped with probability
    eps (conservative DPO, Mitchell 2023 note "A note on DPO with noisy preferences"). eps must
    be in [0, 0.5). Diagnostics: ``chosen_reward = beta (pi_c - ref_c)``, ``rejected_reward``,
    ``reward_margin``, ``reward_accuracy`` (``beta h > |beta| margin_tie(margin_rtol, pi_c, ref_c, pi_r,
    ref_r)``: a margin within rounding of 0 is a tie, module docstring).
    """
    _check_1d("dpo", pc=policy_chosen_logp, pr=policy_rejected_logp, rc=ref_chosen_logp, rr=ref_rejected_logp)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"preference loss 'dpo': label_smoothing must be in [0, 0.5), got {label_smoothing}")
    rc, rr = _need_ref("dpo", ref_chosen_logp, ref_rejected_logp)
    h, c, r = _log_ratio_margin(policy_chosen_logp, policy_rejected_logp, rc, rr)
    logits = beta * h
    loss = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    tie = abs(beta) * margin_tie(margin_rtol, policy_chosen_logp, rc, policy_rejected_logp, rr)
    return loss, _reward_diag(beta * c, beta * r, tie)


@PREFERENCE_LOSSES.register("ipo")
def ipo(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None,
    ref_rejected_logp: Tensor | None,
    *,
    tau: float = 0.1,
    margin_rtol: Tensor | float = 0.0,
) -> tuple[Tensor, Diagnostics]:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", arXiv:2310.12036, the empirical IPO loss): ``loss = (h - 1 / (2 tau))^2``.

    The identity Psi makes the regression target a finite margin 1/(2 tau) instead of DPO's
    unbounded push. ``h`` uses summed sequence log-probs as in the paper (some libraries use
    length-averaged ones instead). Diagnostics: log-ratio rewards (no beta), margin, accuracy (``h >
    margin_tie(margin_rtol, pi_c, ref_c, pi_r, ref_r)``).
    """
    _check_1d("ipo", pc=policy_chosen_logp, pr=policy_rejected_logp, rc=ref_chosen_logp, rr=ref_rejected_logp)
    if not tau > 0.0:
        raise ValueError(f"preference loss 'ipo': tau must be > 0, got {tau}")
    rc, rr = _need_ref("ipo", ref_chosen_logp, ref_rejected_logp)
    h, c, r = _log_ratio_margin(policy_chosen_logp, policy_rejected_logp, rc, rr)
    tie = margin_tie(margin_rtol, policy_chosen_logp, rc, policy_rejected_logp, rr)
    return (h - 1.0 / (2.0 * tau)) ** 2, _reward_diag(c, r, tie)


def _lengths(name: str, field: str, lengths: Tensor, like: Tensor) -> Tensor:
    if lengths.shape != like.shape:
        raise ValueError(
            f"preference loss {name!r}: {field} has shape {tuple(lengths.shape)}, expected {tuple(like.shape)}"
        )
    if not bool((lengths > 0).all()):
        raise ValueError(f"preference loss {name!r}: {field} must be > 0 (response token counts)")
    return lengths.to(like.dtype)


@PREFERENCE_LOSSES.register("simpo")
def simpo(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None = None,
    ref_rejected_logp: Tensor | None = None,
    *,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    margin_rtol: Tensor | float = 0.0,
) -> tuple[Tensor, Diagnostics]:
    """SimPO (Meng, Xia, Chen 2024, arXiv:2405.14734); no reference model.

    ``loss = -log sigma(beta / |y_c| * pi_c - beta / |y_r| * pi_r - gamma)``: the implicit reward is
    the length-normalised (average per-token) log-prob, and gamma is a target reward margin.
    ``chosen_lengths`` / ``rejected_lengths`` are ``[B]`` response token counts (> 0). Reference
    arguments are ignored. Defaults beta = 2.0, gamma = 0.5 are this project's choice within the
    paper's reported ranges. Diagnostics: the two rewards, margin, accuracy (the reward margin >
    ``|beta| margin_tie(margin_rtol, pi_c / |y_c|, pi_r / |y_r|)``; gamma is not part of it).
    """
    _check_1d("simpo", pc=policy_chosen_logp, pr=policy_rejected_logp)
    lc = _lengths("simpo", "chosen_lengths", chosen_lengths, policy_chosen_logp)
    lr = _lengths("simpo", "rejected_lengths", rejected_lengths, policy_rejected_logp)
    c = beta * policy_chosen_logp / lc
    r = beta * policy_rejected_logp / lr
    tie = abs(beta) * margin_tie(margin_rtol, policy_chosen_logp / lc, policy_rejected_logp / lr)
    return -F.logsigmoid(c - r - gamma), _reward_diag(c, r, tie)


_AVG_LOGP_MAX = -1e-6
"""Upper clamp of the average log-prob in ORPO: log(1 - p) is -inf at p = 1."""


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable in both regimes (Maechler 2012)."""
    ln2 = math.log(2.0)
    return torch.where(x > -ln2, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@PREFERENCE_LOSSES.register("orpo")
def orpo(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None = None,
    ref_rejected_logp: Tensor | None = None,
    *,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    lam: float = 0.1,
    margin_rtol: Tensor | float = 0.0,
) -> tuple[Tensor, Diagnostics]:
    """ORPO (Hong, Lee, Thorne 2024, arXiv:2403.07691); no reference model.

    With the length-normalised likelihood ``P(y|x) = exp(logp(y) / |y|)`` and
    ``odds(y) = P / (1 - P)``:
    ``L_OR = -log sigma(log odds(y_c) - log odds(y_r))``, ``L_SFT = -logp(y_c) / |y_c|`` (mean token
    NLL of the chosen response), ``loss = L_SFT + lam * L_OR``.
    ``log odds = a - log(1 - exp(a))`` with ``a`` the average log-prob, computed with a stable
    log1mexp; ``a`` is clamped to <= -1e-6 so a response of probability 1 stays finite. (The paper's
    odds-ratio form is used, not a plain log-likelihood ratio.)
    Diagnostics: ``nll`` (L_SFT), ``or_loss`` (L_OR), ``log_odds_ratio``, ``reward_accuracy`` (log odds
    ratio > 0, and ``pi_c / |y_c| - pi_r / |y_r| > margin_tie(margin_rtol, pi_c / |y_c|, pi_r / |y_r|)``:
    the log odds are increasing in the average log-prob, so a tie of those is a tie of the odds).
    """
    _check_1d("orpo", pc=policy_chosen_logp, pr=policy_rejected_logp)
    lc = _lengths("orpo", "chosen_lengths", chosen_lengths, policy_chosen_logp)
    lr = _lengths("orpo", "rejected_lengths", rejected_lengths, policy_rejected_logp)
    a_c = (policy_chosen_logp / lc).clamp(max=_AVG_LOGP_MAX)
    a_r = (policy_rejected_logp / lr).clamp(max=_AVG_LOGP_MAX)
    log_odds = (a_c - _log1mexp(a_c)) - (a_r - _log1mexp(a_r))
    or_loss = -F.logsigmoid(log_odds)
    nll = -policy_chosen_logp / lc
    avg_c, avg_r = policy_chosen_logp / lc, policy_rejected_logp / lr
    win = (log_odds > 0) & (avg_c - avg_r > margin_tie(margin_rtol, avg_c, avg_r))
    diag = {
        "nll": nll.detach(),
        "or_loss": or_loss.detach(),
        "log_odds_ratio": log_odds.detach(),
        "reward_accuracy": win.to(nll.dtype).detach(),
    }
    return nll + lam * or_loss, diag


@PREFERENCE_LOSSES.register("kto")
def kto(
    policy_logp: Tensor,
    ref_logp: Tensor,
    is_desirable: Tensor,
    kl_ref_point: Tensor | float,
    *,
    beta: float = 0.1,
    lambda_d: float = 1.0,
    lambda_u: float = 1.0,
) -> tuple[Tensor, Diagnostics]:
    """KTO, unpaired (Ethayarajh et al. 2024, arXiv:2402.01306). Own signature.

    Per example ``(x, y)`` with sequence log-probs ``policy_logp`` / ``ref_logp`` ``[B]`` and a
    ``[B]`` bool ``is_desirable``: ``r = policy_logp - ref_logp``,
    ``z0 = max(0, kl_ref_point)`` (detached: the batch estimate of KL(pi_theta || pi_ref), e.g. from
    mismatched (x, y') pairs, supplied by the caller),
    ``v = lambda_d sigma(beta (r - z0))`` if desirable, ``lambda_u sigma(beta (z0 - r))`` if not,
    ``loss = lambda_y - v`` (lambda_y = lambda_d or lambda_u). Defaults are the paper's
    (beta = 0.1, lambda_d = lambda_u = 1 for balanced data).
    Diagnostics: ``reward`` (r), ``value`` (v).
    """
    _check_1d("kto", policy_logp=policy_logp, ref_logp=ref_logp, is_desirable=is_desirable)
    if is_desirable.dtype != torch.bool:
        raise ValueError(
            f"preference loss 'kto': is_desirable must be a bool tensor, got {is_desirable.dtype}"
        )
    z0 = torch.as_tensor(kl_ref_point, dtype=policy_logp.dtype, device=policy_logp.device).detach()
    if z0.dim() != 0:
        raise ValueError(f"preference loss 'kto': kl_ref_point must be a scalar, got shape {tuple(z0.shape)}")
    z0 = z0.clamp(min=0.0)
    r = policy_logp - ref_logp.detach()
    v = torch.where(
        is_desirable, lambda_d * torch.sigmoid(beta * (r - z0)), lambda_u * torch.sigmoid(beta * (z0 - r))
    )
    lam = torch.where(is_desirable, torch.full_like(r, lambda_d), torch.full_like(r, lambda_u))
    return lam - v, {"reward": r.detach(), "value": v.detach()}


@PREFERENCE_LOSSES.register("odpo")
def odpo(
    policy_chosen_logp: Tensor,
    policy_rejected_logp: Tensor,
    ref_chosen_logp: Tensor | None,
    ref_rejected_logp: Tensor | None,
    *,
    score_diff: Tensor,
    beta: float = 0.1,
    alpha: float = 1.0,
    offset_transform: str = "identity",
    margin_rtol: Tensor | float = 0.0,
) -> tuple[Tensor, Diagnostics]:
    """ODPO, DPO with an offset (Amini, Vieira, Cotterell 2024, arXiv:2402.10571).

    ``loss = -log sigma(beta h - Delta)``, ``Delta = alpha * f(score_diff)`` where ``score_diff``
    ``[B]`` = score(x, y_c) - score(x, y_r) >= 0 (a reward model or annotator's scores) and f is
    monotone increasing: ``offset_transform="identity"`` (f(d) = d) or ``"log"`` (f(d) = log d,
    needs d > 0; the paper ablates the scaling function). Delta = 0 recovers DPO.
    Diagnostics as :func:`dpo` (accuracy with its tie) plus ``offset``.
    """
    _check_1d(
        "odpo",
        pc=policy_chosen_logp,
        pr=policy_rejected_logp,
        rc=ref_chosen_logp,
        rr=ref_rejected_logp,
        score_diff=score_diff,
    )
    rc, rr = _need_ref("odpo", ref_chosen_logp, ref_rejected_logp)
    if offset_transform == "identity":
        if not bool((score_diff >= 0).all()):
            raise ValueError(
                "preference loss 'odpo': score_diff must be >= 0 (chosen scores at least rejected)"
            )
        f = score_diff
    elif offset_transform == "log":
        if not bool((score_diff > 0).all()):
            raise ValueError("preference loss 'odpo': offset_transform='log' needs score_diff > 0")
        f = torch.log(score_diff)
    else:
        raise ValueError(
            f"preference loss 'odpo': offset_transform must be 'identity' or 'log', got {offset_transform!r}"
        )
    offset = (alpha * f).detach().to(policy_chosen_logp.dtype)
    h, c, r = _log_ratio_margin(policy_chosen_logp, policy_rejected_logp, rc, rr)
    diag = _reward_diag(beta * c, beta * r,
                        abs(beta) * margin_tie(margin_rtol, policy_chosen_logp, rc, policy_rejected_logp, rr))
    diag["offset"] = offset
    return -F.logsigmoid(beta * h - offset), diag
