"""The viewer's JSON documents and HTTP endpoints (no browser: see test_viewer_browser.py)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.diagnostics.second_verifier import disagreements, load_verifier
from posttrain.diagnostics.viewer_data import (
    Filters,
    group_advantages,
    list_steps,
    passed_rows,
    step_groups,
    trajectory_detail,
)
from posttrain.diagnostics.viewer_server import make_server
from tests.diagnostics.synthetic import step1, traj, write_run


def test_group_advantages_by_hand() -> None:
    rows = [{"traj_id": t.traj_id, "group_id": t.group_id, "reward_total": t.reward.total} for t in step1()]
    # g1 rewards (1, 0): mean 0.5, population std 0.5 -> +1, -1; g2 all 0 -> std 0 -> 0
    assert group_advantages(rows) == {"a": 1.0, "b": -1.0, "c": 0.0, "d": 0.0}


def test_filters_and_groups(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    assert step_groups(run, 1, Filters())["shown"] == 4
    wrong = step_groups(run, 1, Filters.from_query({"status": "wrong", "len_min": "3"}))
    assert [t["traj_id"] for g in wrong["groups"] for t in g["trajectories"]] == ["c", "d"]
    lag = step_groups(run, 1, Filters.from_query({"lag_min": "1", "lag_max": "2"}))
    assert [t["traj_id"] for g in lag["groups"] for t in g["trajectories"]] == ["b"]
    rew = step_groups(run, 1, Filters.from_query({"reward_min": "0.5"}))
    assert [g["success_rate"] for g in rew["groups"]] == [0.5]
    with pytest.raises(ValueError, match="lag_min"):
        Filters.from_query({"lag_min": "x"})


def test_trajectory_detail_tokens(tmp_path: Path) -> None:
    d = trajectory_detail(write_run(tmp_path), 1, "a", lambda i: f"t{i}")
    assert [t["text"] for t in d["tokens"]] == ["t1", "t2", "t10", "t11"]
    prompt, _, act0, act1 = d["tokens"]
    assert prompt["behavior"] is None and prompt["log_kappa"] is None  # not a policy action
    assert act1["behavior"] == -1.0 and act1["old"] == -1.25 and act1["log_kappa"] == -0.25
    assert act0["surprisal"] == 0.5 and act0["advantage"] == 1.0 and act0["current"] is None
    assert set(d["fields"]) == {"advantage", "log_kappa", "surprisal"}
    assert set(d["missing_fields"]) == {"log_rho", "ref_kl"}
    with pytest.raises(KeyError, match="zz"):
        trajectory_detail(tmp_path, 1, "zz", str)


def test_still_writing_run_skips_partial_files(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    (run / "ledger" / "trajectories" / "step_000002.parquet.tmp-123").write_bytes(b"PAR1 half")
    (run / "ledger" / "trajectories" / "step_000003.parquet").write_bytes(b"not parquet")
    assert [s["step"] for s in list_steps(run)] == [1]
    with pytest.raises(FileNotFoundError, match="step 3"):
        step_groups(run, 3, Filters())


def test_second_verifier_disagreements(tmp_path: Path) -> None:
    run = write_run(tmp_path, trajectories={1: [traj("p", "g", "correct", 1.0, [-1.0], None, response=" 7 ", reference="7"),
                                                 traj("q", "g", "correct", 1.0, [-1.0], None, response="07", reference="7")]})
    none = disagreements(passed_rows(run), None)
    assert none["items"] == [] and "--verifier" in none["explanation"]
    # integer@1 accepts "07"; an exact-match evaluation verifier does not.
    got = disagreements(passed_rows(run), load_verifier("exact"))
    assert [i["traj_id"] for i in got["items"]] == ["q"] and got["checked"] == 2
    assert got["verifier"] == "exact@1" and got["items"][0]["second_status"] == "wrong"
    with pytest.raises(ValueError, match="verifier-kwargs"):
        load_verifier("exact", "[1]")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    srv = make_server(write_run(tmp_path), 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://{srv.server_address[0]}:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_endpoints(server: str) -> None:
    assert server.startswith("http://127.0.0.1:")
    assert _get(server + "/api/steps")[1]["steps"][0]["n"] == 4
    assert _get(server + "/api/step?step=1&status=correct")[1]["shown"] == 1
    assert _get(server + "/api/traj?step=1&id=a")[1]["summary"]["traj_id"] == "a"
    assert _get(server + "/api/flagged")[1]["items"] == []
    code, err = _get(server + "/api/step?step=x")
    assert code == 400 and "not an integer" in err["error"]
    assert _get(server + "/api/traj?step=1&id=nope")[0] == 404
    with urllib.request.urlopen(server + "/") as r:
        assert b"posttrain view" in r.read()
