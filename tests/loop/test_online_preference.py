"""Online preference optimisation (trainer: preference, preference.online: true): the pairs a step's groups
give, by hand, and the shipped recipe dpo_online run end to end on the demo task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.learner.checkpoint import latest_checkpoint
from posttrain.loop.online_preference import group_pairs
from posttrain.trajectory import Reward, Status, Trajectory, make_trajectory


def _t(tid: str, group: str, answer: list[int], status: Status, reward: float | None) -> Trajectory:
    return make_trajectory(traj_id=tid, prompt_id=group, group_id=group, prompt_ids=[1, 2], action_ids=answer,
                           action_logprobs=[-0.5] * len(answer), action_versions=0, finish="terminal",
                           status=status, reward=Reward(total=reward))


GROUPS = [
    # group a: two correct, one wrong, one invalid, one timeout (never paired)
    _t("a0", "a", [5], Status.WRONG, 0.0), _t("a1", "a", [7], Status.CORRECT, 1.0),
    _t("a2", "a", [7, 3], Status.CORRECT, 1.0), _t("a3", "a", [9], Status.INVALID, -0.5),
    _t("a4", "a", [8], Status.TIMEOUT, None),
    # group b: all correct -> no pair; group c: all wrong -> no pair
    _t("b0", "b", [4], Status.CORRECT, 1.0), _t("b1", "b", [4], Status.CORRECT, 1.0),
    _t("c0", "c", [6], Status.WRONG, 0.0), _t("c1", "c", [2], Status.INFRA_ERROR, None),
]


def test_one_pair_per_group_is_first_correct_against_first_wrong() -> None:
    (p,) = group_pairs(GROUPS, "one")
    assert (p.pair_id, p.prompt, p.chosen, p.rejected, p.score_diff) == ("a1>a0", (1, 2), (7,), (5,), 1.0)


def test_all_pairs_are_correct_times_wrong() -> None:
    pairs = group_pairs(GROUPS, "all")
    assert [p.pair_id for p in pairs] == ["a1>a0", "a1>a3", "a2>a0", "a2>a3"]
    assert [p.score_diff for p in pairs] == [1.0, 1.5, 1.0, 1.5]
    assert pairs[2].chosen == (7, 3)


def test_recipe_runs_on_the_demo_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "online"
    assert main(["train", "dpo_online", f"run_dir={run_dir}", "steps=3", "sft.steps=30", "sampling.prompts_per_step=8",
                 "eval.every=3", "eval.size=20", "--no-progress"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    trained = [r for r in steps if r["preference/pairs"] > 0]
    assert trained, "no group had a correct and a wrong response"
    assert all(r["optimizer_steps"] == 1.0 and r["loss"] > 0 for r in trained)
    assert "heldout/accuracy" in rows[-1]
    assert (run_dir / "reference").is_dir()  # the warmed reference, kept for a resume
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None and int(last.name.split("_")[1]) == 3


def test_resume_keeps_the_warmed_reference(tmp_path: Path) -> None:
    run_dir = tmp_path / "online"
    args = ["train", "dpo_online", f"run_dir={run_dir}", "sft.steps=30", "sampling.prompts_per_step=8",
            "eval.every=2", "eval.size=10", "checkpoint_every=1", "--no-progress"]
    assert main([*args, "steps=1"]) == 0
    reference = sorted(p.read_bytes() for p in (run_dir / "reference").glob("*.safetensors"))
    assert main([*args, "steps=2", "resume=true"]) == 0
    assert sorted(p.read_bytes() for p in (run_dir / "reference").glob("*.safetensors")) == reference  # not rewritten
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "preference/pairs" in r] == [1, 2]
