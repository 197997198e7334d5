"""``posttrain bench vs-trl --seeds 0,1,2``: the comparison once per seed, and what the seeds say together.

Each seed is one whole ``bench vs-trl`` run: its own SFT start, prompts and sampling on both sides. The held-out
problems are drawn once for every seed (``eval.heldout_seed``: the first seed unless the overrides give it), so
the seeds compare like with like. What the summary reports:

- ``heldout_accuracy_diff``: posttrain - TRL held-out accuracy after RL, pooled over the seeds, with the paired
  percentile bootstrap over problems (Efron & Tibshirani 1993, ch. 13): each problem is one unit, its judged and
  correct samples summed over the seeds on each side
  (:func:`~posttrain.diagnostics.outcome_difference.paired_difference`). It says how far the difference could move
  with another draw of problems at these seeds;
- ``heldout_accuracy_diff_over_seeds``: the mean of the per-seed differences with the paired Student-t 95%
  interval over seeds (:func:`~posttrain.diagnostics.budget.difference`), how far it could move with other seeds;
- ``speedup_vs_trl``: TRL's mean steady step time over posttrain's, each averaged over the seeds (per seed too).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import TypedDict

from posttrain.diagnostics.budget import difference
from posttrain.diagnostics.heldout_outcomes import SetOutcomes
from posttrain.diagnostics.outcome_difference import paired_difference
from posttrain.errors import UserError


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (``--seeds``): distinct non-negative integers, at least one; anything else is
    refused naming the item (:class:`argparse.ArgumentTypeError`)."""
    items = [t.strip() for t in text.split(",")]
    seeds: list[int] = []
    for t in items:
        if not t.isdigit():
            raise argparse.ArgumentTypeError(f"--seeds {text!r}: {t!r} is not a non-negative integer")
        if int(t) in seeds:
            raise argparse.ArgumentTypeError(f"--seeds {text!r}: seed {int(t)} is given twice")
        seeds.append(int(t))
    return seeds


def seeded_overrides(overrides: Sequence[str], seeds: Sequence[int],
                     recipe_heldout_seed: int | None = None) -> tuple[list[str], int]:
    """The overrides every seed's run shares and the seed its held-out problems are drawn with.

    ``seed=`` among the overrides is refused (``--seeds`` sets it per run: it could not take effect);
    ``eval.heldout_seed=N`` is kept and used; else the recipe's own ``eval.heldout_seed`` (``recipe_heldout_seed``)
    when it fixes one; else ``eval.heldout_seed=<first seed>`` is added."""
    if any(o.strip().startswith("seed=") for o in overrides):
        raise UserError("bench vs-trl: a seed= override cannot take effect with --seeds (each run's seed is one of "
                        "--seeds); drop it")
    given = [o for o in overrides if o.strip().startswith("eval.heldout_seed=")]
    if given:
        value = given[-1].split("=", 1)[1].strip()
        if not value.isdigit():
            raise UserError(f"bench vs-trl --seeds: {given[-1]!r}: the held-out problems need a fixed seed (an integer)")
        return list(overrides), int(value)
    if recipe_heldout_seed is not None:
        return list(overrides), recipe_heldout_seed
    return [*overrides, f"eval.heldout_seed={seeds[0]}"], seeds[0]


class SeedRow(TypedDict):
    """One seed's figures in the summary (NaN where a side did not run)."""

    seed: int
    sft_heldout_accuracy: float
    posttrain_heldout_accuracy: float
    trl_heldout_accuracy: float
    heldout_accuracy_diff: float
    posttrain_step_s: float
    trl_step_s: float
    speedup_vs_trl: float


class PooledDifference(TypedDict):
    """posttrain - TRL pooled over seeds with its paired bootstrap interval over ``n_problems`` problems."""

    estimate: float
    low: float
    high: float
    n_problems: int
    level: float


class SeedDifference(TypedDict):
    """The mean per-seed posttrain - TRL difference with its interval over seeds (``None`` bounds: no interval)."""

    mean: float
    low: float | None
    high: float | None
    seeds: int
    method: str


class SeedsSummary(TypedDict):
    """The ``summary`` object of ``bench vs-trl --seeds`` (:func:`summarize`)."""

    seeds: list[int]
    heldout_seed: int
    per_seed: list[SeedRow]
    heldout_accuracy_diff: PooledDifference | None
    heldout_accuracy_diff_over_seeds: SeedDifference | None
    posttrain_step_s_mean: float
    trl_step_s_mean: float
    speedup_vs_trl: float


@dataclasses.dataclass(frozen=True)
class SideFigures:
    """What the summary reads of one side of one seed's run: held-out accuracy after RL, the mean steady step time
    and the per-problem outcomes behind that accuracy."""

    heldout_accuracy: float
    step_s_mean: float
    outcomes: SetOutcomes


@dataclasses.dataclass(frozen=True)
class SeedResult:
    """One seed's run: its SFT start's held-out accuracy and each side's figures (``None``: that side did not run)."""

    seed: int
    sft_heldout_accuracy: float
    posttrain: SideFigures | None
    trl: SideFigures | None


_NAN = float("nan")


def summarize(heldout_seed: int, results: Sequence[SeedResult]) -> SeedsSummary:
    """The per-seed rows of ``results`` and what they say together: the pooled paired-bootstrap difference over
    problems, the paired t-interval over seeds, the step-time ratio.

    The pooled difference is over the seeds where both sides ran (``None`` when none did)."""
    rows: list[SeedRow] = []
    pairs: list[tuple[SetOutcomes, SetOutcomes]] = []
    pt_acc: dict[int, float] = {}
    trl_acc: dict[int, float] = {}
    for r in results:
        p, t = r.posttrain, r.trl
        pa, ps = (p.heldout_accuracy, p.step_s_mean) if p else (_NAN, _NAN)
        ta, ts = (t.heldout_accuracy, t.step_s_mean) if t else (_NAN, _NAN)
        rows.append({"seed": r.seed, "sft_heldout_accuracy": r.sft_heldout_accuracy,
                     "posttrain_heldout_accuracy": pa, "trl_heldout_accuracy": ta, "heldout_accuracy_diff": pa - ta,
                     "posttrain_step_s": ps, "trl_step_s": ts, "speedup_vs_trl": ts / ps if ps else _NAN})
        if p is not None and t is not None:
            pairs.append((t.outcomes, p.outcomes))
            pt_acc[r.seed], trl_acc[r.seed] = p.heldout_accuracy, t.heldout_accuracy
    pooled: PooledDifference | None = None
    if pairs:
        iv = paired_difference(pairs)  # (baseline TRL, other posttrain): posttrain - TRL
        pooled = {"estimate": iv.estimate, "low": iv.low, "high": iv.high, "n_problems": iv.n, "level": iv.level}
    d = difference(trl_acc, pt_acc)  # b - a = posttrain - TRL, paired by seed
    over: SeedDifference | None = None
    if d is not None:
        over = {"mean": d.mean, "low": d.low, "high": d.high, "seeds": d.n_a, "method": d.method}
    p_steps = [x["posttrain_step_s"] for x in rows if math.isfinite(x["posttrain_step_s"])]
    t_steps = [x["trl_step_s"] for x in rows if math.isfinite(x["trl_step_s"])]
    p_mean = statistics.fmean(p_steps) if p_steps else float("nan")
    t_mean = statistics.fmean(t_steps) if t_steps else float("nan")
    return {"seeds": [r.seed for r in results], "heldout_seed": heldout_seed, "per_seed": rows, "heldout_accuracy_diff": pooled,
            "heldout_accuracy_diff_over_seeds": over, "posttrain_step_s_mean": p_mean, "trl_step_s_mean": t_mean,
            "speedup_vs_trl": t_mean / p_mean if p_steps and t_steps else float("nan")}


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def seeds_table(summary: SeedsSummary) -> str:
    """The printed per-seed table and the two intervals of ``summary`` (accuracies and differences in points)."""
    lines = [f"held-out problems drawn with seed {summary['heldout_seed']} for every seed",
             f"{'seed':>4}  {'SFT start':>9}  {'posttrain':>9}  {'TRL':>9}  {'pt - TRL':>9}  {'pt s/step':>9}  "
             f"{'TRL s/step':>10}  speed-up"]
    for r in summary["per_seed"]:
        lines.append(f"{r['seed']:>4}  {_f(r['sft_heldout_accuracy'], '.3f'):>9}  "
                     f"{_f(r['posttrain_heldout_accuracy'], '.3f'):>9}  {_f(r['trl_heldout_accuracy'], '.3f'):>9}  "
                     f"{_f(100 * r['heldout_accuracy_diff'], '+.1f'):>9}  {_f(r['posttrain_step_s'], '.3f'):>9}  "
                     f"{_f(r['trl_step_s'], '.3f'):>10}  {_f(r['speedup_vs_trl'], '.2f')}x")
    pooled = summary["heldout_accuracy_diff"]
    if pooled is not None:
        lines.append(f"posttrain - TRL, pooled over seeds: {_f(100 * pooled['estimate'], '+.1f')} points "
                     f"[{_f(100 * pooled['low'], '+.1f')}, {_f(100 * pooled['high'], '+.1f')}] "
                     f"({pooled['level']:.0%} paired bootstrap over {pooled['n_problems']} problems)")
    over = summary["heldout_accuracy_diff_over_seeds"]
    if over is not None:
        bounds = ("no interval" if over["low"] is None or over["high"] is None
                  else f"[{100 * over['low']:+.1f}, {100 * over['high']:+.1f}]")
        lines.append(f"posttrain - TRL, mean over seeds: {100 * over['mean']:+.1f} points {bounds} ({over['method']})")
    lines.append(f"speed-up vs TRL (mean step times over seeds): {_f(summary['speedup_vs_trl'], '.2f')}x")
    return "\n".join(lines)


__all__ = ["PooledDifference", "SeedDifference", "SeedResult", "SeedRow", "SeedsSummary", "SideFigures", "parse_seeds", "seeded_overrides",
           "seeds_table", "summarize"]
