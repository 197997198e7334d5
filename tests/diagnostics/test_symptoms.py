"""The failure-symptom rules on hand-made metric series."""

from __future__ import annotations

from typing import Any

from posttrain.diagnostics.symptoms import (
    async_inefficiency,
    early_late,
    entropy_collapse,
    late_collapse,
    length_drift,
    loss_often_zero,
    reward_up_heldout_down,
)


def series(**cols: list[Any]) -> list[dict[str, Any]]:
    """Rows step 1..n from equal-length columns (``None`` = key absent that step)."""
    n = len(next(iter(cols.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in cols.items() if v[i] is not None}} for i in range(n)]


def test_early_late_thirds() -> None:
    assert early_late([1, 2, 3, 4, 5, 6]) == (1.5, 5.5)  # thirds of 6 are 2 values each
    assert early_late([1, 3]) == (1, 3)
    assert early_late([1]) is None


def test_reward_up_heldout_down() -> None:
    m = series(**{"reward/mean": [0.1, 0.2, 0.5], "heldout/accuracy": [0.6, None, 0.5]})
    s = reward_up_heldout_down(m)
    assert s.flagged
    assert "0.100 -> 0.500" in s.evidence and "0.600 (step 1) -> 0.500 (step 3)" in s.evidence
    assert "verifier coverage" in s.check
    ok = series(**{"reward/mean": [0.1, 0.2, 0.5], "heldout/accuracy": [0.6, None, 0.7]})
    assert not reward_up_heldout_down(ok).flagged
    assert "needs" in reward_up_heldout_down(series(**{"reward/mean": [0.1, 0.5]})).evidence


def test_entropy_collapse() -> None:
    assert entropy_collapse(series(entropy=[2.0, 1.5, 0.9])).flagged  # late 0.9 < half of early 2.0
    assert not entropy_collapse(series(entropy=[2.0, 1.5, 1.1])).flagged


def test_loss_often_zero_uses_ledger_groups() -> None:
    m = series(loss=[0.0, 4e-9, 0.3], **{"adv/zero_group_frac": [1.0, 1.0, 0.5]})
    rows = [{"step": 1, "group_id": "g1", "group_success": 1.0}, {"step": 1, "group_id": "g2", "group_success": 0.0},
            {"step": 1, "group_id": "g3", "group_success": 0.0}, {"step": 1, "group_id": "g4", "group_success": 0.5}]
    s = loss_often_zero(m, rows)
    assert s.flagged
    assert "|loss| < 1e-06 in 2/3 steps" in s.evidence
    assert "25% all pass, 50% all fail (of 4)" in s.evidence
    assert not loss_often_zero(series(loss=[0.1, 0.0, 0.2]), []).flagged


def test_length_drift() -> None:
    s = length_drift(series(**{"length/mean": [10.0, 11.0, 13.0]}), [])
    assert s.flagged and "+30%" in s.evidence  # 10 -> 13
    assert not length_drift(series(**{"length/mean": [10.0, 11.0, 12.0]}), []).flagged  # +20%


def test_late_collapse() -> None:
    s = late_collapse(series(**{"reward/mean": [0.2, 0.6, 0.5, 0.2], "ratio_max": [1.1, 1.2, 3.0, 9.0]}))
    assert s.flagged  # peak 0.6 before the last value, late 0.2 < 0.3
    assert "max ratio 9" in s.evidence
    assert not late_collapse(series(**{"reward/mean": [0.2, 0.6, 0.5, 0.4]})).flagged


def test_async_inefficiency() -> None:
    s = async_inefficiency(series(**{"lag/mean": [1.0, 1.0], "staleness/accepted_token_frac": [0.8, 0.9]}))
    assert s.flagged and "lag 1.00" in s.evidence and "fraction 0.85" in s.evidence
    assert not async_inefficiency(series(**{"lag/mean": [0.0, 0.0]})).flagged
