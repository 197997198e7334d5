"""``posttrain bench memory``: each path's update runs in its own process and reports its peak RSS
(no timing or memory figure is asserted: only that it runs, covers what was asked and reports)."""

import json

from posttrain.cli import main


def test_bench_memory_reports_every_path(tmp_path, capsys):
    out = tmp_path / "memory.json"
    rc = main(["bench", "memory", "--json", str(out), "--recipes", "grpo", "--tokens", "40", "--prompt-tokens", "6",
               "--new-tokens", "4", "--threads", "1", "--rss-limit-gb", "64", "--paths", "full,chunked,full+ckpt,chunked+ckpt"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [(m["path"], m["tokens"], m["rows"]) for m in res["results"]] == [
        ("full", 40, 4), ("chunked", 40, 4), ("full+ckpt", 40, 4), ("chunked+ckpt", 40, 4)]
    for m in res["results"]:
        assert m["recipe"] == "grpo" and m["model"] == "builtin:tiny" and not m["over_limit"]
        assert 0 < m["rss_before_update_bytes"] <= m["peak_rss_bytes"]
    assert "peak RSS GiB" in capsys.readouterr().out


def test_bench_memory_child_over_its_limit_stops_and_is_reported(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--json", str(out), "--recipes", "grpo", "--tokens", "40", "--paths", "chunked",
                 "--prompt-tokens", "6", "--new-tokens", "4", "--threads", "1", "--rss-limit-gb", "0.01"]) == 0
    (m,) = json.loads(out.read_text())["results"]
    assert m["over_limit"] and m["rss_limit_bytes"] == int(0.01 * 1024**3)
    assert "> 0.01" in capsys.readouterr().out


def test_bench_memory_rejects_bad_arguments(capsys):
    assert main(["bench", "memory", "--paths", "fast"]) != 0
    assert "--paths from full, chunked, full+ckpt, chunked+ckpt" in capsys.readouterr().err


def test_bench_memory_batch_tokens_splits_one_update_into_micro_batches(tmp_path):
    """--batch-tokens 80 at --tokens 40 (rows of 10 tokens): 8 rows per update in micro-batches of 4; --updates 3
    times three updates and reports the median of the last two as the steady time."""
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--json", str(out), "--recipes", "grpo", "--tokens", "40", "--paths", "chunked",
                 "--prompt-tokens", "6", "--new-tokens", "4", "--threads", "1", "--rss-limit-gb", "64",
                 "--batch-tokens", "80", "--updates", "3"]) == 0
    res = json.loads(out.read_text())
    (m,) = res["results"]
    assert (m["tokens"], m["rows"], m["batch_tokens"]) == (40, 8, 80)
    assert len(m["update_s_runs"]) == 3 and m["update_s"] == m["update_s_runs"][0]
    assert sorted(m["update_s_runs"][1:])[0] <= m["steady_update_s"] <= sorted(m["update_s_runs"][1:])[1]
    assert res["batch_tokens"] == 80 and res["updates"] == 3


def test_bench_memory_refuses_a_batch_smaller_than_its_micro_batch(capsys):
    assert main(["bench", "memory", "--recipes", "grpo", "--tokens", "40", "--batch-tokens", "20"]) != 0
    assert "--batch-tokens >= every --tokens" in capsys.readouterr().err
