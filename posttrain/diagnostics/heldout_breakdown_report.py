"""The held-out breakdown of a run's report: per constraint family and tool calls per episode, first -> last.

Reads the evaluations' ``<set>/ifc/<family>`` (instruction following: share of that family's
constraints met) and ``<set>/tool_calls_mean`` (tool environments: tool calls per held-out episode)
from ``metrics.jsonl`` (:func:`posttrain.diagnostics.load.read_metrics`; the training loop logs them,
see ``posttrain/loop/heldout_breakdown.py``) and gives, per key, its first and last logged value.
A run without them (another task, or written before they were logged) has no row.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

_KEY = re.compile(r"^heldout[a-z0-9_]*/(ifc/[^/]+|tool_calls_mean)$")


@dataclasses.dataclass(frozen=True)
class BreakdownRow:
    """One held-out breakdown figure (``key``, e.g. ``heldout_unseen/ifc/no_commas``) at its first and last
    evaluation."""

    key: str
    first_step: int
    first: float
    last_step: int
    last: float


def breakdown_rows(metrics: Sequence[Mapping[str, object]]) -> list[BreakdownRow]:
    """Per breakdown key of ``metrics`` (per-step dicts in step order, each with an int ``step``), its first and
    last numeric value; ordered by held-out set as first logged, then tool calls before the families (by name)."""
    seen: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        step = m.get("step")
        if not isinstance(step, int):
            continue
        for k, v in m.items():
            if _KEY.match(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
                seen.setdefault(k, []).append((step, float(v)))
    sets = list(dict.fromkeys(k.split("/", 1)[0] for k in seen))
    order = sorted(seen, key=lambda k: (sets.index(k.split("/", 1)[0]), not k.endswith("/tool_calls_mean"), k))
    return [BreakdownRow(k, *seen[k][0], *seen[k][-1]) for k in order]
