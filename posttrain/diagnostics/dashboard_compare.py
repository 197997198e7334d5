"""The compare page of ``posttrain view``: two or more runs (or recipes of several seeds) at an equal budget.

The budget is the smallest total of generated tokens among the runs (each has spent at least that).
Each run is held at its last held-out evaluation within the budget (:func:`~posttrain.diagnostics.
budget.index_at`, as ``posttrain compare`` does), and every recipe after the first is compared with the
first on the problems both evaluated: the paired bootstrap 95% interval of the accuracy difference
(:func:`~posttrain.diagnostics.outcome_difference.paired_difference`, from ``heldout_outcomes.jsonl``;
seeds paired by seed and pooled), and with several seeds a side the t-interval over seeds.
The identities that ``posttrain compare`` refuses to compare across (base checkpoint, tokenizer /
template, verifier, held-out set) are checked and any difference is named, with the config keys
that differ.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.diagnostics.budget import difference, index_at, run_curve
from posttrain.diagnostics.fairness import blocking_differences, config_differences, identity
from posttrain.diagnostics.heldout_outcomes import SetOutcomes, read_outcomes
from posttrain.diagnostics.outcome_difference import paired_difference
from posttrain.diagnostics.runs import read_config

SEED_DIR = re.compile(r"^seed\d+$")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def recipe_label(rid: str) -> str:
    """The recipe a run belongs to, by ``posttrain compare``'s convention: runs in ``seed<k>/`` folders of
    one directory are the seeds of one recipe, labelled by that directory; any other run is its own."""
    parent, _, base = rid.rpartition("/")
    return parent if parent and SEED_DIR.match(base) else rid


def _run_pairs(base: list[int], other: list[int]) -> list[tuple[int, int]]:
    """Indices of the runs to pair (as ``posttrain compare``): the same seed on both sides; one run each
    and no common seed: those two."""
    common = [s for s in base if s in other]
    if common:
        return [(base.index(s), other.index(s)) for s in common]
    return [(0, 0)] if len(base) == len(other) == 1 else []


def compare_doc(
    runs: Sequence[tuple[str, Path, Sequence[Mapping[str, Any]]]],
    heldout_set: str = "heldout",
    budget: float | None = None,
) -> dict[str, Any]:
    """The compare table of ``runs`` (``(id, run dir, metrics rows)``): a row per recipe, the first the
    baseline.

    Runs are grouped into recipes by :func:`recipe_label` (seeds of one recipe), unless that leaves one group:
    then each run is its own row. ``budget`` defaults to the smallest total of generated tokens among the
    runs. Per recipe: each seed's held-out accuracy at the budget and their mean; per recipe after the first:
    the paired bootstrap 95% interval of the difference from the first (problems paired by prompt id, seeds
    paired by seed and pooled, as ``posttrain compare``) and, with two or more seeds a side, the t-interval
    over seeds (:func:`~posttrain.diagnostics.budget.difference`). Raises ``ValueError`` (one line) with fewer
    than two runs.
    """
    if len(runs) < 2:
        raise ValueError(f"compare needs two or more runs, got {len(runs)}")
    groups: dict[str, list[tuple[str, Path, Sequence[Mapping[str, Any]]]]] = {}
    for r in runs:
        groups.setdefault(recipe_label(r[0]), []).append(r)
    if len(groups) < 2:
        groups = {r[0]: [r] for r in runs}
    curves = {rid: run_curve(rows) for rid, _, rows in runs}
    at = min(c.total_tokens for c in curves.values()) if budget is None else budget
    table: list[dict[str, Any]] = []
    held: dict[str, list[SetOutcomes | None]] = {}
    for label, members in groups.items():
        steps: list[int | None] = []
        accs: dict[int, float] = {}
        seeds: list[int] = []
        held[label] = []
        for rid, path, _ in members:
            c = curves[rid]
            cfg = read_config(path)
            seed = int(cfg.get("seed", 0) or 0)
            seeds.append(seed)
            i = index_at(c, at)
            step = c.steps[i] if i is not None else None
            steps.append(step)
            if i is not None:
                accs[seed] = c.accuracy[i]
            o = read_outcomes(path).get(heldout_set, {}).get(step) if step is not None else None
            held[label].append(o)
        name = read_config(members[0][1]).get("name")
        table.append({"id": label, "name": name, "runs": [m[0] for m in members], "seeds": seeds,
                      "total_tokens": min(curves[m[0]].total_tokens for m in members),
                      "step": steps[0] if len(members) == 1 else None, "steps": steps,
                      "accuracy": sum(accs.values()) / len(accs) if accs else None, "accuracies": accs})
    base = table[0]
    for row in table[1:]:
        pairs = _run_pairs(base["seeds"], row["seeds"])
        used = [(held[base["id"]][i], held[row["id"]][j]) for i, j in pairs]
        usable = [(a, b) for a, b in used if a is not None and b is not None]
        row["difference"] = None
        if not pairs:
            row["difference_why"] = "no seed common to both sides"
        elif len(usable) < len(used):
            row["difference_why"] = (
                "a run has no held-out evaluation within the budget"
                if None in base["steps"] or None in row["steps"]
                else f"no per-problem outcomes ({heldout_set})"
            )
        else:
            iv = paired_difference(usable)
            row["difference"] = {"estimate": _finite(iv.estimate), "low": _finite(iv.low),
                                 "high": _finite(iv.high), "n": iv.n, "seeds": len(usable)}
        d = difference(base["accuracies"], row["accuracies"])
        one_each = len(base["runs"]) < 2 and len(row["runs"]) < 2
        row["t_interval"] = (None if d is None or d.low is None or one_each
                             else {"mean": d.mean, "low": d.low, "high": d.high, "method": d.method})
    ids: dict[str, list[dict[str, str]]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for label, members in groups.items():
        for rid, path, _ in members:
            try:
                ids.setdefault(label, []).append(identity(path))
                configs[rid] = read_config(path)
            except (FileNotFoundError, OSError, ValueError) as e:
                ids.setdefault(label, []).append({"base checkpoint": f"unknown ({e})"})
    try:
        blocking = blocking_differences(ids)
    except KeyError:
        blocking = ["a run has no config.yaml: its identities cannot be checked"]
    return {
        "budget_tokens": at,
        "heldout_set": heldout_set,
        "baseline": base["id"],
        "runs": table,
        "blocking": blocking,
        "config_differences": config_differences(configs) if configs else {},
    }
