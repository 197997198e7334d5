"""`posttrain report` on the new trainers' runs: offline preference and reward-model runs report their held-out
pair accuracy (no ledger, no RL sections), learned rewards their agreement with the verifier, distillation
its teacher log-prob gap strata (hand-checked on synthetic ledgers)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from posttrain.commands import report
from posttrain.trajectory import Reward
from tests.diagnostics.synthetic import CONFIG, traj, write_run
from tests.diagnostics.test_commands import parse


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


@pytest.mark.parametrize("recipe", ["dpo", "reward_model"])
def test_pair_trainer_runs_report_their_heldout_pair_accuracy(recipe: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from posttrain.commands import train

    run = tmp_path / recipe
    targs = parse(train, ["train", recipe, "steps=4", "eval.every=2", f"run_dir={run}", "--no-progress"])
    assert targs.func(targs) == 0
    capsys.readouterr()
    args = parse(report, ["report", str(run)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    acc = {m["step"]: m["heldout/pair_accuracy"] for m in logged if "heldout/pair_accuracy" in m}
    assert sorted(acc) == [0, 2, 4]
    doc = json.loads((run / "diagnostics" / "pair_accuracy.json").read_text())
    assert doc["trainer"] == ("preference" if recipe == "dpo" else "reward_model")
    assert [p["step"] for p in doc["curve"]] == [0, 2, 4]
    s = doc["summary"]
    assert s["first"]["pair_accuracy"] == acc[0] and s["last"]["pair_accuracy"] == acc[4]
    assert s["best"]["pair_accuracy"] == max(acc.values())
    assert s["rise"] == pytest.approx(acc[4] - acc[0])
    assert "held-out pair accuracy" in out and "first" in out and "best" in out and "last" in out
    assert "by policy lag" not in out and "hidden one" not in out and "no ledger" in out  # no empty RL sections


def test_learned_reward_runs_report_agreement_with_the_verifier(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    def with_rm(t, rm: float):
        return dataclasses.replace(t, reward=Reward({**t.reward.components, "rm": rm}, t.reward.weights, t.reward.total))

    trajs = [with_rm(traj("a", "g1", "correct", 1.0, [-0.5], [-0.5]), 2.0),
             with_rm(traj("b", "g1", "wrong", 0.0, [-0.5], [-0.5]), 1.0),
             with_rm(traj("c", "g2", "correct", 1.0, [-0.5], [-0.5]), 0.5),
             with_rm(traj("d", "g2", "wrong", 0.0, [-0.5], [-0.5]), 0.5),
             with_rm(traj("e", "g2", "invalid", 0.0, [-0.5], [-0.5]), 1.0)]
    config = {**copy.deepcopy(CONFIG), "reward": {"model": {"path": "some/reward_model"}}}
    run = write_run(tmp_path / "run", config=config, trajectories={1: trajs})
    args = parse(report, ["report", str(run)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # g1: 2.0 > 1.0 wins; g2: 0.5 vs 0.5 ties (1/2), 0.5 vs 1.0 loses: 1.5 / 3 pairs
    assert "ranks the verifier's correct response higher in 0.500 of 3" in out
    (doc,) = json.loads((run / "diagnostics" / "learned_agreement.json").read_text())
    assert doc["component"] == "rm" and doc["pairs"] == 3 and doc["pairwise_agreement"] == pytest.approx(0.5)
    assert doc["mean_correct"] == pytest.approx(1.25) and doc["mean_other"] == pytest.approx(2.5 / 3)


def test_distillation_runs_report_the_teacher_gap_strata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def with_teacher(t, teacher: list[float]):
        return dataclasses.replace(t, teacher_logprob=[0.0, 0.0, *teacher])

    trajs = [with_teacher(traj("a", "g1", "correct", 1.0, [-0.5, -1.0], [-0.5, -1.25]), [-0.5, -1.0]),  # gap -0.125
             with_teacher(traj("b", "g1", "wrong", 0.0, [-2.0], [-2.0]), [-2.5]),  # gap 0.5
             with_teacher(traj("c", "g2", "wrong", 0.0, [-1.0, -1.0], [-1.0, -1.0]), [-3.0, -4.0])]  # gap 2.5
    config = {**copy.deepcopy(CONFIG), "loss": {"distill": {"teacher": "some/teacher", "coef": 1.0}}}
    run = write_run(tmp_path / "run", config=config, trajectories={1: trajs})
    args = parse(report, ["report", str(run)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "by teacher log-prob gap" in out
    doc = json.loads((run / "diagnostics" / "teacher_gap_strata.json").read_text())
    assert [(s["label"], s["n"], s["accuracy"]) for s in doc["strata"]] == [("<0", 1, 1.0), ("0.1-1", 1, 0.0),
                                                                          (">=1", 1, 0.0)]


def test_a_plain_rl_run_gets_no_trainer_sections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run")
    args = parse(report, ["report", str(run)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "teacher log-prob gap" not in out and "learned reward" not in out
    assert not (run / "diagnostics" / "teacher_gap_strata.json").exists()
