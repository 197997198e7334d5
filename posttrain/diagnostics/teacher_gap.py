"""Per-trajectory teacher log-prob gap of an on-policy distillation run, read from its ledger.

A ``loss.distill`` run records the teacher's log-probs of each sampled token beside the old policy's
(ledger column ``teacher_logprob``). A trajectory's gap is the mean over its action tokens of
``log pi_old - log pi_teacher``: the per-token reverse-KL estimate the update trained on (Agarwal et
al. 2024, GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM, arXiv:2306.08543). The rows feed
:func:`~posttrain.diagnostics.strata.teacher_gap_strata`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.diagnostics.load import open_ledger, read_step_table, summarize_row


def teacher_gap_mean(row: Mapping[str, Any]) -> float | None:
    """Mean of ``old_logprob - teacher_logprob`` over the action tokens of a ledger row; None when the row has
    no teacher or no old log-probs, or no action token."""
    old, teacher = row.get("old_logprob"), row.get("teacher_logprob")
    mask = np.asarray(row["action_mask"], dtype=bool)
    if old is None or teacher is None or not mask.any():
        return None
    d = np.asarray(old, dtype=np.float64)[mask] - np.asarray(teacher, dtype=np.float64)[mask]
    return float(d.mean())


def teacher_gap_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """One :func:`~posttrain.diagnostics.load.summarize_row` dict per ledger trajectory of ``run_dir``, with
    ``teacher_gap_mean`` (:func:`teacher_gap_mean`) added."""
    led = open_ledger(run_dir)
    rows: list[dict[str, Any]] = []
    for s in led.steps():
        table = read_step_table(led, s)
        for r in [] if table is None else table.to_pylist():
            rows.append({**summarize_row(s, r), "teacher_gap_mean": teacher_gap_mean(r)})
    return rows
