"""``posttrain bench async --quick``: the CLI smoke test (figures are never asserted as timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_bench_async_quick_writes_speedup_per_mode(tmp_path):
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "bench", "async", "--quick", "--steps", "2", "--sft-steps", "5",
                        "--json", str(out)], capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["speedup_vs_sync"]) == {"sync", "one_step_off", "async", "partial"}
    assert res["speedup_vs_sync"]["sync"] == 1.0
    for r in res["modes"]:
        assert r["steps"] == 2 and r["generated_tokens"] > 0 and 0 <= r["group_idle_frac"] < 1
        assert sum(r["lag_hist"].values()) == r["samples_trained"]
    lag = {r["mode"]: r["lag_hist"] for r in res["modes"]}
    assert lag["sync"]["1"] == 0 and lag["one_step_off"]["1"] > 0  # the modes really differ
    assert "| mode | tokens/s |" in p.stdout and "(5 SFT steps" in p.stdout
    split = {r["mode"]: r["threads_per_side"] for r in res["modes"]}
    assert split["sync"]["concurrent"] is False and split["async"]["concurrent"] is True
