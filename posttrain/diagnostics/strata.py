"""Stratified tables: the trajectories of a run split by one feature, summarised per stratum.

The strata are the features along which an off-policy or reward problem concentrates (policy
lag, ratio, length, group success rate, verifier status) plus |log kappa|. Bin edges are fixed (not fitted) so two runs' tables line up,
except response length, whose range depends on the task: quartile edges of the run's own lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posttrain.diagnostics.load import rho_absent_reason

# |log| bins: 1e-3 is float32 recompute noise, 0.1 is ~10% probability mismatch.
LOG_BINS: tuple[float, ...] = (1e-3, 1e-2, 1e-1)


@dataclasses.dataclass(frozen=True)
class Stratum:
    """Summary of the trajectories in one stratum (``None`` where nothing could be computed)."""

    label: str
    n: int
    reward_mean: float | None
    accuracy: float | None
    length_mean: float | None
    truncated_rate: float | None


@dataclasses.dataclass(frozen=True)
class StrataTable:
    """One feature's strata; ``note`` says why a table is empty (e.g. field not in the ledger)."""

    feature: str
    strata: list[Stratum]
    note: str = ""


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def summarise(label: str, rows: Sequence[dict[str, Any]]) -> Stratum:
    """Counts, mean reward (over rows with a reward), accuracy (over scored rows), length, truncation."""
    scored = [r for r in rows if r["status"] not in ("infra_error", "unscored")]
    return Stratum(
        label=label, n=len(rows),
        reward_mean=_mean([r["reward"] for r in rows if r["reward"] is not None]),
        accuracy=_mean([float(r["status"] == "correct") for r in scored]),
        length_mean=_mean([float(r["length"]) for r in rows]),
        truncated_rate=_mean([float(r["finish"] == "truncated") for r in rows]),
    )


def log_bin_label(x: float, edges: Sequence[float] = LOG_BINS) -> str:
    """``"<1e-03"``, ``"1e-03-1e-02"``, ..., ``">=1e-01"`` for a non-negative value."""
    if x < edges[0]:
        return f"<{edges[0]:.0e}"
    for lo, hi in zip(edges, edges[1:], strict=False):
        if x < hi:
            return f"{lo:.0e}-{hi:.0e}"
    return f">={edges[-1]:.0e}"


def lag_label(lag: int) -> str:
    """``"0"``, ``"1"``, ``"2"``, ``"3+"`` (the same buckets as the ``lag/count_*`` metrics)."""
    return str(lag) if lag < 3 else "3+"


def success_label(rate: float) -> str:
    """Group success rate bucket: all wrong, below half, half or more, all correct."""
    if rate == 0:
        return "0 (all fail)"
    if rate == 1:
        return "1 (all pass)"
    return "(0, 0.5)" if rate < 0.5 else "[0.5, 1)"


def length_edges(lengths: Sequence[int]) -> list[int]:
    """Distinct quartile edges (25/50/75th percentile, rounded down) of ``lengths``."""
    if not lengths:
        return []
    qs = np.percentile(np.asarray(lengths, dtype=np.float64), [25, 50, 75])
    return sorted({int(q) for q in qs})


def length_label(n: int, edges: Sequence[int]) -> str:
    """The bin of ``n`` given ascending ``edges``: ``"<=e0"``, ``"e0+1..e1"``, ..., ``">eK"``."""
    lo = None
    for e in edges:
        if n <= e:
            return f"<={e}" if lo is None else f"{lo + 1}..{e}"
        lo = e
    return f">{lo}" if lo is not None else "all"


def stratify(rows: Sequence[dict[str, Any]], feature: str, key: Callable[[dict[str, Any]], str | None],
             order: Sequence[str] | None = None, note_if_empty: str = "") -> StrataTable:
    """Group ``rows`` by ``key`` (rows with key ``None`` are left out) and summarise each group."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    labels = [o for o in order if o in groups] if order else sorted(groups)
    labels += [k for k in sorted(groups) if k not in labels]
    return StrataTable(feature, [summarise(k, groups[k]) for k in labels], "" if groups else note_if_empty)


def _log_order() -> list[str]:
    return [log_bin_label(x) for x in (0.0, *LOG_BINS)]


#: Edges of the teacher log-prob gap strata (mean over a trajectory's action tokens of
#: ``log pi_old - log pi_teacher``, nats): below 0 the student is less sure of its own tokens than the
#: teacher, above 1 the teacher finds them ~e times less likely on average.
TEACHER_GAP_BINS: tuple[float, ...] = (0.0, 0.1, 1.0)


def teacher_gap_label(gap: float, edges: Sequence[float] = TEACHER_GAP_BINS) -> str:
    """``"<0"``, ``"0-0.1"``, ``"0.1-1"``, ``">=1"`` for the teacher log-prob gap of a trajectory."""
    if gap < edges[0]:
        return f"<{edges[0]:g}"
    for lo, hi in zip(edges, edges[1:], strict=False):
        if gap < hi:
            return f"{lo:g}-{hi:g}"
    return f">={edges[-1]:g}"


def teacher_gap_strata(rows: Sequence[dict[str, Any]]) -> StrataTable:
    """On-policy distillation's stratum (``loss.distill``): the trajectories by their teacher log-prob gap
    ``teacher_gap_mean`` (mean over action tokens of ``log pi_old - log pi_teacher``, the per-token
    reverse-KL estimate the update trained on), binned by :data:`TEACHER_GAP_BINS`; empty with a note
    when no row has one (a run without a teacher)."""
    order = [teacher_gap_label(x) for x in (-1.0, *TEACHER_GAP_BINS)]
    return stratify(rows, "teacher log-prob gap (old - teacher, mean over tokens)",
                    lambda r: None if r.get("teacher_gap_mean") is None else teacher_gap_label(r["teacher_gap_mean"]),
                    order, "no trajectory has teacher log-probs (loss.distill is not set)")


def all_strata(rows: Sequence[dict[str, Any]]) -> list[StrataTable]:
    """The six tables of the report, in a fixed order."""
    edges = length_edges([r["length"] for r in rows])
    len_order = [length_label(e, edges) for e in edges] + ([length_label(edges[-1] + 1, edges)] if edges else [])
    return [
        stratify(rows, "policy lag", lambda r: None if r["lag"] is None else lag_label(int(r["lag"])),
                 ["0", "1", "2", "3+"], "no trajectory records a policy lag"),
        stratify(rows, "|log rho| (current vs old, mean over tokens)",
                 lambda r: None if r["abs_log_rho_mean"] is None else log_bin_label(r["abs_log_rho_mean"]),
                 _log_order(), rho_absent_reason(list(rows))),
        stratify(rows, "|log kappa| (old vs behaviour, mean over tokens)",
                 lambda r: None if r["abs_log_kappa_mean"] is None else log_bin_label(r["abs_log_kappa_mean"]),
                 _log_order(), "no trajectory has frozen old log-probs yet"),
        stratify(rows, "response length (tokens)", lambda r: length_label(r["length"], edges), len_order),
        stratify(rows, "group success rate",
                 lambda r: None if r["group_success"] is None else success_label(r["group_success"]),
                 ["0 (all fail)", "(0, 0.5)", "[0.5, 1)", "1 (all pass)"], "no scored groups"),
        stratify(rows, "status", lambda r: r["status"],
                 ["correct", "wrong", "invalid", "timeout", "env_failure", "infra_error", "unscored"]),
    ]
