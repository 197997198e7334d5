"""The teacher log-prob gap stratum of on-policy distillation (posttrain/diagnostics/strata.py)."""

from __future__ import annotations

from posttrain.diagnostics.strata import teacher_gap_label, teacher_gap_strata


def _row(gap: float | None, status: str) -> dict[str, object]:
    return {"teacher_gap_mean": gap, "status": status, "reward": 1.0 if status == "correct" else 0.0,
            "length": 3, "finish": "terminal"}


def test_labels_at_the_edges() -> None:
    assert [teacher_gap_label(x) for x in (-0.5, 0.0, 0.05, 0.1, 0.99, 1.0, 7.0)] == [
        "<0", "0-0.1", "0-0.1", "0.1-1", "0.1-1", ">=1", ">=1"]


def test_rows_by_gap_with_their_accuracy() -> None:
    rows = [_row(-0.2, "correct"), _row(0.05, "correct"), _row(0.5, "wrong"), _row(0.7, "correct"),
            _row(2.0, "wrong"), _row(None, "wrong")]
    table = teacher_gap_strata(rows)
    got = {s.label: (s.n, s.accuracy) for s in table.strata}
    # the row without a teacher log-prob is left out; 0.1-1 holds one correct of two
    assert got == {"<0": (1, 1.0), "0-0.1": (1, 1.0), "0.1-1": (2, 0.5), ">=1": (1, 0.0)}
    assert [s.label for s in table.strata] == ["<0", "0-0.1", "0.1-1", ">=1"]
    empty = teacher_gap_strata([_row(None, "correct")])
    assert empty.strata == [] and "loss.distill is not set" in empty.note
