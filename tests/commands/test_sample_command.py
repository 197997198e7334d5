"""``posttrain sample`` (posttrain/commands/sample.py): a tiny pass writes its ledger, sft.jsonl and summary.json and
prints the summary; a non-empty --out is refused in one line unless --resume or --force; bad counts are one line;
Ctrl-C ends with 130 and one line naming the --resume command, which then writes what an uninterrupted pass writes;
a resume asked another recipe, --k or --prompts, or with --force, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import posttrain.loop.rejection_sampling as rs
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
    assert err == (f"posttrain sample: error: --out {out} exists and is not empty; continue its pass with --resume, "
                   "start over with --force, or choose a new directory\n")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert main([*args, "--force"]) == 0  # the earlier pass's files replaced, not appended to
    assert Ledger(out / "ledger").steps() == [1, 2] and len(Ledger(out / "ledger").read_trajectories()) == 9


def test_sample_bad_counts_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "grpo", *TINY, "--k", "0", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == "posttrain sample: error: --k must be >= 1, got 0\n"
    assert not (tmp_path / "x").exists()


def _pass(out: Path) -> tuple[str, list[tuple[Any, ...]], dict[str, Any]]:
    """What a pass wrote, less its wall time, resume count and directory: sft.jsonl, the ledger's samples, the
    summary."""
    trajs = Ledger(out / "ledger").read_trajectories()
    summary = json.loads((out / "summary.json").read_text())
    for key in ("wall_s", "resumed_after_step"):
        summary.pop(key)
    summary["command"] = summary["command"].replace(str(out), "OUT")
    return ((out / "sft.jsonl").read_text(), [(t.traj_id, t.prompt_id, t.token_ids.tolist(), t.status, t.meta["kept"],
                                               t.meta["response"]) for t in trajs], summary)


def test_ctrl_c_then_resume_writes_the_uninterrupted_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def args(out: Path, *extra: str) -> list[str]:
        return ["sample", "grpo", *TINY, "--k", "4", "--prompts", "5", "--keep-per-prompt", "2", "--out", str(out),
                "--no-progress", *extra]

    assert main(args(tmp_path / "straight")) == 0
    real, calls = rs.play_once, []

    def ctrl_c_in_step_2(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(rs, "play_once", ctrl_c_in_step_2)
    out = tmp_path / "rs"
    capsys.readouterr()
    assert main(args(out)) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"posttrain sample: interrupted; the steps in {out / 'ledger'} are kept, continue with: "
                          "posttrain sample grpo ") and err.endswith(f"--out {out} --resume\n") and err.count("\n") == 1
    assert Ledger(out / "ledger").steps("metrics") == [1] and not (out / "summary.json").exists()
    monkeypatch.setattr(rs, "play_once", real)
    assert main(args(out)) == 2  # a non-empty --out without --resume: refused, nothing touched
    assert "continue its pass with --resume" in capsys.readouterr().err
    assert main(args(out, "--resume")) == 0
    assert json.loads(capsys.readouterr().out)["resumed_after_step"] == 1
    assert _pass(out) == _pass(tmp_path / "straight")
    assert main(args(out, "--resume")) == 0  # a finished pass: every step read back, the same files again
    assert json.loads(capsys.readouterr().out)["resumed_after_step"] == 3 and _pass(out) == _pass(tmp_path / "straight")


SAME = ["--k", "4", "--prompts", "4"]


@pytest.mark.parametrize(("change", "needle"), [
    (["sampling.temperature=0.5", *SAME], "was sampled with another recipe (sampling.temperature: 1.0 -> 0.5); "
                                          "resume with that pass's recipe and overrides, or pass --force to start over"),
    (["--k", "3", "--prompts", "4"], "was sampled with --k 4, this command has --k 3; resume with the same --k, or "
                                     "pass --force to start over"),
    (["--k", "4", "--prompts", "3"], "--prompts 3 draws 1 prompts at step 2, the ledger of --out"),
    (["--k", "4", "--prompts", "1"], "holds 2 sampled steps, --prompts 1 draws 1; resume with --prompts 4"),
    ([*SAME, "--force"], "--resume and --force contradict"),
], ids=["recipe", "k", "prompts_redraw", "prompts_fewer", "force"])
def test_a_resume_asked_otherwise_is_one_line_and_touches_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  change: list[str], needle: str) -> None:
    out = tmp_path / "rs"
    base = ["sample", "grpo", *TINY, "sampling.temperature=1.0", "--keep-per-prompt", "2", "--out", str(out),
            "--no-progress"]
    assert main([*base, *SAME]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*base, *change, "--resume"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_extends_a_pass_whose_last_step_was_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def args(out: Path, prompts: int, *extra: str) -> list[str]:
        return ["sample", "grpo", *TINY, "--k", "2", "--prompts", str(prompts), "--out", str(out), "--no-progress",
                *extra]

    assert main(args(tmp_path / "straight", 6)) == 0
    assert main(args(tmp_path / "rs", 4)) == 0
    assert main(args(tmp_path / "rs", 6, "--resume")) == 0
    assert json.loads(capsys.readouterr().out.split("\n}\n")[-2] + "\n}")["resumed_after_step"] == 2
    assert _pass(tmp_path / "rs") == _pass(tmp_path / "straight")
