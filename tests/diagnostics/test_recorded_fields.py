"""Report and viewer on what the update recorded (issue 15): |log rho| strata from the ledger's
``current_logprob``, the stored per-token advantage, the hidden verifier's verdicts from the
ledger without ``--verifier``, and a ledger written before those columns (absent, with why)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.diagnostics.build import build_report
from posttrain.diagnostics.load import load_summaries
from posttrain.diagnostics.second_verifier import disagreements
from posttrain.diagnostics.strata import all_strata
from posttrain.diagnostics.viewer_data import Filters, passed_rows, step_groups, trajectory_detail
from posttrain.trajectory.ledger import TRAJECTORY_SCHEMA, trajectory_to_row
from tests.diagnostics.synthetic import step1, write_run


def recorded_step() -> list:
    """step1() plus what the update saw: current log-probs, advantages, hidden verdicts.

    a: old (-0.5, -1.25), current (-0.5, -1.0) -> |log rho| 0, 0.25: mean 0.125, bin >=1e-1
    b: old (-2.0005,), current (-2.0,) -> 5e-4, bin <1e-3
    c: old (..., -1.02), current = old -> 0, bin <1e-3; d: no old log-probs -> no rho
    """
    a, b, c, d = step1()
    return [
        a.replace(current_logprob=[0, 0, -0.5, -1.0], advantage=[0, 0, 0.7, 0.7],
                  hidden_verifier="strict@1", hidden_status="wrong", meta={**a.meta, "hidden_explanation": "no"}),
        b.replace(current_logprob=[0, 0, -2.0], advantage=[0, 0, -0.7], hidden_verifier="strict@1",
                  hidden_status="wrong"),
        c.replace(current_logprob=c.old_logprob, advantage=[0, 0, 0.0, 0.0, 0.0, 0.0],
                  hidden_verifier="strict@1", hidden_status="correct"),
        d.replace(advantage=[0, 0, 0.0, 0.0, 0.0]),
    ]


def test_log_rho_strata_from_recorded_current_logprobs(tmp_path: Path) -> None:
    rows = {r["traj_id"]: r for r in load_summaries(write_run(tmp_path, trajectories={1: recorded_step()}))}
    assert rows["a"]["abs_log_rho_mean"] == pytest.approx(0.125) and rows["a"]["abs_log_rho_max"] == pytest.approx(0.25)
    assert rows["b"]["abs_log_rho_mean"] == pytest.approx(5e-4) and rows["c"]["abs_log_rho_mean"] == 0.0
    assert rows["d"]["abs_log_rho_mean"] is None
    tables = {t.feature.split(" (")[0]: t for t in all_strata(list(rows.values()))}
    rho = tables["|log rho|"]
    assert rho.note == "" and {s.label: s.n for s in rho.strata} == {"<1e-03": 2, ">=1e-01": 1}
    assert {s.label: s.accuracy for s in rho.strata} == {"<1e-03": 0.0, ">=1e-01": 1.0}


def test_a_ledger_written_before_current_logprobs_says_why(tmp_path: Path) -> None:
    new = ("current_logprob", "advantage", "hidden_verifier", "hidden_status")
    schema = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name not in new])
    rows = [{k: v for k, v in trajectory_to_row(t).items() if k not in new} for t in step1()]
    run = write_run(tmp_path, trajectories={})
    (run / "ledger" / "trajectories").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), run / "ledger" / "trajectories" / "step_000001.parquet")
    doc = build_report(run)
    rho = next(t for t in doc["strata"] if t["feature"].startswith("|log rho|"))
    assert rho["strata"] == [] and "written before" in rho["note"] and "no current_logprob column" in rho["note"]
    # the column exists but is empty: a different reason
    empty = all_strata(load_summaries(write_run(tmp_path / "empty")))
    assert "column is empty" in next(t for t in empty if t.feature.startswith("|log rho|")).note
    # the viewer falls back to the recomputed group advantage and says so
    d = trajectory_detail(run, 1, "a", str)
    assert d["summary"]["advantage_source"] == "recomputed" and d["tokens"][2]["advantage"] == 1.0
    assert doc["hidden_verifier"]["source"] is None and doc["hidden_verifier"]["items"] == []


def test_viewer_shows_the_stored_advantage_not_a_recomputed_one(tmp_path: Path) -> None:
    run = write_run(tmp_path, trajectories={1: recorded_step()})
    d = trajectory_detail(run, 1, "a", str)
    # recomputed would be +1.0 (group g1 rewards 1, 0); the update used 0.7
    assert d["summary"]["advantage_source"] == "ledger" and d["summary"]["advantage"] == pytest.approx(0.7)
    assert [t["advantage"] for t in d["tokens"]] == [None, None, 0.7, 0.7]
    assert [t["current"] for t in d["tokens"]][2:] == [-0.5, -1.0]
    assert d["tokens"][3]["log_rho"] == pytest.approx(0.25) and "log_rho" in d["fields"]
    advs = {t["traj_id"]: t["advantage"] for g in step_groups(run, 1, Filters())["groups"] for t in g["trajectories"]}
    assert advs == {"a": pytest.approx(0.7), "b": pytest.approx(-0.7), "c": 0.0, "d": 0.0}


def test_hidden_verdicts_listed_from_the_ledger_without_a_verifier(tmp_path: Path) -> None:
    run = write_run(tmp_path, trajectories={1: recorded_step()})
    flagged = disagreements(passed_rows(run), None)
    # only a passed the training verifier; the hidden one said wrong. b failed both: not listed.
    assert flagged["source"] == "ledger" and flagged["verifier"] == "strict@1" and flagged["checked"] == 1
    assert [(i["traj_id"], i["second_status"], i["second_explanation"]) for i in flagged["items"]] == [("a", "wrong", "no")]
    doc = build_report(run)
    assert doc["hidden_verifier"]["items"][0]["traj_id"] == "a"
    html = (run / "diagnostics" / "report.html").read_text()
    assert "failed by the hidden one" in html and "strict@1" in html
