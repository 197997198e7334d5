"""Policy losses (registry ``POLICY_LOSSES``): per-token surrogate losses to be MINIMISED.

Every loss is ``fn(inputs: PolicyLossInputs, **hyperparams) -> PolicyLossOutputs`` and returns a
per-token loss ``[B, T]`` that is exactly 0 off the action mask, plus per-token diagnostics. The
reduction to a scalar is not done here: the learner applies a ``REDUCTIONS`` weight function.

Masking contract (why every function starts with :func:`_prepare`): positions with
``action_mask == 0`` may hold anything (padding garbage, ``inf``, ``nan``). Multiplying by the
mask would turn ``0 * inf`` into ``nan`` and leak it into the gradient, so each input is first
replaced by 0 off the mask with ``torch.where`` (whose backward routes a zero gradient to the
unselected branch), and each output is selected with ``torch.where`` again. Changing any input
only at masked positions therefore leaves the loss and its gradient bit-for-bit unchanged.

Ratios are computed as ``exp(clamp(log_ratio, -20, 20))``: an overflowed ``exp`` on a clipped
branch would give ``0 * inf = nan`` in the backward pass of ``torch.minimum``. The clamp only
affects tokens with a ratio beyond ``e^20`` (about 5e8), whose contribution is clipped anyway or
would otherwise be an unbounded update.

Only ``logprob`` carries gradient; ``old_logprob``, ``behavior_logprob`` and ``advantages`` are
detached here so a caller cannot differentiate through the anchors by accident.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.registry import POLICY_LOSSES

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before ``exp`` (see module docstring)."""


@dataclass(frozen=True)
class PolicyLossInputs:
    """Token-level inputs of a policy loss; all tensors are ``[B, T]`` and aligned.

    - ``logprob``: log pi_theta(a_t | s_t) of the current policy (requires grad)
    - ``old_logprob``: log pi_old, frozen before the update; the trust-region anchor (the
      *proximal* policy of decoupled PPO)
    - ``advantages``: A_t (already broadcast to tokens by the advantage estimator)
    - ``action_mask``: 1 on policy-generated tokens, 0 elsewhere (only 0/1 values accepted)
    - ``behavior_logprob``: log mu, the distribution that actually sampled the tokens (engine +
      sampler); required by ``decoupled_ppo`` and by ``topr`` with ``ratio_against="behavior"``
    """

    logprob: Tensor
    old_logprob: Tensor
    advantages: Tensor
    action_mask: Tensor
    behavior_logprob: Tensor | None = None


@dataclass(frozen=True)
class PolicyLossOutputs:
    """Per-token loss ``[B, T]`` (0 off the action mask) and per-token ``[B, T]`` diagnostics.

    Diagnostics are detached floats, 0 off the action mask; flags are 0/1 floats so that any
    reduction (e.g. a masked mean = clip fraction) can be applied to them.
    """

    loss: Tensor
    diagnostics: dict[str, Tensor]


@dataclass(frozen=True)
class _Prepared:
    mask: Tensor  # bool [B, T]
    logprob: Tensor  # 0 off the mask, carries grad
    old: Tensor  # detached, 0 off the mask
    adv: Tensor  # detached, 0 off the mask
    behavior: Tensor | None  # detached, 0 off the mask


def _prepare(inputs: PolicyLossInputs, name: str) -> _Prepared:
    """Validate shapes and mask values, then zero every input off the action mask."""
    lp = inputs.logprob
    if lp.dim() != 2:
        raise ValueError(f"policy loss {name!r}: logprob must be [B, T], got shape {tuple(lp.shape)}")
    fields: dict[str, Tensor | None] = {
        "old_logprob": inputs.old_logprob,
        "advantages": inputs.advantages,
        "action_mask": inputs.action_mask,
        "behavior_logprob": inputs.behavior_logprob,
    }
    for field, t in fields.items():
        if t is not None and t.shape != lp.shape:
            raise ValueError(
                f"policy loss {name!r}: {field} has shape {tuple(t.shape)}, logprob has {tuple(lp.shape)}"
            )
    am = inputs.action_mask
    if not bool(((am == 0) | (am == 1)).all()):
        raise ValueError(f"policy loss {name!r}: action_mask must hold only 0/1 values")
    mask = am.bool()
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    beh = inputs.behavior_logprob
    return _Prepared(
        mask=mask,
        logprob=torch.where(mask, lp, zero),
        old=torch.where(mask, inputs.old_logprob.detach().to(lp.dtype), zero),
        adv=torch.where(mask, inputs.advantages.detach().to(lp.dtype), zero),
        behavior=None if beh is None else torch.where(mask, beh.detach().to(lp.dtype), zero),
    )


def _exp_ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _finish(p: _Prepared, loss: Tensor, diagnostics: dict[str, Tensor]) -> PolicyLossOutputs:
    """Select the loss and diagnostics on the mask (0 elsewhere), diagnostics detached floats."""
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    diag = {k: torch.where(p.mask, v.detach().to(loss.dtype), zero) for k, v in diagnostics.items()}
    return PolicyLossOutputs(loss=torch.where(p.mask, loss, zero), diagnostics=diag)


def _check_eps(name: str, eps_low: float | None, eps_high: float | None) -> None:
    if eps_low is not None and not 0.0 <= eps_low < 1.0:
        raise ValueError(f"policy loss {name!r}: eps_low must be in [0, 1), got {eps_low}")
    if eps_high is not None and not eps_high >= 0.0:
        raise ValueError(f"policy loss {name!r}: eps_high must be >= 0, got {eps_high}")


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate as a loss: ``max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)``.

    With ``dual_clip = c`` (> 1), tokens with ``A < 0`` are further bounded:
    ``min(loss, -c A)`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
    arXiv:1912.09729). Flags: ``clipped_high`` = A > 0 and r > 1+eps_high, ``clipped_low`` =
    A < 0 and r < 1-eps_low (the clip is active: the token gets no gradient), ``dual_clipped`` =
    the dual bound is active.
    """
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr, surr_clipped)
    flags = {
        "ratio": ratio,
        "clipped_high": ((adv > 0) & (ratio > 1.0 + eps_high)).to(ratio.dtype),
        "clipped_low": ((adv < 0) & (ratio < 1.0 - eps_low)).to(ratio.dtype),
    }
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        flags["dual_clipped"] = dual.to(ratio.dtype)
    return loss, flags


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    inputs: PolicyLossInputs,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLossOutputs:
    """PPO clipped surrogate, per token (Schulman et al. 2017, arXiv:1707.06347, eq. 7).

    ``r_t = pi_theta / pi_old = exp(logprob - old_logprob)``;
    ``loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)``.
    Decoupled ``eps_low`` / ``eps_high`` make DAPO's Clip-Higher a setting (Yu et al. 2025,
    arXiv:2503.14476, uses eps_low = 0.2, eps_high = 0.28). ``dual_clip = c > 1`` bounds the loss of
    negative-advantage tokens by ``-c A_t`` (Ye et al. 2020, arXiv:1912.09729; c = 3 there).
    Diagnostics: ``ratio``, ``clipped_low``, ``clipped_high`` and (with dual clip) ``dual_clipped``.
    """
    _check_eps("ppo_clip", eps_low, eps_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"policy loss 'ppo_clip': dual_clip must be > 1, got {dual_clip}")
    p = _prepare(inputs, "ppo_clip")
    ratio = _exp_ratio(p.logprob - p.old)
    loss, diag = _clipped_surrogate(ratio, p.adv, eps_low, eps_high, dual_clip)
    return _finish(p, loss, diag)


def _sequence_log_ratio(p: _Prepared) -> Tensor:
    """``[B, 1]`` mean over action tokens of ``logprob - old_logprob`` (0 for a row without any)."""
    n = p.mask.sum(dim=1, keepdim=True).clamp(min=1).to(p.logprob.dtype)
    return (p.logprob - p.old).sum(dim=1, keepdim=True) / n


@POLICY_LOSSES.register("gspo")
def gspo(inputs: PolicyLossInputs, *, eps_low: float = 3e-4, eps_high: float = 4e-4) -> PolicyLossOutputs:
    """GSPO sequence-level clipped surrogate (Zheng et al. 2025, arXiv:2507.18071).

    ``s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_{t in y_i}(logprob - old_logprob))``
    (the length-normalised, geometric-mean ratio over the row's action tokens), and per token
    ``loss_{i,t} = -min(s_i A_{i,t}, clip(s_i, 1 - eps_low, 1 + eps_high) A_{i,t})``: the same
    ratio and clip decision for every token of the row. The paper uses one sequence advantage
    A_i (then every token of the row has the same loss value); a token-varying ``A_{i,t}`` is
    accepted as given. Defaults are the paper's eps_low = 3e-4, eps_high = 4e-4.
    Gradient note: d loss_{i,t}/d logprob_{i,u} = -A_{i,t} s_i / |y_i| for every u in the row, so
    a row-constant advantage reduced with a within-row-constant weight gives the plain policy
    gradient at s_i = 1.
    """
    _check_eps("gspo", eps_low, eps_high)
    p = _prepare(inputs, "gspo")
    s = _exp_ratio(_sequence_log_ratio(p)).expand_as(p.logprob)
    loss, diag = _clipped_surrogate(s, p.adv, eps_low, eps_high, None)
    return _finish(p, loss, diag)


@POLICY_LOSSES.register("gspo_token")
def gspo_token(
    inputs: PolicyLossInputs, *, eps_low: float = 3e-4, eps_high: float = 4e-4
) -> PolicyLossOutputs:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071): token-level advantages.

    ``s_{i,t} = sg[s_i] * pi_theta(y_{i,t}) / sg[pi_theta(y_{i,t})]``, computed as
    ``exp(sg[log s_i] + logprob_t - sg[logprob_t])``: numerically equal to ``s_i`` (so the clip
    decision is the sequence's), but its gradient is ``s_i * grad logprob_t`` for its own token
    only. ``loss_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1-eps_low, 1+eps_high) A_{i,t})``.
    With a row-constant advantage it has the same value and gradient as :func:`gspo` (paper).
    """
    _check_eps("gspo_token", eps_low, eps_high)
    p = _prepare(inputs, "gspo_token")
    log_s = _sequence_log_ratio(p).detach().expand_as(p.logprob)
    s_tok = _exp_ratio(log_s + p.logprob - p.logprob.detach())
    loss, diag = _clipped_surrogate(s_tok, p.adv, eps_low, eps_high, None)
    return _finish(p, loss, diag)


@POLICY_LOSSES.register("cispo")
def cispo(
    inputs: PolicyLossInputs, *, eps_low: float | None = None, eps_high: float = 0.28
) -> PolicyLossOutputs:
    """CISPO: clipped, stop-gradient IS weight times log-prob (MiniMax-M1, arXiv:2506.13585).

    ``w_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high))`` with ``r_t = pi_theta / pi_old``;
    ``loss_t = -w_t A_t logprob_t``. The weight is clipped, not the objective, so every token keeps
    a gradient ``-w_t A_t grad logprob_t``. ``eps_low=None`` means no lower bound (M1 sets
    eps_low to a large value and tunes only eps_high). M1 does not publish eps_high; the default
    0.28 is this project's choice (DAPO's Clip-Higher value).
    Diagnostics: ``ratio``, ``clipped_low`` / ``clipped_high`` (the weight was truncated).
    """
    _check_eps("cispo", eps_low, eps_high)
    p = _prepare(inputs, "cispo")
    ratio = _exp_ratio(p.logprob - p.old).detach()
    low = None if eps_low is None else 1.0 - eps_low
    weight = ratio.clamp(min=low, max=1.0 + eps_high)
    loss = -weight * p.adv * p.logprob
    diag = {
        "ratio": ratio,
        "clipped_high": (ratio > 1.0 + eps_high).to(ratio.dtype),
        "clipped_low": (ratio < low).to(ratio.dtype) if low is not None else torch.zeros_like(ratio),
    }
    return _finish(p, loss, diag)


@POLICY_LOSSES.register("topr")
def topr(
    inputs: PolicyLossInputs,
    *,
    cap: float = 1.0,
    level: str = "sequence",
    ratio_against: str = "old",
) -> PolicyLossOutputs:
    """Tapered Off-Policy REINFORCE (Le Roux, Bellemare et al. 2025, arXiv:2503.14286).

    ``loss_t = -w A_t logprob_t`` with ``w = 1`` when ``A_t >= 0`` (plain SFT-like REINFORCE term,
    no importance weight) and ``w = sg(clip(pi_theta / mu, 0, cap))`` when ``A_t < 0`` (truncated
    IS; the paper's cap is 1).

    Which sign splits T+ / T-: the paper splits trajectories on the sign of their reward R(tau)
    and treats a REINFORCE baseline c as a shift of the reward (R - c), which it shows changes the
    effective share of positive examples. Here the split is on the sign of the ``advantages``
    passed in: pass the raw reward as the advantage to get the paper's reward-sign split exactly,
    or a baselined advantage to get the R - c split.

    ``level="sequence"`` (the paper's): the ratio is the trajectory ratio
    ``exp(sum_{t in y}(logprob - denom))`` (product of token ratios, not a geometric mean), one
    weight per row; ``level="token"``: a per-token ratio. ``ratio_against`` picks the denominator:
    ``"old"`` (pi_old, the default, consistent with the other losses; combine with a
    ``CORRECTIONS`` entry for the pi_old/mu part) or ``"behavior"`` (mu = ``behavior_logprob``, the
    sampler, as in the paper's offline setting).
    Diagnostics: ``is_weight`` (the truncated weight actually applied on negative tokens, 1 on
    non-negative ones), ``negative`` (A < 0 flag), ``ratio`` (per-token pi_theta/denom).
    """
    if not cap > 0.0:
        raise ValueError(f"policy loss 'topr': cap must be > 0, got {cap}")
    if level not in ("sequence", "token"):
        raise ValueError(f"policy loss 'topr': level must be 'sequence' or 'token', got {level!r}")
    if ratio_against not in ("old", "behavior"):
        raise ValueError(
            f"policy loss 'topr': ratio_against must be 'old' or 'behavior', got {ratio_against!r}"
        )
    if ratio_against == "behavior" and inputs.behavior_logprob is None:
        raise ValueError("policy loss 'topr': ratio_against='behavior' needs inputs.behavior_logprob")
    p = _prepare(inputs, "topr")
    denom = p.old if ratio_against == "old" else p.behavior
    assert denom is not None  # checked above; narrows the type for mypy
    log_r = p.logprob.detach() - denom
    if level == "sequence":
        log_r_w = log_r.sum(dim=1, keepdim=True).expand_as(log_r)
    else:
        log_r_w = log_r
    # min(exp(x), cap) computed in log space so a long trajectory's product never overflows.
    trunc = torch.exp(torch.clamp(log_r_w, max=math.log(cap)))
    negative = p.adv < 0
    weight = torch.where(negative, trunc, torch.ones_like(trunc))
    loss = -weight * p.adv * p.logprob
    diag = {"is_weight": weight, "negative": negative.to(weight.dtype), "ratio": _exp_ratio(log_r)}
    return _finish(p, loss, diag)


@POLICY_LOSSES.register("sapo")
def sapo(inputs: PolicyLossInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> PolicyLossOutputs:
    """SAPO soft-gated surrogate (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization", arXiv:2511.20347).

    ``f_t(r) = (4 / tau_t) * sigmoid(tau_t (r_t - 1))``, ``tau_t = tau_pos`` if ``A_t > 0`` else
    ``tau_neg``; ``loss_t = -f_t(r_t) A_t`` with the token ratio ``r_t = pi_theta / pi_old``.
    The gate replaces the hard clip: ``d f/d r = 4 s (1 - s)`` with ``s = sigmoid(tau (r - 1))``
    equals 1 at r = 1 (so the on-policy gradient is the plain policy gradient) and decays smoothly
    as r moves away from 1, faster for larger tau. Defaults tau_pos = 1.0, tau_neg = 1.05 are the
    paper's (tau_neg > tau_pos damps negative-advantage updates more).
    Note the loss VALUE at r = 1 is ``-2 A / tau``, not ``-A``; only gradients are comparable.
    Diagnostics: ``ratio``, ``gate_weight`` = ``4 s (1 - s)`` (the factor on the PG gradient).
    """
    if not (tau_pos > 0.0 and tau_neg > 0.0):
        raise ValueError(f"policy loss 'sapo': temperatures must be > 0, got {tau_pos}, {tau_neg}")
    p = _prepare(inputs, "sapo")
    ratio = _exp_ratio(p.logprob - p.old)
    tau = torch.where(p.adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * s * p.adv
    return _finish(p, loss, {"ratio": ratio, "gate_weight": 4.0 * s * (1.0 - s)})


@POLICY_LOSSES.register("reinforce")
def reinforce(inputs: PolicyLossInputs) -> PolicyLossOutputs:
    """Plain policy gradient (Williams 1992, "Simple statistical gradient-following algorithms").

    ``loss_t = -A_t logprob_t``; ratio-free (``old_logprob`` is only used for the ``ratio``
    diagnostic), so it is unbiased only on-policy.
    """
    p = _prepare(inputs, "reinforce")
    loss = -p.adv * p.logprob
    return _finish(p, loss, {"ratio": _exp_ratio(p.logprob - p.old)})


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(
    inputs: PolicyLossInputs,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    behavior_weight_cap: float | None = None,
    cap_mode: str = "truncate",
) -> PolicyLossOutputs:
    """Decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298; Hilton et al. 2022, arXiv:2110.00641).

    The proximal policy pi_prox (= ``old_logprob``, recomputed before the update) is the trust
    region centre; mu (= ``behavior_logprob``) sampled the tokens:
    ``u_t = pi_theta / pi_prox``, ``w_t = sg(pi_prox / mu)``,
    ``loss_t = -w_t min(u_t A_t, clip(u_t, 1 - eps_low, 1 + eps_high) A_t)``.
    ``behavior_weight_cap = C`` bounds ``w_t``: ``cap_mode="truncate"`` uses ``min(w_t, C)``;
    ``cap_mode="mask"`` drops tokens with ``w_t > C`` (loss 0), as AReaL's implementation does.
    Requires ``inputs.behavior_logprob`` (ValueError otherwise). With mu = pi_prox it is
    :func:`ppo_clip`. Diagnostics: ``ratio`` (u), ``clipped_low``, ``clipped_high``,
    ``behavior_weight`` (w after the cap), ``behavior_masked`` (mask mode).
    """
    if inputs.behavior_logprob is None:
        raise ValueError("policy loss 'decoupled_ppo': requires inputs.behavior_logprob (mu), got None")
    _check_eps("decoupled_ppo", eps_low, eps_high)
    if cap_mode not in ("truncate", "mask"):
        raise ValueError(
            f"policy loss 'decoupled_ppo': cap_mode must be 'truncate' or 'mask', got {cap_mode!r}"
        )
    if behavior_weight_cap is not None and not behavior_weight_cap > 0.0:
        raise ValueError(
            f"policy loss 'decoupled_ppo': behavior_weight_cap must be > 0, got {behavior_weight_cap}"
        )
    p = _prepare(inputs, "decoupled_ppo")
    assert p.behavior is not None
    ratio = _exp_ratio(p.logprob - p.old)
    surr, diag = _clipped_surrogate(ratio, p.adv, eps_low, eps_high, None)
    w = _exp_ratio(p.old - p.behavior)
    masked = torch.zeros_like(w, dtype=torch.bool)
    if behavior_weight_cap is not None:
        if cap_mode == "truncate":
            w = w.clamp(max=behavior_weight_cap)
        else:
            masked = w > behavior_weight_cap
            w = torch.where(masked, torch.zeros_like(w), w)
    diag["behavior_weight"] = w
    diag["behavior_masked"] = masked.to(w.dtype)
    return _finish(p, w * surr, diag)
