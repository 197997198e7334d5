"""The failure-symptom table: from a symptom of the run to the part to inspect first; rules + evidence.

Each rule reads step metrics (and the ledger summaries where the metrics cannot say) and returns
a :class:`Symptom` whose ``evidence`` holds the numbers that flagged it (or why it did not), and
whose ``check`` lists the parts to inspect first (verifier, advantage groups, clip, denominator,
...). Series are compared by their first and last thirds ("early" / "late"), so one noisy step
cannot flag a symptom on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from posttrain.diagnostics.trends import metric_series, reward_length_corr

# Thresholds: absolute for [0, 1] quantities, relative for entropy / length.
REWARD_RISE = 0.05
HELDOUT_DROP = 0.02
ENTROPY_COLLAPSE = 0.5  # late entropy below half the early entropy
ZERO_LOSS_SHARE = 0.5
LENGTH_DRIFT = 0.25  # relative change of the mean response length
COLLAPSE_FRACTION = 0.5  # late reward below half the earlier peak
COLLAPSE_MIN_PEAK = 0.1
LAG_MEAN = 0.5
ZERO_LOSS_TOL = 1e-6  # a zero-advantage batch still leaves float noise (~1e-9) in the loss
ACCEPTED_FRAC = 0.9


@dataclasses.dataclass(frozen=True)
class Symptom:
    """One row of the symptom table."""

    name: str
    flagged: bool
    evidence: str
    check: str


def early_late(values: Sequence[float]) -> tuple[float, float] | None:
    """Means of the first and last thirds (at least one value each); ``None`` with < 2 values."""
    if len(values) < 2:
        return None
    k = max(1, len(values) // 3)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _vals(metrics: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [v for _, v in metric_series(metrics, key)]


def reward_up_heldout_down(metrics: Sequence[dict[str, Any]]) -> Symptom:
    """Train reward rises while held-out accuracy falls."""
    check = ("check verifier coverage, reward hacking, reference drift and data contamination first; "
             "do not tune clipping first")
    name = "reward up, held-out down"
    rw, ho = early_late(_vals(metrics, "reward/mean")), metric_series(metrics, "heldout/accuracy")
    if rw is None or len(ho) < 2:
        return Symptom(name, False, "needs >= 2 reward steps and >= 2 held-out evaluations", check)
    (s0, a0), (s1, a1) = ho[0], ho[-1]
    ev = (f"train reward {rw[0]:.3f} -> {rw[1]:.3f} (early/late thirds); "
          f"held-out accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})")
    return Symptom(name, rw[1] - rw[0] > REWARD_RISE and a0 - a1 > HELDOUT_DROP, ev, check)


def entropy_collapse(metrics: Sequence[dict[str, Any]]) -> Symptom:
    """Policy entropy falls below half its early value."""
    check = ("check the positive-advantage ratio, the upper clip, sampling temperature, prompt difficulty "
             "and repeated candidates; Clip-Higher is only one option")
    el = early_late(_vals(metrics, "entropy"))
    if el is None:
        return Symptom("entropy collapse", False, "needs >= 2 steps with an entropy metric", check)
    ev = f"entropy {el[0]:.3f} -> {el[1]:.3f} (early/late thirds)"
    return Symptom("entropy collapse", el[0] > 0 and el[1] < ENTROPY_COLLAPSE * el[0], ev, check)


def _group_shares(rows: Sequence[dict[str, Any]]) -> tuple[float, float, int]:
    rates = {(r["step"], r["group_id"]): r["group_success"] for r in rows if r["group_success"] is not None}
    n = len(rates)
    if not n:
        return 0.0, 0.0, 0
    return sum(v == 1 for v in rates.values()) / n, sum(v == 0 for v in rates.values()) / n, n


def loss_often_zero(metrics: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> Symptom:
    """The policy loss (or every advantage of a group) is zero in most steps."""
    check = ("check the all-correct / all-wrong group share, group size, the reward parser and sampling "
             "diversity; dynamic sampling only selects mixed groups, it cannot fix a wrong verifier")
    losses, zero_adv = _vals(metrics, "loss"), _vals(metrics, "adv/zero_group_frac")
    if not losses and not zero_adv:
        return Symptom("loss often zero", False, "no loss or adv/zero_group_frac metric", check)
    n_zero = sum(abs(v) < ZERO_LOSS_TOL for v in losses)
    zero_share = n_zero / len(losses) if losses else 0.0
    adv_share = sum(zero_adv) / len(zero_adv) if zero_adv else 0.0
    all_pass, all_fail, n_groups = _group_shares(rows)
    ev = (f"|loss| < {ZERO_LOSS_TOL:g} in {n_zero}/{len(losses)} steps; mean zero-advantage group "
          f"fraction {adv_share:.2f}; ledger groups: {all_pass:.0%} all pass, {all_fail:.0%} all fail "
          f"(of {n_groups})")
    return Symptom("loss often zero", zero_share >= ZERO_LOSS_SHARE or adv_share >= ZERO_LOSS_SHARE, ev, check)


def length_drift(metrics: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> Symptom:
    """The mean response length moves by more than 25% between the early and late thirds."""
    check = ("check the reward-length correlation, the response/token/fixed denominator, truncation reward, "
             "EOS probability and positive NLL together")
    el = early_late(_vals(metrics, "length/mean"))
    if el is None or el[0] <= 0:
        return Symptom("response length drift", False, "needs >= 2 steps with length/mean", check)
    corr = [c for c in reward_length_corr(rows).values() if c is not None]
    trunc = _vals(metrics, "finish/truncated_rate")
    ev = (f"mean length {el[0]:.1f} -> {el[1]:.1f} tokens ({(el[1] - el[0]) / el[0]:+.0%}); mean reward-length "
          f"correlation {sum(corr) / len(corr):+.2f}" if corr else
          f"mean length {el[0]:.1f} -> {el[1]:.1f} tokens ({(el[1] - el[0]) / el[0]:+.0%}); reward-length "
          "correlation undefined (constant reward or length)")
    if trunc:
        ev += f"; last truncation rate {trunc[-1]:.2f}"
    return Symptom("response length drift", abs(el[1] - el[0]) / el[0] > LENGTH_DRIFT, ev, check)


def late_collapse(metrics: Sequence[dict[str, Any]]) -> Symptom:
    """Reward rose to a peak, then the late third fell below half of it."""
    check = ("check critic error, reuse epochs, policy staleness, the train-rollout log-prob gap, the ratio "
             "tail and the optimizer step; a mean KL can hide a few extreme tokens")
    rw = _vals(metrics, "reward/mean")
    if len(rw) < 4:
        return Symptom("stable, then sudden collapse", False, "needs >= 4 steps with reward/mean", check)
    k = max(1, len(rw) // 3)
    peak, late = max(rw[:-k]), sum(rw[-k:]) / k
    ev = f"reward peak {peak:.3f} before the last third, late mean {late:.3f}"
    for key, what in (("ratio_max", "max ratio"), ("logkappa_abs_max", "max |log kappa|"), ("grad_norm", "max grad norm")):
        if v := _vals(metrics, key):
            ev += f"; {what} {max(v):.3g}"
    flagged = peak >= COLLAPSE_MIN_PEAK and late < COLLAPSE_FRACTION * peak
    return Symptom("stable, then sudden collapse", flagged, ev, check)


def async_inefficiency(metrics: Sequence[dict[str, Any]]) -> Symptom:
    """Stale samples or many rejected tokens: throughput may be bought with sample efficiency."""
    check = ("check checkpoint age, the direct ratio, accepted fraction, the queue's preference for short "
             "trajectories and capability gained per generated token")
    lag, acc = _vals(metrics, "lag/mean"), _vals(metrics, "staleness/accepted_token_frac")
    if not lag and not acc:
        return Symptom("async: throughput up, efficiency down", False, "no lag/mean or accepted-fraction metric", check)
    lag_m = sum(lag) / len(lag) if lag else 0.0
    acc_m = sum(acc) / len(acc) if acc else 1.0
    ev = f"mean policy lag {lag_m:.2f} steps; mean accepted token fraction {acc_m:.2f}"
    return Symptom("async: throughput up, efficiency down", lag_m > LAG_MEAN or acc_m < ACCEPTED_FRAC, ev, check)


def all_symptoms(metrics: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[Symptom]:
    """The six rules, in the table's order: reward up / held-out down, entropy collapse, loss often
    zero, length drift, late collapse, async inefficiency."""
    return [reward_up_heldout_down(metrics), entropy_collapse(metrics), loss_often_zero(metrics, rows),
            length_drift(metrics, rows), late_collapse(metrics), async_inefficiency(metrics)]
