"""Advantage and return estimators (registry ADVANTAGES).

Every estimator is ``fn(inputs: AdvantageInputs, **hyperparams) -> AdvantageOutputs``. Token-level
tensors are ``[B, T]`` with ``action_mask`` (1 = policy token); sequence-level ones are ``[B]``.

Conventions shared by all estimators (see docs/algorithms_part_a.md for the formulas):

- Output advantages are ``[B, T]`` and exactly 0 off the action mask and on invalid rows.
- ``valid`` (default all True) marks rows whose result exists. ``False`` rows (missing results,
  infra errors) are excluded from every baseline and statistic and get advantage 0; their
  ``rewards`` entry may be anything, NaN included — it is never read.
- Sequence-level advantages are broadcast to the row's action tokens; the *reduction* decides
  the length weighting, not the estimator.
- Token-level estimators (``gae``, ``reinforce_pp``, ``reinforce_pp_baseline``) run their time
  index over the action tokens of a row *in order*, skipping every non-action token (prompt,
  tool observation, padding). The reward stream is ``token_rewards`` (e.g. -beta*KL per token)
  plus, if ``rewards`` is given, the sequence reward added at the row's last action token.
  A non-zero ``token_rewards`` entry off the action mask is a ``ValueError`` (it would be lost).
- Group statistics use the *unbiased* (Bessel, N-1) std, as ``torch.std`` in the reference
  GRPO implementations; batch whitening (REINFORCE++) uses the population std over tokens.
- Safe normalisation rule: a set (group or batch) whose std is below ``min_std`` carries no
  usable signal, so its advantages are set to exactly 0 instead of amplifying float noise;
  otherwise the divisor is ``std + eps``. A group with fewer than 2 valid members gets 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algos.registry import ADVANTAGES

__all__ = [
    "AdvantageInputs",
    "AdvantageOutputs",
    "discounted_returns",
    "dr_grpo",
    "gae",
    "gigpo",
    "grpo",
    "place_at_last_action",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """Inputs of every advantage estimator; each estimator documents which fields it needs.

    Fields (shapes; B rows, T token positions, S env steps):
      action_mask      [B, T] 0/1 float, 1 = policy-generated token.
      rewards          [B] float, sequence-level total reward R_i (read only where ``valid``).
      token_rewards    [B, T] float, per-token rewards at action positions (e.g. -beta*KL).
      group_index      [B] long, group id per row (the G samples of one prompt share an id).
      valid            [B] bool, False = missing result: excluded from statistics, advantage 0.
      values           [B, T] float, critic V(s_t) at action positions (gae).
      terminal         [B] bool, True = episode ended in a terminal state, False = truncated
                       (default: all terminal).
      bootstrap_value  [B] float, V(s_final) of the state after the last action; required for
                       truncated rows in gae.
      baseline         [B] float, ReMax greedy-rollout reward.
      step_index       [B, T] long, GiGPO: env step (0-based turn) each action token belongs to,
                       -1 on non-action tokens.
      step_anchor      [B, S] long, GiGPO: id (e.g. hash) of the state s_t in which step t was
                       taken; -1 = no such step (padding past the episode's last step).
      step_rewards     [B, S] float, GiGPO: the env reward r_t received for step t (0 on padding).
    """

    action_mask: Tensor
    rewards: Tensor | None = None
    token_rewards: Tensor | None = None
    group_index: Tensor | None = None
    valid: Tensor | None = None
    values: Tensor | None = None
    terminal: Tensor | None = None
    bootstrap_value: Tensor | None = None
    baseline: Tensor | None = None
    step_index: Tensor | None = None
    step_anchor: Tensor | None = None
    step_rewards: Tensor | None = None


@dataclass(frozen=True)
class AdvantageOutputs:
    """``advantages`` [B, T] (0 off the action mask); ``returns`` [B, T] value targets (gae) or None."""

    advantages: Tensor
    returns: Tensor | None


# ----------------------------------------------------------------------------- validation helpers


def _mask(inputs: AdvantageInputs) -> Tensor:
    m = inputs.action_mask
    if m.dim() != 2:
        raise ValueError(f"advantage: action_mask must be [B, T], got shape {tuple(m.shape)}")
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("advantage: action_mask must hold only 0/1 values")
    return m > 0


def _valid(inputs: AdvantageInputs, b: int) -> Tensor:
    if inputs.valid is None:
        return torch.ones(b, dtype=torch.bool, device=inputs.action_mask.device)
    if inputs.valid.shape != (b,):
        raise ValueError(f"advantage: valid must be [B]={b}, got shape {tuple(inputs.valid.shape)}")
    return inputs.valid.to(torch.bool)


def _float_dtype(inputs: AdvantageInputs) -> torch.dtype:
    for t in (inputs.rewards, inputs.token_rewards, inputs.values):
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _seq(inputs: AdvantageInputs, name: str, valid: Tensor) -> Tensor:
    """A required [B] float field, with invalid rows replaced by 0 so NaN never propagates."""
    x = getattr(inputs, name)
    b = valid.shape[0]
    if x is None:
        raise ValueError(f"advantage: field {name!r} is required by this estimator")
    if x.shape != (b,):
        raise ValueError(f"advantage: {name} must be [B]={b}, got shape {tuple(x.shape)}")
    x = x.to(_float_dtype(inputs))
    bad = valid & ~torch.isfinite(x)
    if bool(bad.any()):
        raise ValueError(
            f"advantage: {name} is not finite on valid rows {torch.nonzero(bad).flatten().tolist()}"
        )
    return torch.where(valid, x, torch.zeros_like(x))


def _groups(inputs: AdvantageInputs, b: int) -> tuple[Tensor, Tensor]:
    """(unique group ids [G], inverse [B] in 0..G-1)."""
    g = inputs.group_index
    if g is None:
        raise ValueError("advantage: field 'group_index' is required by this (group-based) estimator")
    if g.shape != (b,):
        raise ValueError(f"advantage: group_index must be [B]={b}, got shape {tuple(g.shape)}")
    ids, inv = torch.unique(g, return_inverse=True)
    return ids, inv


def _check_norm(eps: float, min_std: float) -> None:
    """A normaliser ``(x - mean) / (std + eps)`` with ``std >= min_std``: both must be >= 0 (a negative
    ``eps`` can divide by ~0 or flip the advantage's sign)."""
    if not (eps >= 0 and min_std >= 0):
        raise ValueError(f"eps and min_std must be >= 0, got eps={eps}, min_std={min_std}")


def _group_stats(x: Tensor, inv: Tensor, n_groups: int, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element (group mean, unbiased group std, valid-member count) over valid members only."""
    w = valid.to(x.dtype)
    count = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, w)
    total = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x * w)
    mean = total / count.clamp(min=1.0)
    dev = (x - mean[inv]) * w
    sq = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inv, dev * dev)
    std = (sq / (count - 1.0).clamp(min=1.0)).sqrt()
    return mean[inv], std[inv], count[inv]


def _group_normalize(
    x: Tensor, inv: Tensor, n_groups: int, valid: Tensor, norm_std: bool, eps: float, min_std: float
) -> Tensor:
    """(x - mean_g) [/ (std_g + eps)] per element; 0 for invalid elements, groups with < 2 valid
    members, and (when ``norm_std``) groups whose std < ``min_std``."""
    _check_norm(eps, min_std)
    mean, std, count = _group_stats(x, inv, n_groups, valid)
    centred = x - mean
    if norm_std:
        out = torch.where(std >= min_std, centred / (std + eps), torch.zeros_like(x))
    else:
        out = centred
    keep = valid & (count >= 2)
    return torch.where(keep, out, torch.zeros_like(x))


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, seq_adv[:, None].expand(mask.shape), torch.zeros((), dtype=seq_adv.dtype))


# ----------------------------------------------------------- action-position compaction (time axis)


def _compact(x: Tensor, mask: Tensor) -> Tensor:
    """[B, T] -> [B, N+1]: row i's action-token values in order at 0..n_i-1, zeros after.

    The extra last column is a dump slot for non-action tokens (discarded by callers)."""
    b, _ = mask.shape
    n_max = int(mask.sum(dim=1).max().item()) if b > 0 else 0
    pos = torch.where(mask, mask.long().cumsum(dim=1) - 1, torch.full_like(mask, n_max, dtype=torch.long))
    out = torch.zeros(b, n_max + 1, dtype=x.dtype, device=x.device)
    out.scatter_(1, pos, torch.where(mask, x, torch.zeros_like(x)))
    out[:, n_max] = 0
    return out


def _expand(c: Tensor, mask: Tensor) -> Tensor:
    """Inverse of ``_compact``: [B, N+1] -> [B, T], 0 off the mask."""
    pos = torch.where(mask, mask.long().cumsum(dim=1) - 1, torch.zeros_like(mask, dtype=torch.long))
    return torch.where(mask, c.gather(1, pos), torch.zeros((), dtype=c.dtype))


def _reward_stream(
    inputs: AdvantageInputs, mask: Tensor, valid: Tensor, seq_rewards: Tensor | None
) -> Tensor:
    """Compacted per-action rewards [B, N+1]: token_rewards plus ``seq_rewards`` at the last action."""
    dtype = _float_dtype(inputs)
    b, t = mask.shape
    if inputs.token_rewards is not None:
        tr = inputs.token_rewards
        if tr.shape != (b, t):
            raise ValueError(f"advantage: token_rewards must be [B, T]={b, t}, got {tuple(tr.shape)}")
        tr = tr.to(dtype)
        off = (~mask) & (tr != 0) & valid[:, None]
        if bool(off.any()):
            rows = sorted(set(torch.nonzero(off)[:, 0].tolist()))
            raise ValueError(
                f"advantage: token_rewards non-zero off the action mask in rows {rows} (would be lost)"
            )
        live = mask & valid[:, None]
        bad = live & ~torch.isfinite(tr)
        if bool(bad.any()):
            rows = sorted(set(torch.nonzero(bad)[:, 0].tolist()))
            raise ValueError(f"advantage: token_rewards not finite in rows {rows}")
        tr = torch.where(live, tr, torch.zeros_like(tr))
    else:
        tr = torch.zeros(b, t, dtype=dtype, device=mask.device)
    c = _compact(tr, mask)
    if seq_rewards is not None:
        n = mask.sum(dim=1)
        has = n > 0
        last = (n - 1).clamp(min=0)
        add = torch.where(has, seq_rewards.to(dtype), torch.zeros_like(seq_rewards, dtype=dtype))
        c = c.scatter_add(1, last[:, None], add[:, None])
    return c


def _final_next_value(inputs: AdvantageInputs, b: int, dtype: torch.dtype, valid: Tensor) -> Tensor:
    """V(s_final) per row: 0 if terminal, ``bootstrap_value`` if truncated."""
    device = inputs.action_mask.device
    if inputs.terminal is None:
        return torch.zeros(b, dtype=dtype, device=device)
    if inputs.terminal.shape != (b,):
        raise ValueError(f"advantage: terminal must be [B]={b}, got {tuple(inputs.terminal.shape)}")
    truncated = (~inputs.terminal.to(torch.bool)) & valid
    if not bool(truncated.any()):
        return torch.zeros(b, dtype=dtype, device=device)
    if inputs.bootstrap_value is None:
        rows = torch.nonzero(truncated).flatten().tolist()
        raise ValueError(f"advantage: truncated rows {rows} need bootstrap_value (V of the final state)")
    bv = inputs.bootstrap_value
    if bv.shape != (b,):
        raise ValueError(f"advantage: bootstrap_value must be [B]={b}, got {tuple(bv.shape)}")
    bv = bv.to(dtype)
    bad = truncated & ~torch.isfinite(bv)
    if bool(bad.any()):
        raise ValueError(
            f"advantage: bootstrap_value not finite on truncated rows {torch.nonzero(bad).flatten().tolist()}"
        )
    return torch.where(truncated, bv, torch.zeros_like(bv))


def place_at_last_action(rewards: Tensor, action_mask: Tensor) -> Tensor:
    """[B] sequence rewards -> [B, T] with R_i at row i's last action token, 0 elsewhere.

    The conventional placement of an outcome reward for token-level credit assignment (e.g. PPO
    for RLHF puts the score at the EOS token). Rows with no action token get nothing.
    """
    mask = action_mask > 0
    if rewards.shape != (mask.shape[0],):
        raise ValueError(
            f"place_at_last_action: rewards must be [B]={mask.shape[0]}, got {tuple(rewards.shape)}"
        )
    t = mask.shape[1]
    idx = torch.arange(t, device=mask.device).expand(mask.shape)
    last = torch.where(mask, idx, torch.full_like(idx, -1)).max(dim=1).values
    hit = (idx == last[:, None]) & mask
    return torch.where(hit, rewards[:, None].expand(mask.shape), torch.zeros((), dtype=rewards.dtype))


def discounted_returns(
    token_rewards: Tensor,
    action_mask: Tensor,
    gamma: float = 1.0,
    terminal: Tensor | None = None,
    bootstrap_value: Tensor | None = None,
) -> Tensor:
    """Monte-Carlo return-to-go over action positions: G_k = r_k + gamma * G_{k+1}.

    k runs over row i's action tokens in order (non-action tokens are skipped and get 0);
    G_{n_i} = 0 for terminal rows and ``bootstrap_value[i]`` for truncated ones (``terminal``
    default all True). Sutton & Barto 2018, eq. 3.9. Returns ``[B, T]``, 0 off the mask.
    """
    inputs = AdvantageInputs(
        action_mask=action_mask,
        token_rewards=token_rewards,
        terminal=terminal,
        bootstrap_value=bootstrap_value,
    )
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    r = _reward_stream(inputs, mask, valid, None)
    final = _final_next_value(inputs, b, r.dtype, valid)
    return _expand(_returns_compact(r, mask.sum(dim=1), gamma, final), mask)


def _returns_compact(r: Tensor, n: Tensor, gamma: float, final: Tensor) -> Tensor:
    g = torch.zeros_like(r)
    running = torch.zeros_like(final)
    for k in range(r.shape[1] - 2, -1, -1):
        inside = n.gt(k)
        is_last = (n - 1).eq(k)
        running = torch.where(is_last, final, running)
        running = r[:, k] + gamma * running
        running = torch.where(inside, running, torch.zeros_like(running))
        g[:, k] = running
    return g


def _check_discount(gamma: float, lam: float | None = None) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"advantage: gamma must be in [0, 1], got {gamma}")
    if lam is not None and not 0.0 <= lam <= 1.0:
        raise ValueError(f"advantage: lam must be in [0, 1], got {lam}")


# ----------------------------------------------------------------------------------- estimators


@ADVANTAGES.register("gae", needs=("critic",))
def gae(inputs: AdvantageInputs, gamma: float = 1.0, lam: float = 0.95) -> AdvantageOutputs:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

    Over row i's action tokens k = 0..n-1 (observation/prompt tokens skipped; they are part of
    the state, not time steps), with r_k from the reward stream and V_k = ``values`` there::

        delta_k = r_k + gamma * V_{k+1} - V_k,        V_n := 0 (terminal) | bootstrap (truncated)
        A_k     = delta_k + gamma * lam * A_{k+1},    A_n := 0 (the trace always stops at the end)
        returns_k = A_k + V_k                         (the value targets)

    Terminal rows: no bootstrap and no trace past the end. Truncated rows (``terminal`` False):
    the last delta bootstraps from ``bootstrap_value`` = V(s_final) but the trace still stops
    there (nothing after the cut was observed). Needs ``values``; ``rewards`` (added at the last
    action token) and/or ``token_rewards``. Invalid rows: advantages and returns 0 — the learner
    must drop them from the value loss mask too.
    """
    _check_discount(gamma, lam)
    mask = _mask(inputs)
    b, t = mask.shape
    valid = _valid(inputs, b)
    if inputs.values is None:
        raise ValueError("gae: field 'values' (critic V(s_t) at action positions) is required")
    if inputs.values.shape != (b, t):
        raise ValueError(f"gae: values must be [B, T]={b, t}, got {tuple(inputs.values.shape)}")
    if inputs.rewards is None and inputs.token_rewards is None:
        raise ValueError("gae: needs 'rewards' and/or 'token_rewards'")
    seq = _seq(inputs, "rewards", valid) if inputs.rewards is not None else None
    r = _reward_stream(inputs, mask, valid, seq)
    dtype = r.dtype
    vals = inputs.values.to(dtype).detach()
    live = mask & valid[:, None]
    if bool((live & ~torch.isfinite(vals)).any()):
        raise ValueError("gae: values not finite at action positions of valid rows")
    v = _compact(torch.where(live, vals, torch.zeros_like(vals)), mask)
    final = _final_next_value(inputs, b, dtype, valid)
    n = mask.sum(dim=1)
    adv = torch.zeros_like(r)
    running = torch.zeros(b, dtype=dtype, device=r.device)
    for k in range(r.shape[1] - 2, -1, -1):
        is_last = (n - 1).eq(k)
        v_next = torch.where(is_last, final, v[:, k + 1])
        delta = r[:, k] + gamma * v_next - v[:, k]
        running = delta + gamma * lam * torch.where(is_last, torch.zeros_like(running), running)
        running = torch.where(n.gt(k), running, torch.zeros_like(running))
        adv[:, k] = running
    advantages = _expand(adv, mask)
    returns = _expand(adv + v, mask)
    zero = torch.zeros((), dtype=dtype)
    return AdvantageOutputs(
        advantages=torch.where(valid[:, None], advantages, zero),
        returns=torch.where(valid[:, None], returns, zero),
    )


@ADVANTAGES.register("grpo", needs=("groups>=2",))
def grpo(
    inputs: AdvantageInputs, norm_std: bool = True, eps: float = 1e-6, min_std: float = 1e-6
) -> AdvantageOutputs:
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2).

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps), over the valid members of row i's group g;
    std is unbiased (N-1). Safe rule: a group whose std < ``min_std`` (all-equal or float-noise
    rewards) or with < 2 valid members gets exactly 0 — never NaN, never amplified noise.
    ``norm_std=False`` drops the division (then identical to ``dr_grpo``). Broadcast to the
    row's action tokens. Needs ``rewards``, ``group_index``.
    """
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    r = _seq(inputs, "rewards", valid)
    ids, inv = _groups(inputs, b)
    adv = _group_normalize(r, inv, ids.numel(), valid, norm_std, eps, min_std)
    return AdvantageOutputs(advantages=_broadcast(adv, mask), returns=None)


@ADVANTAGES.register("dr_grpo", needs=("groups>=2",))
def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A_i = R_i - mean_g(R) over the valid members of row i's group: no std division. The other
    half of Dr. GRPO, no 1/|o_i| length normalisation, is the reduction's job: pair it with
    ``seq_mean_token_sum_norm``. Groups with < 2 valid members get 0. Needs ``rewards``,
    ``group_index``.
    """
    return grpo(inputs, norm_std=False)


@ADVANTAGES.register("rloo", needs=("groups>=2",))
def rloo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = R_i - (1 / (K-1)) * sum_{j in g, j != i} R_j = K/(K-1) * (R_i - mean_g(R)), with K the
    number of valid members of row i's group. A group with K = 1 has no leave-one-out baseline
    and is a ``ValueError`` naming the group id(s); a group with K = 0 (every member invalid)
    needs none and gets 0. Needs ``rewards``, ``group_index``.
    """
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    r = _seq(inputs, "rewards", valid)
    ids, inv = _groups(inputs, b)
    w = valid.to(r.dtype)
    count = torch.zeros(ids.numel(), dtype=r.dtype, device=r.device).index_add_(0, inv, w)
    total = torch.zeros(ids.numel(), dtype=r.dtype, device=r.device).index_add_(0, inv, r * w)
    small = count == 1  # a group whose members are all invalid (K = 0) needs no baseline: all 0
    if bool(small.any()):
        bad = {int(i): int(c) for i, c in zip(ids[small].tolist(), count[small].tolist(), strict=True)}
        raise ValueError(f"rloo: groups need K >= 2 valid samples; group id -> K: {bad}")
    k = count[inv]
    baseline = (total[inv] - r) / (k - 1.0).clamp(min=1.0)
    adv = torch.where(valid, r - baseline, torch.zeros_like(r))
    return AdvantageOutputs(advantages=_broadcast(adv, mask), returns=None)


@ADVANTAGES.register("reinforce")
def reinforce(inputs: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE with a batch-mean baseline (Williams 1992): A_i = R_i - mean_{valid j}(R_j).

    The baseline is the mean reward over all valid rows of the batch. Needs ``rewards``.
    """
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    r = _seq(inputs, "rewards", valid)
    n = valid.sum()
    mean = r.sum() / n.clamp(min=1).to(r.dtype)
    adv = torch.where(valid, r - mean, torch.zeros_like(r))
    return AdvantageOutputs(advantages=_broadcast(adv, mask), returns=None)


@ADVANTAGES.register("remax", needs=("baseline",))
def remax(inputs: AdvantageInputs) -> AdvantageOutputs:
    """ReMax (Li et al. 2023, arXiv:2310.10505): A_i = R_i - R(x_i, y_greedy_i).

    ``baseline`` is the reward of a greedy rollout of the same prompt, computed by the caller.
    Needs ``rewards``, ``baseline``.
    """
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    r = _seq(inputs, "rewards", valid)
    base = _seq(inputs, "baseline", valid)
    adv = torch.where(valid, r - base, torch.zeros_like(r))
    return AdvantageOutputs(advantages=_broadcast(adv, mask), returns=None)


def _batch_whiten(x: Tensor, live: Tensor, eps: float, min_std: float) -> Tensor:
    """(x - mean) / (std + eps) over the ``live`` positions (population std); 0 elsewhere.
    Fewer than 2 live positions or std < ``min_std`` -> all 0 (no usable signal)."""
    _check_norm(eps, min_std)
    w = live.to(x.dtype)
    n = w.sum()
    if float(n.item()) < 2:
        return torch.zeros_like(x)
    mean = (x * w).sum() / n
    dev = (x - mean) * w
    std = ((dev * dev).sum() / n).sqrt()
    if float(std.item()) < min_std:
        return torch.zeros_like(x)
    return torch.where(live, (x - mean) / (std + eps), torch.zeros_like(x))


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(
    inputs: AdvantageInputs, gamma: float = 1.0, eps: float = 1e-8, min_std: float = 1e-6
) -> AdvantageOutputs:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262).

    Token return  A_t = R - beta * sum_{i>=t} KL_i  generalised to  G_t = sum_{k>=t} gamma^{k-t} r_k
    over the row's action tokens, where the reward stream r_k = ``token_rewards`` (pass
    -beta*KL_k there for KL-in-reward) plus ``rewards`` at the last action token. Then global
    batch normalisation over every valid action token of the batch:
    A_norm = (G - mean(G)) / (std(G) + eps) (population std; std < ``min_std`` -> 0).
    No critic, so no bootstrap: ``terminal``/``bootstrap_value`` are ignored.
    """
    _check_discount(gamma)
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    if inputs.rewards is None and inputs.token_rewards is None:
        raise ValueError("reinforce_pp: needs 'rewards' and/or 'token_rewards'")
    seq = _seq(inputs, "rewards", valid) if inputs.rewards is not None else None
    return _reinforce_pp_core(inputs, mask, valid, seq, gamma, eps, min_std)


def _reinforce_pp_core(
    inputs: AdvantageInputs,
    mask: Tensor,
    valid: Tensor,
    seq: Tensor | None,
    gamma: float,
    eps: float,
    min_std: float,
) -> AdvantageOutputs:
    r = _reward_stream(inputs, mask, valid, seq)
    zeros = torch.zeros(mask.shape[0], dtype=r.dtype, device=r.device)
    g = _expand(_returns_compact(r, mask.sum(dim=1), gamma, zeros), mask)
    live = mask & valid[:, None]
    return AdvantageOutputs(advantages=_batch_whiten(g, live, eps, min_std), returns=None)


@ADVANTAGES.register("reinforce_pp_baseline", needs=("groups>=2",))
def reinforce_pp_baseline(
    inputs: AdvantageInputs, gamma: float = 1.0, eps: float = 1e-8, min_std: float = 1e-6
) -> AdvantageOutputs:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group mean, batch std.

    R'_i = R_i - mean_g(R) over the valid members of row i's group (a 1-member group gives 0),
    then the REINFORCE++ token return of the stream ``token_rewards`` + R'_i at the last action
    token, then batch normalisation over every valid action token:
    A_norm = (A' - mean_batch(A')) / (std_batch(A') + eps) (the batch mean is subtracted again).
    Needs ``rewards``, ``group_index``.
    """
    _check_discount(gamma)
    mask = _mask(inputs)
    b = mask.shape[0]
    valid = _valid(inputs, b)
    r = _seq(inputs, "rewards", valid)
    ids, inv = _groups(inputs, b)
    centred = _group_normalize(r, inv, ids.numel(), valid, False, 0.0, 0.0)
    return _reinforce_pp_core(inputs, mask, valid, centred, gamma, eps, min_std)


@ADVANTAGES.register("gigpo", needs=("groups>=2", "step_ids"))
def gigpo(
    inputs: AdvantageInputs,
    omega: float = 1.0,
    gamma: float = 0.95,
    norm_std: bool = True,
    eps: float = 1e-6,
    min_std: float = 1e-6,
) -> AdvantageOutputs:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training",
    arXiv:2505.10978).

    Episode level: A^E_i = (R_i - mean_g(R)) / F_norm over row i's rollout group (F_norm = std,
    or 1 if ``norm_std`` is False) — exactly ``grpo``, same safe rule.
    Step level: for each step t of row i, the discounted step return
    R_t^(i) = sum_{k>=t} gamma^{k-t} r_k^(i) (``step_rewards``); steps are grouped by their anchor
    state, key = (group_index_i, step_anchor[i, t]) — anchors are only compared within the same
    rollout group (same task and initial state), across and within trajectories;
    A^S = (R_t - mean_{step group}) / F_norm over the step group (same safe rule, < 2 members -> 0).
    Combined per action token of step t: A = A^E_i + omega * A^S(i, t).
    Needs ``rewards`` [B], ``group_index`` [B], ``step_index`` [B, T], ``step_anchor`` [B, S],
    ``step_rewards`` [B, S]. Every action token must map to a step t with step_anchor >= 0.
    """
    _check_discount(gamma)
    mask = _mask(inputs)
    b, t_len = mask.shape
    valid = _valid(inputs, b)
    r = _seq(inputs, "rewards", valid)
    ids, inv = _groups(inputs, b)
    a_ep = _group_normalize(r, inv, ids.numel(), valid, norm_std, eps, min_std)

    if inputs.step_index is None or inputs.step_anchor is None or inputs.step_rewards is None:
        raise ValueError("gigpo: fields 'step_index', 'step_anchor' and 'step_rewards' are required")
    anchor = inputs.step_anchor.long()
    if anchor.dim() != 2 or anchor.shape[0] != b:
        raise ValueError(f"gigpo: step_anchor must be [B, S] with B={b}, got {tuple(anchor.shape)}")
    s_len = anchor.shape[1]
    if inputs.step_rewards.shape != anchor.shape:
        raise ValueError(
            f"gigpo: step_rewards {tuple(inputs.step_rewards.shape)} != step_anchor {tuple(anchor.shape)}"
        )
    if inputs.step_index.shape != (b, t_len):
        raise ValueError(f"gigpo: step_index must be [B, T]={b, t_len}, got {tuple(inputs.step_index.shape)}")
    step_live = (anchor >= 0) & valid[:, None]
    sr = inputs.step_rewards.to(r.dtype)
    if bool((step_live & ~torch.isfinite(sr)).any()):
        raise ValueError("gigpo: step_rewards not finite on live steps")
    sr = torch.where(step_live, sr, torch.zeros_like(sr))
    # Discounted return-to-go over steps: R_t = r_t + gamma * R_{t+1}.
    step_ret = torch.zeros_like(sr)
    running = torch.zeros(b, dtype=sr.dtype, device=sr.device)
    for s in range(s_len - 1, -1, -1):
        running = sr[:, s] + gamma * running
        step_ret[:, s] = running

    # Step-group key = (rollout group, anchor id); ``inv`` is the dense rollout-group index.
    keys = torch.stack([inv[:, None].expand(b, s_len), anchor], dim=-1).reshape(-1, 2)
    _, step_inv = torch.unique(keys, dim=0, return_inverse=True)
    n_step_groups = int(step_inv.max().item()) + 1 if step_inv.numel() else 0
    a_step = _group_normalize(
        step_ret.reshape(-1), step_inv, n_step_groups, step_live.reshape(-1), norm_std, eps, min_std
    ).reshape(b, s_len)

    si = inputs.step_index.long()
    live_tok = mask & valid[:, None]
    in_range = (si >= 0) & (si < s_len)
    safe = si.clamp(0, max(s_len - 1, 0))
    tok_anchor = anchor.gather(1, safe) if s_len > 0 else torch.full_like(si, -1)
    bad = live_tok & (~in_range | (tok_anchor < 0))
    if bool(bad.any()):
        rows = sorted(set(torch.nonzero(bad)[:, 0].tolist()))
        raise ValueError(f"gigpo: action tokens in rows {rows} map to no live step (step_index/step_anchor)")
    tok_step_adv = a_step.gather(1, safe) if s_len > 0 else torch.zeros_like(mask, dtype=r.dtype)
    combined = a_ep[:, None] + omega * tok_step_adv
    adv = torch.where(live_tok, combined, torch.zeros((), dtype=r.dtype))
    return AdvantageOutputs(advantages=adv, returns=None)
