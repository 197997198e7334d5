"""Expert iteration as the three commands of docs/expert_iteration.md, on the tiny ``micro`` model: ``posttrain sample``
(stage 1), ``posttrain train smollm2_instruction_following_ei_sft`` on its ``sft.jsonl`` (stage 2), and RL from that
run's checkpoint (stage 3). Each of the first two stages is interrupted (Ctrl-C) and resumed, and gives what the
same stage uninterrupted gives: stage 1 the same ledger, ``sft.jsonl`` and summary; stage 2 the same metrics and
weights. The SFT stage's data is exactly the ledger's kept rows, and RL starts from the SFT checkpoint's ``actor/``.

Verdicts are hand-built (sample ``j`` of a prompt is correct iff ``j`` is even: the random ``micro`` model answers
no chain sum right) over the engine's real samples, so the kept texts, and what resuming must reproduce, are the
model's own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import posttrain.loop.rejection_sampling as rs
from posttrain.cli import main
from posttrain.envs.sft_data import load_sft_rows
from posttrain.learner.checkpoint import complete_checkpoints
from posttrain.loop.metrics_log import MetricsLog
from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Ledger, Status
from tests._micro_run import MICRO_RUN
from tests._tolerance import shape_rtol

pytestmark = pytest.mark.timeout(600)

# Stage 1: 8 training prompts (2 ledger steps of 4), 4 samples each, at most 2 kept per prompt.
SAMPLE = ["sample", "grpo", *MICRO_RUN, "--k", "4", "--prompts", "8", "--keep-per-prompt", "2", "--no-progress"]
# Stage 2: the shipped SFT stage on micro, 4 steps with a checkpoint every 2 (a high rate: the weights must move).
SFT_STEPS = 4
SFT = ["train", "smollm2_instruction_following_ei_sft", "model.path=builtin:micro", "task.chat_template=auto",
       f"steps={SFT_STEPS}", "checkpoint_every=2", "eval.every=2", "optim.lr=1e-2", "logging.progress=false",
       "--no-progress"]


def _judge_by_index(monkeypatch: pytest.MonkeyPatch, ctrl_c_at_call: int | None = None) -> None:
    """``play_once`` as the pass runs it, its verdicts replaced: sample ``j`` correct iff ``j`` is even. Call
    ``ctrl_c_at_call`` (1-based: the ledger step) raises ``KeyboardInterrupt`` instead, as Ctrl-C there would."""
    real = rs.play_once
    calls = []

    def play(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == ctrl_c_at_call:
            raise KeyboardInterrupt
        played = real(*a, **kw)
        verdicts = [Verdict(Status.CORRECT if c.sample_index % 2 == 0 else Status.WRONG,
                            {"task": float(c.sample_index % 2 == 0)}) for c in played.completions]
        return dataclasses.replace(played, verdicts=verdicts)

    monkeypatch.setattr(rs, "play_once", play)


def _stage1(out: Path) -> tuple[str, list[tuple[Any, ...]], dict[str, Any]]:
    trajs = Ledger(out / "ledger").read_trajectories()
    summary = json.loads((out / "summary.json").read_text())
    for key in ("wall_s", "resumed_after_step"):
        summary.pop(key)
    summary["command"] = summary["command"].replace(str(out), "OUT")
    return ((out / "sft.jsonl").read_text(), [(t.traj_id, t.token_ids.tolist(), t.status, t.meta["kept"],
                                               t.meta["response"]) for t in trajs], summary)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _ctrl_c_after_logging_step(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """Ctrl-C right after the run logs step ``at`` (its checkpoint not yet written, the previous one intact)."""
    real = MetricsLog.log

    def log(self: MetricsLog, step: int, metrics: Any) -> None:
        real(self, step, metrics)
        if step == at:
            raise KeyboardInterrupt

    monkeypatch.setattr(MetricsLog, "log", log)


def test_each_stage_resumes_to_the_uninterrupted_result_and_rl_starts_from_the_sft_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Stage 1 straight, then interrupted in its second ledger step and resumed.
    _judge_by_index(monkeypatch)
    assert main([*SAMPLE, "--out", str(tmp_path / "sample_straight")]) == 0
    out = tmp_path / "sample"
    _judge_by_index(monkeypatch, ctrl_c_at_call=2)
    assert main([*SAMPLE, "--out", str(out)]) == 130
    assert "continue with: posttrain sample grpo" in capsys.readouterr().err
    assert Ledger(out / "ledger").steps("metrics") == [1] and not (out / "sft.jsonl").exists()
    _judge_by_index(monkeypatch)
    assert main([*SAMPLE, "--out", str(out), "--resume"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_after_step"] == 1 and summary["kept"] >= 8, summary
    assert _stage1(out) == _stage1(tmp_path / "sample_straight")

    # The SFT stage's data is exactly the ledger's kept rows (what the SFT loader reads from sft.jsonl).
    data = out / "sft.jsonl"
    kept = [t for t in Ledger(out / "ledger").read_trajectories() if t.meta["kept"]]
    assert all(t.status is Status.CORRECT and t.meta["response"].strip() for t in kept)
    assert [(r.messages[1]["content"], r.trained) for r in load_sft_rows(data)] == [
        (t.meta["response"], (False, True)) for t in kept]
    assert [json.loads(line)["source"] for line in data.read_text().splitlines()] == [t.traj_id for t in kept]

    # Stage 2 straight, then interrupted after step 3 (checkpoint step 2 intact) and resumed.
    sft = [*SFT, f"sft.data={data}", f"sft.heldout_data={data}"]
    assert main([*sft, f"run_dir={tmp_path / 'sft_straight'}"]) == 0
    run_dir = tmp_path / "sft"
    with monkeypatch.context() as m:
        _ctrl_c_after_logging_step(m, 3)
        assert main([*sft, f"run_dir={run_dir}"]) == 130
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_000002"]
    capsys.readouterr()
    assert main([*sft, f"run_dir={run_dir}", "resume=true"]) == 0
    assert f"done: {SFT_STEPS} steps" in capsys.readouterr().out
    a, b = _metrics(run_dir), _metrics(tmp_path / "sft_straight")
    assert [(r["step"], sorted(r)) for r in a] == [(r["step"], sorted(r)) for r in b]  # no gap, no duplicate
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "heldout/loss"):
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=shape_rtol(128)), (x["step"], key)
    last = f"checkpoints/step_{SFT_STEPS:06d}/actor"
    resumed, straight = (load_file(str(d / last / "model.safetensors")) for d in (run_dir, tmp_path / "sft_straight"))
    assert sorted(resumed) == sorted(straight)
    for name, w in straight.items():
        torch.testing.assert_close(resumed[name], w, rtol=shape_rtol(128), atol=1e-6, msg=name)
    before = load_file(str(run_dir / "checkpoints" / "step_000002" / "actor" / "model.safetensors"))
    assert any(not torch.equal(before[n], w) for n, w in resumed.items())  # the resumed steps trained

    # Stage 3: RL takes the checkpoint's actor/ as model.path (the step_N directory itself is refused, naming it).
    rl = ["train", "grpo", *MICRO_RUN, "sft.steps=0", "eval.size=4", "steps=1", "checkpoint_every=1", "--no-progress"]
    assert main([*rl, f"model.path={run_dir / last}", f"run_dir={tmp_path / 'rl'}"]) == 0
    assert complete_checkpoints(tmp_path / "rl" / "checkpoints")
    capsys.readouterr()
    step_dir = run_dir / last.rsplit("/", 1)[0]
    assert main([*rl, f"model.path={step_dir}", f"run_dir={tmp_path / 'rl_bad'}"]) == 2
    assert f"use its policy, model.path={step_dir / 'actor'}" in capsys.readouterr().err
