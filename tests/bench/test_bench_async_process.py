"""``posttrain bench async --process in_process,server``: every mode with the engine in the trainer's process
and in its own server process, side by side, with the speed-up model's prediction (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(600)
def test_bench_async_runs_each_mode_in_thread_and_in_a_server_process(tmp_path):
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "bench", "async", "--quick", "--steps", "2",
                        "--sft-steps", "3", "--modes", "sync,one_step_off", "--process", "in_process,server", "--repeats", "2",
                        "--workdir", str(tmp_path / "w"), "--json", str(out)],
                       capture_output=True, text=True, timeout=590)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["label"]: r for r in res["modes"]}
    assert list(rows) == ["sync", "sync/server", "one_step_off", "one_step_off/server"]
    assert rows["one_step_off/server"]["threads_per_side"]["rollout_in"] == "process"
    assert rows["one_step_off"]["threads_per_side"]["rollout_in"] == "thread"
    # each server run had its own engine process, which logged its start
    assert "LISTENING" in (tmp_path / "w" / "one_step_off-server-engine" / "engine_server.log").read_text()
    for mode in ("sync", "one_step_off"):  # the same schedule, sample for sample, wherever the engine runs
        a, b = rows[mode], rows[f"{mode}/server"]
        assert a["lag_hist"] == b["lag_hist"] and a["generated_tokens"] == b["generated_tokens"] > 0
        assert a["heldout_acc_after"] == b["heldout_acc_after"]
    assert res["speedup_vs_sync"]["sync/server"] == 1.0 and res["speedup_vs_in_process_sync"]["sync"] == 1.0
    for r in rows.values():  # two rounds; the reported figure is their median (the mean of two)
        assert len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s_runs"]) / 2)
    # the model: sync predicts exactly 1; one_step_off a figure within its bound; a table at scale per process
    assert rows["sync/server"]["model"]["speedup"] == pytest.approx(1.0)
    m = rows["one_step_off/server"]["model"]
    assert m["max_staleness"] == 1 and 1.0 <= m["speedup"] <= m["bound"] + 1e-9
    assert set(res["model_at_scale"]) == {"in_process", "server"}
    assert "| one_step_off/server |" in p.stdout and "| rollout workers | eta 1 |" in p.stdout


def test_bench_async_refuses_an_unknown_process():
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "bench", "async", "--quick", "--process", "ray"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--process" in p.stderr
