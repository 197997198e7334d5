"""Per-trajectory summaries and strata on a hand-built ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.diagnostics.load import load_summaries, read_metrics
from posttrain.diagnostics.strata import all_strata, length_edges, length_label, log_bin_label, success_label
from posttrain.diagnostics.trends import pearson, reward_length_corr
from tests.diagnostics.synthetic import write_run


def test_summaries_hand_computed(tmp_path: Path) -> None:
    rows = {r["traj_id"]: r for r in load_summaries(write_run(tmp_path))}
    assert rows["a"]["abs_log_kappa_mean"] == pytest.approx(0.125)  # |0| and |-0.25| over two actions
    assert rows["a"]["abs_log_kappa_max"] == pytest.approx(0.25)
    assert rows["a"]["surprisal_mean"] == pytest.approx(0.75)  # -(-0.5 - 1.0) / 2
    assert rows["b"]["abs_log_kappa_mean"] == pytest.approx(5e-4)
    assert rows["c"]["abs_log_kappa_mean"] == pytest.approx(0.005)
    assert rows["d"]["abs_log_kappa_mean"] is None  # no old log-probs frozen
    assert rows["a"]["abs_log_rho_mean"] is None  # the ledger holds no current log-probs
    assert rows["a"]["group_success"] == 0.5 and rows["c"]["group_success"] == 0.0
    assert [rows[k]["length"] for k in "abcd"] == [2, 1, 4, 3]


def test_bin_labels() -> None:
    assert log_bin_label(0.0) == "<1e-03"
    assert log_bin_label(5e-3) == "1e-03-1e-02"
    assert log_bin_label(0.1) == ">=1e-01"
    assert success_label(0.0) == "0 (all fail)" and success_label(1.0) == "1 (all pass)"
    assert success_label(0.25) == "(0, 0.5)" and success_label(0.5) == "[0.5, 1)"
    assert length_edges([1, 2, 3, 4]) == [1, 2, 3]  # percentiles 1.75, 2.5, 3.25 rounded down
    assert [length_label(n, [1, 2, 3]) for n in (1, 2, 3, 4)] == ["<=1", "2..2", "3..3", ">3"]


def test_all_strata(tmp_path: Path) -> None:
    tables = {t.feature.split(" (")[0]: t for t in all_strata(load_summaries(write_run(tmp_path)))}
    lag = {s.label: s for s in tables["policy lag"].strata}
    assert list(lag) == ["0", "1", "3+"]
    assert lag["0"].n == 2 and lag["0"].accuracy == 0.5 and lag["0"].reward_mean == 0.5
    kappa = {s.label: s.n for s in tables["|log kappa|"].strata}
    assert kappa == {"<1e-03": 1, "1e-03-1e-02": 1, ">=1e-01": 1}  # b, c, a; d has no old log-probs
    assert tables["|log rho|"].strata == [] and "no current-policy log-probs" in tables["|log rho|"].note
    success = {s.label: s.n for s in tables["group success rate"].strata}
    assert success == {"0 (all fail)": 2, "[0.5, 1)": 2}
    assert {s.label: s.n for s in tables["status"].strata} == {"correct": 1, "wrong": 3}


def test_reward_length_correlation(tmp_path: Path) -> None:
    # lengths 2,1,4,3 with rewards 1,0,0,0: centred x = (-.5,-1.5,1.5,.5), y = (.75,-.25,-.25,-.25)
    # sum xy = -0.375 + 0.375 - 0.375 - 0.125 = -0.5; sum x^2 = 5, sum y^2 = 0.75
    corr = reward_length_corr(load_summaries(write_run(tmp_path)))
    assert corr[1] == pytest.approx(-0.5 / (5 * 0.75) ** 0.5)
    assert pearson([1, 1], [0, 1]) is None and pearson([1], [2]) is None


def test_metrics_skip_torn_line(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "reward/me')  # a writer caught mid-line
    assert [m["step"] for m in read_metrics(run)] == [0, 1]


def test_no_ledger_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_summaries(tmp_path)
