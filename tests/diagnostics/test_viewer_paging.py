"""Paging of the trajectory viewer (issue 40: a 100k-trajectory ledger stays fast). JSON and HTTP only;
the "more groups" control in a real browser is in test_viewer_browser.py."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.diagnostics.viewer_data import Filters, list_steps, step_groups, trajectory_detail
from posttrain.diagnostics.viewer_server import make_server
from tests.diagnostics.synthetic import write_big_ledger


def _get(url: str) -> tuple[int, dict, int]:
    """Status, JSON body and body size in bytes."""
    try:
        with urllib.request.urlopen(url) as r:
            body = r.read()
            return r.status, json.loads(body), len(body)
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body), len(body)


@pytest.fixture
def serve() -> Iterator[object]:
    servers = []

    def start(run: Path) -> str:
        srv = make_server(run, 0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_first_page_of_a_100k_trajectory_step(tmp_path: Path, serve: object) -> None:
    t0 = time.perf_counter()
    run = write_big_ledger(tmp_path / "run", steps=1, per_step=100_000, group_size=8)
    gen_s = time.perf_counter() - t0
    base = serve(run)  # type: ignore[operator]

    t0 = time.perf_counter()
    code, page, size = _get(base + "/api/step?step=1&limit=50")
    first_s = time.perf_counter() - t0
    assert code == 200
    assert page["total"] == 100_000 and page["shown"] == 100_000 and page["groups_total"] == 12_500
    assert len(page["groups"]) == 50 and page["offset"] == 0 and page["next_offset"] == 50
    assert all(len(g["trajectories"]) == 8 and g["n"] == 8 for g in page["groups"])
    assert page["groups"][0]["trajectories"][0]["advantage"] == 1.0  # the stored per-token advantage

    # the default page, a later page, a filtered page (filters count before paging) and one trajectory
    assert len(_get(base + "/api/step?step=1")[1]["groups"]) == 50
    last = _get(base + "/api/step?step=1&offset=12490&limit=50")[1]
    assert [g["group_id"] for g in last["groups"]][-1] == "s1-g12499" and last["next_offset"] is None
    t0 = time.perf_counter()
    wrong = _get(base + "/api/step?step=1&status=wrong&lag_min=1&limit=20")[1]
    filtered_s = time.perf_counter() - t0
    # odd index -> wrong, lag = index % 3
    assert wrong["shown"] == sum(1 for i in range(100_000) if i % 2 and i % 3) and wrong["groups_total"] == 12_500 and len(wrong["groups"]) == 20
    t0 = time.perf_counter()
    detail = _get(base + "/api/traj?step=1&id=s1-t99999")[1]
    detail_s = time.perf_counter() - t0
    assert detail["summary"]["advantage"] == -1.0 and detail["summary"]["advantage_source"] == "ledger"

    t0 = time.perf_counter()
    code, steps, steps_size = _get(base + "/api/steps")
    steps_s = time.perf_counter() - t0
    assert code == 200 and steps["steps"] == [{"step": 1, "n": 100_000, "reward_mean": 0.5,
                                              "status": {"correct": 50_000, "wrong": 50_000}}]
    print(f"\n100k-trajectory ledger: written in {gen_s:.2f} s; first page (50 groups, {size} bytes) "
          f"{first_s:.3f} s; filtered page {filtered_s:.3f} s; one trajectory {detail_s:.3f} s; "
          f"/api/steps ({steps_size} bytes) {steps_s:.3f} s")
    assert first_s < 10 and size < 200_000  # sanity bounds only, never a tight timing


def test_steps_list_of_many_steps_stays_small(tmp_path: Path) -> None:
    run = write_big_ledger(tmp_path / "run", steps=2000, per_step=8, group_size=4)
    t0 = time.perf_counter()
    steps = list_steps(run)
    took = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = list_steps(run)  # unchanged files are not read again
    took_again = time.perf_counter() - t0
    size = len(json.dumps(steps))
    print(f"\nlist_steps of 2,000 steps: {took:.2f} s, then {took_again:.2f} s (unchanged files), "
          f"{size} bytes of JSON")
    assert again == steps and [s["step"] for s in steps] == list(range(1, 2001)) and steps[0]["n"] == 8
    assert steps[0]["status"] == {"correct": 4, "wrong": 4} and steps[0]["reward_mean"] == 0.5
    assert size < 200 * 2000 and took < 60


@pytest.mark.parametrize("query", [{}, {"status": "correct"}, {"lag_min": "2"}, {"reward_max": "0.5", "len_min": "2"}])
def test_offsets_walk_every_group_once(tmp_path: Path, query: dict[str, str]) -> None:
    run = write_big_ledger(tmp_path / "run", steps=1, per_step=203, group_size=4)  # 51 groups, the last of 3
    f = Filters.from_query(query)
    everything = step_groups(run, 1, f)
    assert everything["next_offset"] is None and everything["limit"] is None
    seen: list[str] = []
    traj: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = step_groups(run, 1, f, offset, 7)
        assert len(page["groups"]) <= 7 and page["groups_total"] == everything["groups_total"]
        assert page["shown"] == everything["shown"] and page["total"] == 203
        seen += [g["group_id"] for g in page["groups"]]
        traj += [t["traj_id"] for g in page["groups"] for t in g["trajectories"]]
        offset = page["next_offset"]
    assert len(seen) == len(set(seen)) == everything["groups_total"]
    assert seen == [g["group_id"] for g in everything["groups"]]
    assert len(traj) == len(set(traj)) == everything["shown"]
    assert everything["groups"] and all(Filters.from_query(query).keep(t) for g in everything["groups"]
                                        for t in g["trajectories"])


def test_paging_of_the_small_run_matches_the_detail(tmp_path: Path, serve: object) -> None:
    run = write_big_ledger(tmp_path / "run", steps=1, per_step=10, group_size=4)
    base = serve(run)  # type: ignore[operator]
    assert _get(base + "/api/step?step=1&limit=0")[0] == 400
    assert _get(base + "/api/step?step=1&limit=1001")[0] == 400
    assert _get(base + "/api/step?step=1&offset=-1")[0] == 400
    assert _get(base + "/api/step?step=1&offset=x")[0] == 400
    beyond = _get(base + "/api/step?step=1&offset=99")[1]
    assert beyond["groups"] == [] and beyond["next_offset"] is None and beyond["groups_total"] == 3
    page = _get(base + "/api/step?step=1&limit=2")[1]
    for g in page["groups"]:
        for t in g["trajectories"]:
            d = trajectory_detail(run, 1, t["traj_id"], str)["summary"]
            assert (d["status"], d["reward"], d["length"], d["lag"], d["advantage"]) == (
                t["status"], t["reward"], t["length"], t["lag"], t["advantage"])
