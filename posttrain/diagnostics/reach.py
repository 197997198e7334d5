"""Where on a run's budget curve an evaluation happened: the one held at a budget, the first to reach a target.

A run's :class:`~posttrain.diagnostics.budget.Curve` lists its held-out evaluations with the
generated tokens and wall-clock seconds spent before each. *Tokens to reach* a target is the budget
of the first evaluation whose metric is at or above it (the cost of the cheapest policy the run
held that met it; nothing is interpolated between evaluations). The teacher of a distillation run
has a recorded held-out accuracy when it is a checkpoint of a posttrain run: that run's metrics at
the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.diagnostics.budget import Curve, index_at


def step_at(curve: Curve, budget: float) -> int | None:
    """Step of the last evaluation with at most ``budget`` generated tokens: the one whose accuracy
    :func:`~posttrain.diagnostics.budget.accuracy_at` returns; ``None`` when the run never spent
    ``budget`` or has no evaluation within it."""
    i = index_at(curve, budget)
    return None if i is None else curve.steps[i]


def metric_by_step(metrics: Sequence[Mapping[str, Any]], key: str) -> dict[int, float]:
    """``{step: value}`` of the finite numeric values of ``key`` in a run's metric rows."""
    out: dict[int, float] = {}
    for m in metrics:
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[int(m["step"])] = float(v)
    return out


@dataclasses.dataclass(frozen=True)
class Reach:
    """The first evaluation of a run at or above a target: its step, value and the budget spent before it."""

    step: int
    value: float
    tokens: float
    seconds: float


def first_reach(curve: Curve, values: Mapping[int, float], target: float) -> Reach | None:
    """The first of ``curve``'s evaluations (in step order) whose ``values[step] >= target``, with the
    generated tokens and seconds the curve records for it; ``None`` if none does. Steps of ``values``
    that are not evaluations of the curve (no ``heldout/accuracy`` there) are not considered."""
    for step, tok, sec in zip(curve.steps, curve.tokens, curve.seconds, strict=True):
        v = values.get(step)
        if v is not None and v >= target:
            return Reach(step, v, tok, sec)
    return None


def teacher_metric(teacher: str, key: str) -> tuple[float, str] | None:
    """``(value, where)`` of metric ``key`` recorded for a distillation teacher, or ``None``.

    Recorded means: ``teacher`` is a checkpoint's ``actor/`` directory,
    ``RUN/checkpoints/step_N/actor`` with the checkpoint's ``meta.json``, and ``RUN/metrics.jsonl``
    has ``key`` at step ``N`` (the run's evaluation of that checkpoint). ``where`` names that row.
    A ``builtin:`` teacher, a Hugging Face directory or a step without that evaluation -> ``None``.
    """
    from posttrain.diagnostics.load import read_metrics

    actor = Path(teacher)
    meta = actor.parent / "meta.json"
    if actor.name != "actor" or actor.parent.parent.name != "checkpoints" or not meta.is_file():
        return None
    try:
        step = int(json.loads(meta.read_text())["step"])
    except (ValueError, KeyError, TypeError):
        return None
    run_dir = actor.parent.parent.parent
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    value = metric_by_step(read_metrics(run_dir), key).get(step)
    return None if value is None else (value, f"{run_dir}/metrics.jsonl, step {step}")
