"""``posttrain sample`` (posttrain/commands/sample.py): a tiny pass writes its ledger, sft.jsonl and summary.json and
prints the summary; a non-empty --out is refused in one line unless --force; bad counts are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.trajectory import Ledger

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "sampling.prompts_per_step=2",
        "sampling.max_new_tokens=4", "eval.size=10", "logging.progress=false"]


def test_sample_writes_the_pass_and_refuses_a_non_empty_out(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rs"
    args = ["sample", "grpo", *TINY, "--k", "3", "--prompts", "3", "--keep-per-prompt", "1", "--out", str(out)]
    assert main(args) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out)
    assert (summary["prompts"], summary["samples"], summary["k"]) == (3, 9, 3)
    assert sum(summary["statuses"].values()) == 9 and summary["kept"] <= summary["statuses"]["correct"]
    assert summary["command"].startswith("posttrain sample grpo model.path=builtin:micro")
    assert "step 2/2: 9 sampled" in cap.err
    assert json.loads((out / "summary.json").read_text()) == summary
    assert len((out / "sft.jsonl").read_text().splitlines()) == summary["kept"]
    assert Ledger(out / "ledger").steps() == [1, 2]
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(args) == 2  # refused: nothing overwritten, one line
    err = capsys.readouterr().err
    assert err == f"posttrain sample: error: --out {out} exists and is not empty; choose a new directory or pass --force\n"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert main([*args, "--force"]) == 0  # the earlier pass's files replaced, not appended to
    assert Ledger(out / "ledger").steps() == [1, 2] and len(Ledger(out / "ledger").read_trajectories()) == 9


def test_sample_bad_counts_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "grpo", *TINY, "--k", "0", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == "posttrain sample: error: --k must be >= 1, got 0\n"
    assert not (tmp_path / "x").exists()
