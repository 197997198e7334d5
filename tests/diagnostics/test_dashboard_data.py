"""The run dashboard of ``posttrain view`` without a browser: runs and their status, curves (live, torn lines,
downsampling), symptoms at their step, the HTTP endpoints and the command's one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.diagnostics.dashboard_compare import compare_doc
from posttrain.diagnostics.dashboard_data import MAX_POINTS, TOKENS_PER_S, RunData, lttb
from posttrain.diagnostics.runs import find_runs, lock_held, run_id, run_status
from posttrain.diagnostics.viewer_server import make_dashboard
from tests.diagnostics.synthetic import CONFIG, rl_metrics, write_outcomes, write_run

ROOT = Path(__file__).resolve().parents[2]


def append(run: Path, text: str) -> None:
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(text)


def test_curves_of_a_finished_run_hold_every_logged_point_and_only_logged_series(tmp_path: Path) -> None:
    rows = rl_metrics(20, eval_every=5)
    rows[10].update(revision="rejected", revision_reason="held-out 0.450 < best 0.460")
    run = write_run(tmp_path / "run", metrics=rows, config={**CONFIG, "steps": 20})
    write_outcomes(run, rows, n_problems=50)
    doc = RunData(run).curves()
    ids = [p["id"] for p in doc["panels"]]
    assert ids == [
        "reward",
        "heldout",
        "kl",
        "entropy",
        "clip",
        "ratio",
        "logkappa",
        "length",
        "staleness",
        "loss",
        "throughput",
        "time",
    ]
    assert len(doc["series"]["reward/mean"]["y"]) == 20 and doc["series"]["reward/mean"]["step"][0] == 1
    assert doc["series"]["heldout/accuracy"]["step"] == [0, 5, 10, 15, 20]
    assert [t["key"] for t in doc["panels"][1]["traces"]] == ["heldout/accuracy", "heldout_sampled/accuracy"]
    # tokens and wall time are cumulative (640 tokens, 1.6 s per step); tokens/s derived per step
    assert doc["series"]["reward/mean"]["tokens"][:3] == [640.0, 1280.0, 1920.0]
    assert doc["series"]["reward/mean"]["wall"][1] == pytest.approx(3.2)
    assert doc["series"][TOKENS_PER_S]["y"][0] == pytest.approx(400.0)
    # the held-out band is the report's bootstrap interval of each evaluation
    band = doc["bands"]["heldout/accuracy"]
    assert band["step"] == [0, 5, 10, 15, 20] and all(
        lo <= hi for lo, hi in zip(band["low"], band["high"], strict=True)
    )
    assert band["low"][0] < 0.3 < band["high"][0]
    assert "adv/zero_group_frac" in doc["other_keys"] and "reward/mean" not in doc["other_keys"]
    assert doc["rejected"] == [
        {
            "step": 10,
            "tokens": 6400.0,
            "wall": pytest.approx(16.0),
            "y": pytest.approx(0.45),
            "reason": "held-out 0.450 < best 0.460",
        }
    ]
    # the SFT warm-up's losses: a panel of their own, x = SFT step
    (run / "sft_losses.json").write_text(json.dumps([4.5, 4.0, 3.0]))
    doc = RunData(run).curves()
    assert doc["panels"][-1]["id"] == "sft" and doc["series"]["sft/loss"] == {
        "step": [1, 2, 3],
        "tokens": [1, 2, 3],
        "wall": [1, 2, 3],
        "y": [4.5, 4.0, 3.0],
    }
    # a reward-model run shows its own metrics: pair accuracy, no RL panels
    rm = write_run(
        tmp_path / "rm",
        metrics=[
            {"step": 0, "heldout/pair_accuracy": 0.4},
            {"step": 1, "loss": 0.7, "pair_accuracy": 0.5, "margin": 0.1, "step_seconds": 0.5},
            {"step": 2, "loss": 0.6, "pair_accuracy": 0.75, "margin": 0.2, "step_seconds": 0.5},
        ],
        trajectories={},
    )
    d = RunData(rm).curves()
    assert [p["id"] for p in d["panels"]] == ["reward", "heldout", "loss", "time"]
    assert d["axes"] == {"step": True, "tokens": False, "wall": True}
    assert RunData(rm).summary("rm")["heldout"]["key"] == "heldout/pair_accuracy"


def test_live_append_torn_line_and_rewritten_step(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", metrics=rl_metrics(4))
    data = RunData(run)
    doc = data.curves()
    gen, last = doc["gen"], doc["last_step"]
    assert last == 4 and len(doc["series"]["reward/mean"]["y"]) == 4
    # nothing new: an empty increment
    inc = data.curves(after=last, gen=gen)
    assert inc["reset"] is False and inc["series"]["reward/mean"]["y"] == []
    # a torn line (no newline yet) is not read; once complete it is, as one new point
    line = json.dumps({"step": 5, "reward/mean": 0.9, "entropy": 0.8})
    append(run, line[:20])
    inc = data.curves(after=last, gen=gen)
    assert inc["last_step"] == 4 and inc["series"]["reward/mean"]["y"] == [] and inc["skipped_lines"] == 0
    append(run, line[20:] + "\n")
    inc = data.curves(after=last, gen=gen)
    assert inc["last_step"] == 5 and inc["series"]["reward/mean"] == {
        "step": [5],
        "tokens": [2560.0],
        "wall": [pytest.approx(6.4)],
        "y": [0.9],
    }
    # a broken complete line is skipped and counted, never a failure
    append(run, "{not json\n")
    assert data.curves(after=5, gen=gen)["skipped_lines"] == 1
    # a step logged again (a resumed run): the page is told to reload (new gen, complete series)
    append(run, json.dumps({"step": 3, "reward/mean": 0.0}) + "\n")
    inc = data.curves(after=5, gen=gen)
    assert inc["reset"] is True and inc["gen"] != gen and inc["series"]["reward/mean"]["y"][2] == 0.0
    # the file replaced by a shorter one: read again from the start
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    doc = data.curves()
    assert doc["last_step"] == 1 and doc["series"]["reward/mean"]["y"] == [0.5]


def test_long_runs_are_downsampled_keeping_real_points(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", metrics=rl_metrics(2000, eval_every=20))
    s = RunData(run).curves()["series"]["clip_frac_high"]
    assert len(s["y"]) == MAX_POINTS and s["step"][0] == 1 and s["step"][-1] == 2000
    assert s["step"] == sorted(s["step"])
    occurred = {0.02 + 0.001 * k for k in range(4)}
    assert set(s["y"]) <= occurred and min(s["y"]) == min(occurred) and max(s["y"]) == max(occurred)
    assert lttb(3, [0, 1, 2, 3, 4], [0, 5, 0, 0, 0]) == [0, 1, 4]
    assert lttb(10, [0, 1], [1, 2]) == [0, 1]


def test_symptoms_are_the_reports_with_the_step_they_first_flag(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", metrics=rl_metrics(30, entropy_collapse_at=16))
    by_name = {s["name"]: s for s in RunData(run).symptoms()}
    ent = by_name["entropy collapse"]
    assert ent["flagged"] and "entropy" in ent["evidence"] and "temperature" in ent["check"]
    assert 16 <= ent["step"] <= 22 and ent["tokens"] == 640.0 * ent["step"]
    assert not by_name["loss often zero"]["flagged"] and by_name["loss often zero"]["step"] is None
    healthy = write_run(tmp_path / "ok", metrics=rl_metrics(30))
    assert not any(s["flagged"] for s in RunData(healthy).symptoms())


def test_run_status_from_the_run_dir(tmp_path: Path) -> None:
    cfg = {**CONFIG, "steps": 4}
    done = write_run(tmp_path / "done", metrics=rl_metrics(4), config=cfg)
    assert run_status(done, RunData(done).rows(), cfg)[0] == "finished"
    early = write_run(tmp_path / "early", metrics=rl_metrics(2), config=cfg)
    assert run_status(early, RunData(early).rows(), cfg)[0] == "failed"
    (early / "checkpoints" / "step_000002").mkdir(parents=True)
    assert run_status(early, RunData(early).rows(), cfg)[0] == "failed"  # torn checkpoint: no meta.json
    (early / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    status, why = run_status(early, RunData(early).rows(), cfg)
    assert status == "stopped" and "resume=true" in why and "step 2" in why
    guard = write_run(
        tmp_path / "guard", metrics=[*rl_metrics(2), {"step": 2, "stopped": "truncation 0.9"}], config=cfg
    )
    assert run_status(guard, RunData(guard).rows(), cfg) == (
        "stopped",
        "stopped by a guard at step 2: truncation 0.9",
    )
    moved = write_run(done / "failed_20261206-010203", metrics=rl_metrics(1), config=cfg)
    assert run_status(moved, [], cfg)[0] == "failed"
    fd = os.open(early / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lock_held(early) and run_status(early, RunData(early).rows(), cfg)[0] == "running"
    finally:
        os.close(fd)
    assert not lock_held(early)


def test_find_runs(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "sweep" / "seed1")
    failed = write_run(a / "failed_20261206-000000")
    (tmp_path / "notes").mkdir()
    assert find_runs(tmp_path) == [a, failed, b]
    assert find_runs(a) == [a, failed]
    assert [run_id(tmp_path, p) for p in find_runs(tmp_path)] == [
        "a",
        "a/failed_20261206-000000",
        "sweep/seed1",
    ]
    assert run_id(a, a) == "@"
    with pytest.raises(FileNotFoundError, match="not a run directory and no run below it"):
        find_runs(tmp_path / "notes")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        find_runs(tmp_path / "nope")


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    rows = rl_metrics(10)
    run = write_run(tmp_path / "runs" / "a", metrics=rows)
    write_outcomes(run, rows)
    write_run(tmp_path / "runs" / "grp" / "b")
    srv = make_dashboard(tmp_path / "runs", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", run
    finally:
        srv.shutdown()
        srv.server_close()


def get(url: str) -> tuple[int, str, Any]:
    try:
        with urllib.request.urlopen(url) as r:
            body = r.read()
            ctype = r.headers.get("Content-Type", "")
            return r.status, ctype, json.loads(body) if "json" in ctype else body
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), json.loads(e.read())


def test_http_endpoints(dashboard: tuple[str, Path]) -> None:
    base, run = dashboard
    code, ctype, runs = get(base + "/api/runs")
    assert code == 200 and [r["id"] for r in runs["runs"]] == ["a", "grp/b"]
    assert (
        runs["runs"][0]["heldout"]["key"] == "heldout/accuracy"
        and runs["runs"][0]["heldout"]["low"] is not None
    )
    assert get(base + "/")[1].startswith("text/html") and get(base + "/run/a/")[1].startswith("text/html")
    code, _, doc = get(base + "/run/a/api/curves")
    assert code == 200 and doc["last_step"] == 10 and doc["has_ledger"] is True
    code, _, doc = get(base + f"/run/a/api/curves?after=10&gen={doc['gen']}&keys=adv/zero_group_frac")
    assert doc["reset"] is False and doc["series"]["adv/zero_group_frac"]["y"] == []
    assert get(base + "/run/grp%2Fb/api/summary")[2]["id"] == "grp/b"
    assert get(base + "/run/a/api/config")[2]["axes"]["credit"].startswith("grpo")
    assert get(base + "/run/a/api/checkpoints")[2]["decisions"][0] == {
        "step": 0,
        "decision": "promoted",
        "reason": "",
        "heldout": 0.3,
    }
    assert "entropy collapse" in {s["name"] for s in get(base + "/run/a/api/symptoms")[2]["symptoms"]}
    assert get(base + "/run/a/traj/api/steps")[2]["steps"][0]["n"] == 4
    code, ctype, js = get(base + "/static/plotly.min.js")
    assert code == 200 and ctype.startswith("text/javascript") and b"plotly.js" in js[:200]
    # bad input: one-line JSON errors, never a traceback page
    assert get(base + "/run/a/api/curves?after=x") == (
        400,
        "application/json",
        {"error": "query parameter after='x' is not an integer"},
    )
    code, _, err = get(base + "/run/nope/api/curves")
    assert code == 404 and "no run 'nope'" in err["error"]
    code, _, err = get(base + "/run/a/traj/api/step?step=7")
    assert code == 404 and "step 7" in err["error"]
    assert get(base + "/favicon.ico")[0] == 204
    # a ledger file mid-write (not yet a complete Parquet file) is left out, not an error
    (run / "ledger" / "trajectories" / "step_000005.parquet").write_bytes(b"PAR1 torn")
    assert [s["step"] for s in get(base + "/run/a/traj/api/steps")[2]["steps"]] == [1]
    assert get(base + "/run/a/api/symptoms")[0] == 200
    assert get(base + "/../../etc/passwd")[0] == 404


def test_compare_at_an_equal_token_budget_with_the_paired_interval(tmp_path: Path) -> None:
    a_rows, b_rows = rl_metrics(20, eval_every=5), rl_metrics(30, eval_every=5, heldout_gain=0.6)
    a = write_run(tmp_path / "a", metrics=a_rows)
    b = write_run(tmp_path / "b", metrics=b_rows, config={**CONFIG, "optim": {"lr": 0.01}})
    write_outcomes(a, a_rows, n_problems=100)
    write_outcomes(b, b_rows, n_problems=100)
    doc = compare_doc([("a", a, RunData(a).rows()), ("b", b, RunData(b).rows())])
    assert doc["budget_tokens"] == 20 * 640.0  # a's total: b is held at the same budget
    assert [(r["id"], r["step"]) for r in doc["runs"]] == [("a", 20), ("b", 20)]
    assert doc["runs"][0]["accuracy"] == pytest.approx(0.6) and doc["runs"][1]["accuracy"] == pytest.approx(
        0.7
    )
    d = doc["runs"][1]["difference"]
    assert d["estimate"] == pytest.approx(0.1) and 0 < d["low"] <= 0.1 <= d["high"] and d["n"] == 100
    assert doc["blocking"] == [] and doc["config_differences"] == {"optim.lr": {"a": 0.001, "b": 0.01}}
    with pytest.raises(ValueError, match="two or more runs"):
        compare_doc([("a", a, [])])


def test_compare_groups_seed_folders_into_recipes(tmp_path: Path) -> None:
    runs = []
    for rec, gains in (("recA", (0.3, 0.36)), ("recB", (0.42, 0.54))):
        for seed, gain in enumerate(gains):
            rows = rl_metrics(10, eval_every=5, heldout_gain=gain)
            run = write_run(tmp_path / rec / f"seed{seed}", metrics=rows, config={**CONFIG, "seed": seed})
            write_outcomes(run, rows, n_problems=50)
            runs.append((f"{rec}/seed{seed}", run, RunData(run).rows()))
    doc = compare_doc(runs)
    a, b = doc["runs"]
    assert (a["id"], a["runs"], a["seeds"], b["id"]) == ("recA", ["recA/seed0", "recA/seed1"], [0, 1], "recB")
    assert a["accuracies"] == {0: pytest.approx(0.6), 1: pytest.approx(0.66)} and a[
        "accuracy"
    ] == pytest.approx(0.63)
    assert b["accuracy"] == pytest.approx(0.78) and b["steps"] == [10, 10]
    # the paired bootstrap pools both seed pairs by prompt id; the t-interval is over the two seed differences
    assert b["difference"]["seeds"] == 2 and b["difference"]["n"] == 50
    assert b["difference"]["estimate"] == pytest.approx(0.15) and b["difference"]["low"] > 0
    assert b["t_interval"]["method"] == "paired t over 2 seeds" and b["t_interval"]["mean"] == pytest.approx(
        0.15
    )
    # two seeds of one recipe alone: each run is its own row
    assert [r["id"] for r in compare_doc(runs[:2])["runs"]] == ["recA/seed0", "recA/seed1"]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "view", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_command_bad_input_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    p = _cli(str(tmp_path / "empty"))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "not a run directory and no run below it" in p.stderr and str(tmp_path / "empty") in p.stderr
    run = write_run(tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = _cli(str(run), "--port", str(port))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in p.stderr and "--port" in p.stderr


def test_command_without_plotly_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from posttrain.commands import view
    from posttrain.diagnostics import viewer_server

    monkeypatch.setattr(viewer_server, "plotly_js", lambda: None)
    args = argparse.Namespace(
        run_dir=str(write_run(tmp_path / "run")), port=0, verifier=None, verifier_kwargs=None
    )
    with pytest.raises(ValueError, match=r"plotly, which is not installed: pip install 'posttrain\[plot\]'"):
        view.run(args)


def test_a_real_run_shows_every_step_it_logged(tmp_path: Path) -> None:
    """Not only synthetic files: a micro GRPO run trained here (4 steps, held-out at steps 0, 2 and 4) gives
    one reward point per step, the held-out points it evaluated with their bands, and the finished status."""
    from posttrain.cli import main
    from posttrain.diagnostics.runs import find_runs, run_status

    run = tmp_path / "runs" / "micro"
    assert main(["train", "grpo", "model.path=builtin:micro", "sft.steps=0", "steps=4", "eval.every=2",
                 "eval.size=8", "sampling.prompts_per_step=4", "sampling.group_size=4", "sampling.max_new_tokens=4",
                 "guards.max_truncation_rate=1.0", "logging.progress=false", f"run_dir={run}"]) == 0
    data = RunData(run)
    doc = data.curves()
    assert doc["series"]["reward/mean"]["step"] == [1, 2, 3, 4]
    assert doc["series"]["heldout/accuracy"]["step"] == [0, 2, 4]
    assert len(doc["series"]["reward/mean"]["tokens"]) == 4 and doc["series"]["reward/mean"]["tokens"][-1] > 0
    from posttrain.diagnostics.fairness import read_config

    assert run_status(run, data.rows(), read_config(run))[0] == "finished"
    assert [p.name for p in find_runs(tmp_path / "runs")] == ["micro"]
