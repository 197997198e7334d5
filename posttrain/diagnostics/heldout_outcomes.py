"""A run's per-problem held-out outcomes: ``RUN/heldout_outcomes.jsonl``, written at each evaluation.

One JSON line per evaluated set and step: ``{"step", "set", "accuracy", "prompt_ids", "valid",
"correct"}``. ``set`` is the metric prefix of that evaluation (``heldout`` greedy,
``heldout_sampled``, ``heldout_unseen``, ``heldout_unseen_sampled``, ``heldout_notool`` ...: the
``<set>/accuracy`` row of ``metrics.jsonl`` is its accuracy); ``valid[i]`` / ``correct[i]`` are problem
``prompt_ids[i]``'s judged samples (infra errors left out) and its correct ones, one entry per distinct
problem (a held-out set that repeats a problem sums its repeats: :meth:`SetOutcomes.per_problem`; a file
written before that is merged when read). Lines are appended and
flushed one by one, so a crash loses at most the line being written; a resumed run that redoes a step
appends that step again and the reader keeps the last line per ``(set, step)``. From these the report
computes bootstrap intervals (:mod:`posttrain.diagnostics.intervals`) after the run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

OUTCOMES_FILE = "heldout_outcomes.jsonl"
"""File name of the per-problem outcomes inside a run directory."""


@dataclasses.dataclass(frozen=True)
class SetOutcomes:
    """Per-problem outcomes of one held-out set at one evaluation (same order as ``prompt_ids``)."""

    prompt_ids: tuple[str, ...]
    valid: tuple[int, ...]
    correct: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.prompt_ids) == len(self.valid) == len(self.correct):
            raise ValueError(f"SetOutcomes: {len(self.prompt_ids)} prompt ids, {len(self.valid)} valid and "
                             f"{len(self.correct)} correct counts (one of each per problem)")

    @property
    def accuracy(self) -> float:
        """``sum(correct) / sum(valid)`` (the evaluation's accuracy); NaN when nothing was judged."""
        n = sum(self.valid)
        return sum(self.correct) / n if n else float("nan")

    def per_problem(self) -> SetOutcomes:
        """One entry per distinct prompt id (first-seen order), its repeats' ``valid`` and ``correct`` summed.

        A task with fewer distinct held-out problems than ``eval.size`` repeats some (``sample_unique``; a
        file task cycles its rows): a problem is one unit of the bootstrap however often it was evaluated,
        as ``posttrain compare`` pools it. :attr:`accuracy` is unchanged."""
        if len(set(self.prompt_ids)) == len(self.prompt_ids):
            return self
        sums: dict[str, list[int]] = {}
        for pid, v, c in zip(self.prompt_ids, self.valid, self.correct, strict=True):
            acc = sums.setdefault(pid, [0, 0])
            acc[0] += v
            acc[1] += c
        return SetOutcomes(tuple(sums), tuple(v for v, _ in sums.values()), tuple(c for _, c in sums.values()))


def append_outcomes(run_dir: Path, step: int, sets: Mapping[str, SetOutcomes]) -> Path:
    """Append one line per set of ``sets`` (``{set name: outcomes}``) for ``step``; returns the file's path."""
    path = Path(run_dir) / OUTCOMES_FILE
    with open(path, "a") as fh:
        for name, o in sets.items():
            acc = o.accuracy
            fh.write(json.dumps({"step": step, "set": name, "accuracy": acc if acc == acc else None,
                                 "prompt_ids": list(o.prompt_ids), "valid": list(o.valid),
                                 "correct": list(o.correct)}) + "\n")
            fh.flush()
    return path


def read_outcomes(run_dir: Path) -> dict[str, dict[int, SetOutcomes]]:
    """``{set: {step: SetOutcomes}}`` of ``run_dir``'s :data:`OUTCOMES_FILE`; ``{}`` when there is none.

    A line that does not parse or lacks a field (the torn last line of a killed run) is skipped; a
    ``(set, step)`` written twice (a resumed run) keeps its last line.
    """
    path = Path(run_dir) / OUTCOMES_FILE
    out: dict[str, dict[int, SetOutcomes]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            o = SetOutcomes(tuple(str(p) for p in row["prompt_ids"]), tuple(int(v) for v in row["valid"]),
                            tuple(int(c) for c in row["correct"])).per_problem()  # a file written with repeats
            out.setdefault(str(row["set"]), {})[int(row["step"])] = o
        except (ValueError, KeyError, TypeError):
            continue
    return out
