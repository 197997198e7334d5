"""``posttrain compare``'s sections from per-problem outcomes and targets: the paired bootstrap interval of
each recipe's accuracy difference from the baseline per held-out set at the budget, and the generated tokens
and seconds at which each run first reaches a ``--target KEY=VALUE`` (``VALUE`` ``teacher``: the
distillation teacher's recorded figure). docs/diagnostics.md, ``posttrain compare``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.diagnostics.budget import Curve
    from posttrain.diagnostics.heldout_outcomes import SetOutcomes


def parse_target(item: str) -> tuple[str, float | None]:
    """``(key, value)`` of a ``--target KEY=VALUE``; value ``None`` for ``teacher``."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ValueError(f"--target {item}: expected KEY=VALUE, e.g. heldout_unseen/accuracy=0.5 or "
                         "heldout_unseen/accuracy=teacher")
    if value.strip() == "teacher":
        return key.strip(), None
    try:
        target = float(value)
    except ValueError:
        raise ValueError(f"--target {item}: {value!r} is neither a number nor 'teacher'") from None
    if not math.isfinite(target):
        raise ValueError(f"--target {item}: the value must be finite")
    return key.strip(), target


def _outcomes_at(run_dir: Path, curve: Curve, budget: float) -> tuple[int | None, dict[str, SetOutcomes]]:
    """The step a run holds at ``budget`` and the per-problem outcomes it recorded there, by held-out set."""
    from posttrain.diagnostics.heldout_outcomes import read_outcomes
    from posttrain.diagnostics.reach import step_at

    step = step_at(curve, budget)
    if step is None:
        return None, {}
    return step, {name: by_step[step] for name, by_step in read_outcomes(run_dir).items() if step in by_step}


def _run_pairs(base_seeds: list[int], other_seeds: list[int]) -> list[tuple[int, int]]:
    """Indices of the runs to pair: same seed on both sides; one run each and no common seed: those two."""
    common = [s for s in base_seeds if s in other_seeds]
    if common:
        return [(base_seeds.index(s), other_seeds.index(s)) for s in common]
    return [(0, 0)] if len(base_seeds) == len(other_seeds) == 1 else []


def _no_outcomes(base: list[tuple[int | None, dict[str, SetOutcomes]]], other: list[tuple[int | None, dict[str, SetOutcomes]]],
                 pairs: list[tuple[int, int]]) -> str:
    """Why paired runs give no outcomes to compare: a run holds no evaluation at the budget, or none were recorded."""
    if any(base[i][0] is None or other[j][0] is None for i, j in pairs):
        return "a run has no evaluation within the budget"
    return "outcomes not recorded"


def paired_intervals(groups: dict[str, list[Path]], curves: dict[str, list[Curve]], seeds_of: dict[str, list[int]],
                     budget: float) -> dict[str, dict[str, dict[str, Any]]]:
    """Per recipe (baseline excepted) and held-out set: the paired bootstrap interval of its accuracy
    difference from the baseline at ``budget`` (:func:`~posttrain.diagnostics.outcome_difference.paired_difference`:
    problems paired by prompt id, seeds common to both sides pooled), printed and returned as
    ``{label: {set: {estimate, low, high, n, seeds, steps} or {"none": reason}}}``."""
    from posttrain.diagnostics.outcome_difference import paired_difference

    held = {lab: [_outcomes_at(r, c, budget) for r, c in zip(runs, curves[lab], strict=True)]
            for lab, runs in groups.items()}
    base = next(iter(groups))
    print(f"paired bootstrap 95% interval of the accuracy difference at {budget:.0f} generated tokens "
          "(problems paired by prompt id, seeds pooled):")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for lab in list(groups)[1:]:
        pairs = _run_pairs(seeds_of[base], seeds_of[lab])
        sets = sorted({name for _, o in held[base] + held[lab] for name in o})
        res = out[lab] = {}
        if not pairs or not sets:
            why = "no seed common to both sides" if not pairs else _no_outcomes(held[base], held[lab], pairs)
            print(f"  {lab} - {base}: no interval: {why}")
            res["*"] = {"none": why}
            continue
        for name in sets:
            used = [(i, j) for i, j in pairs if name in held[base][i][1] and name in held[lab][j][1]]
            if not used:
                why = _no_outcomes(held[base], held[lab], pairs)
                print(f"  {lab} - {base}, {name}: no interval: {why}")
                res[name] = {"none": why}
                continue
            iv = paired_difference([(held[base][i][1][name], held[lab][j][1][name]) for i, j in used])
            seeds = [seeds_of[base][i] for i, _ in used]
            steps = {base: [held[base][i][0] for i, _ in used], lab: [held[lab][j][0] for _, j in used]}
            if iv.n == 0:
                print(f"  {lab} - {base}, {name}: no interval: no problem judged on both sides")
                res[name] = {"none": "no problem judged on both sides"}
                continue
            print(f"  {lab} - {base}, {name}: {iv.estimate:+.3f}, 95% CI [{iv.low:+.3f}, {iv.high:+.3f}] "
                  f"({iv.n} problems, seeds {seeds}, steps {base} {steps[base]} / {lab} {steps[lab]})")
            res[name] = {**dataclasses.asdict(iv), "seeds": seeds, "steps": steps}
    return out


def _teacher_target(groups: dict[str, list[Path]], key: str) -> tuple[float, str] | str:
    """``(value, where)`` of the runs' distillation teacher's recorded ``key``, or why there is none."""
    from posttrain.config.paths import resolve_shipped_path
    from posttrain.diagnostics.fairness import read_config
    from posttrain.diagnostics.reach import teacher_metric

    teachers = {t for runs in groups.values() for r in runs
                if (t := ((read_config(r).get("loss") or {}).get("distill") or {}).get("teacher"))}
    if len(teachers) != 1:
        return ("no run distills from a teacher (loss.distill.teacher)" if not teachers
                else f"the runs distill from different teachers ({', '.join(sorted(teachers))})")
    teacher = next(iter(teachers))
    found = teacher_metric(str(resolve_shipped_path(teacher)), key)
    return found if found is not None else (f"{key} of teacher {teacher} not recorded (a checkpoint's actor/ of a "
                                            "run whose metrics.jsonl evaluated that step)")


def tokens_to_reach(groups: dict[str, list[Path]], curves: dict[str, list[Curve]], seeds_of: dict[str, list[int]],
                    targets: list[str]) -> dict[str, dict[str, Any]]:
    """For each ``--target KEY=VALUE``: per recipe and seed, the first evaluation with ``KEY >= VALUE``
    (:func:`~posttrain.diagnostics.reach.first_reach`) and the generated tokens and seconds spent before it;
    printed and returned as ``{KEY=VALUE: {"target", "source", "runs": {label: {seed: Reach or None}}}}``."""
    from posttrain.diagnostics.load import read_metrics
    from posttrain.diagnostics.reach import first_reach, metric_by_step

    out: dict[str, dict[str, Any]] = {}
    for item in targets:
        key, value = parse_target(item)
        source = "--target"
        if value is None:
            found = _teacher_target(groups, key)
            if isinstance(found, str):
                print(f"tokens to reach {key} = teacher: no target: {found}")
                out[item] = {"target": None, "source": found, "runs": {}}
                continue
            value, source = found[0], f"the teacher's, {found[1]}"
        print(f"tokens to reach {key} >= {value:.3f} ({source}):")
        runs: dict[str, dict[str, Any]] = {}
        for lab, paths in groups.items():
            got = {s: first_reach(c, metric_by_step(read_metrics(r), key), value)
                   for s, r, c in zip(seeds_of[lab], paths, curves[lab], strict=True)}
            runs[lab] = {str(s): dataclasses.asdict(x) if x else None for s, x in got.items()}
            hit = {s: x for s, x in got.items() if x is not None}
            per_seed = "; ".join(f"seed {s}: " + (f"{x.tokens:.0f} tokens, {x.seconds:.0f} s (step {x.step}, "
                                                  f"{x.value:.3f})" if x else "not reached") for s, x in got.items())
            mean = (f"mean {sum(x.tokens for x in hit.values()) / len(hit):.0f} tokens, "
                    f"{sum(x.seconds for x in hit.values()) / len(hit):.0f} s over those; " if hit else "")
            print(f"  {lab}: {len(hit)} of {len(got)} seeds reached it; {mean}{per_seed}")
        out[item] = {"target": value, "source": source, "runs": runs}
    return out

