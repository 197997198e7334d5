"""The accuracy difference of two recipes on the same held-out problems, with its paired bootstrap interval.

``posttrain compare`` holds each run's policy at the compared token budget; the per-problem outcomes
that run recorded at that evaluation (``heldout_outcomes.jsonl``,
:mod:`posttrain.diagnostics.heldout_outcomes`) say which problems it got right. Two runs are paired
**by prompt id** (the problems both evaluated; the rest are left out), and runs of several seeds are
**pooled**: each prompt id is one unit whose judged and correct samples are summed over the seeds
both recipes ran. The interval is :func:`~posttrain.diagnostics.intervals.rise_interval`'s paired
percentile bootstrap (Efron & Tibshirani 1993, ch. 13) of ``acc(other) - acc(baseline)``, so what
both sides share (each problem's difficulty) cancels. It measures how much the difference could
move with another draw of problems at these seeds, not with other training seeds (the Student-t
interval over seeds in ``posttrain compare`` speaks to that).
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.diagnostics.heldout_outcomes import SetOutcomes
from posttrain.diagnostics.intervals import RESAMPLES, Interval, rise_interval


def _sum_by_prompt(o: SetOutcomes, keep: set[str], into: dict[str, list[int]]) -> None:
    for pid, v, c in zip(o.prompt_ids, o.valid, o.correct, strict=True):
        if pid in keep:
            acc = into.setdefault(pid, [0, 0])
            acc[0] += v
            acc[1] += c


def paired_difference(pairs: Sequence[tuple[SetOutcomes, SetOutcomes]], *, resamples: int = RESAMPLES,
                      seed: int = 0) -> Interval:
    """``acc(other) - acc(baseline)`` over ``pairs`` of ``(baseline, other)`` outcomes of one held-out set.

    Within each pair (one seed of each recipe) only the prompt ids both evaluated count; over pairs,
    each prompt id's ``valid`` and ``correct`` are summed per side, so a prompt is one unit of the
    bootstrap however many seeds evaluated it. The estimate is the pooled accuracy difference
    (``sum(correct) / sum(valid)`` per side) and the interval is the paired bootstrap of
    :func:`~posttrain.diagnostics.intervals.rise_interval` (``baseline`` first); same inputs -> same
    interval. No prompt judged on both sides -> NaN with ``n = 0``.
    """
    base: dict[str, list[int]] = {}
    other: dict[str, list[int]] = {}
    for b, o in pairs:
        common = set(b.prompt_ids) & set(o.prompt_ids)
        _sum_by_prompt(b, common, base)
        _sum_by_prompt(o, common, other)
    ids = sorted(base)
    return rise_interval(([base[i][0] for i in ids], [base[i][1] for i in ids]),
                         ([other[i][0] for i in ids], [other[i][1] for i in ids]), resamples=resamples, seed=seed)
