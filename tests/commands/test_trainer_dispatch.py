"""The commands dispatch through the trainer registry (posttrain/config/trainers.py): ``posttrain train`` runs
the ``check`` then the ``train`` of the program the recipe's entry names (:func:`load_program`), and prints its
closing lines; ``posttrain check``, ``report`` and ``eval`` read the entry (its checks, whether it samples or
trains on pairs, what its held-out evaluation measured)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from posttrain.cli import main
from posttrain.commands import train as train_cmd
from posttrain.commands.check import run_checks
from posttrain.config.trainers import TRAINERS, TrainerEntry
from posttrain.dotted import import_dotted
from posttrain.loop.trainer_program import load_program
from posttrain.loop.validate import load_run_config
from tests._cli_errors import one_error_line


@pytest.mark.parametrize("name", list(TRAINERS))
def test_every_entrys_program_resolves_and_meets_the_protocol(name: str) -> None:
    program = load_program(name)
    module, _, attr = TRAINERS[name].program.partition(":")
    assert program is getattr(importlib.import_module(module), attr)
    assert callable(program.check) and callable(program.train)


class NoTrain:
    def check(self, cfg: Any) -> None: ...


class TrainWithoutProgress:
    def check(self, cfg: Any) -> None: ...

    def train(self, cfg: Any) -> None: ...


NO_TRAIN, TRAIN_WITHOUT_PROGRESS = NoTrain(), TrainWithoutProgress()


@pytest.mark.parametrize("attr, missing", [("NO_TRAIN", r"no method train\(cfg, progress\)"),
                                           ("TRAIN_WITHOUT_PROGRESS", r"no method train\(cfg, progress\)"),
                                           ("NOTHING_HERE", "has no attribute 'NOTHING_HERE'")])
def test_a_program_that_does_not_meet_the_protocol_is_one_line(monkeypatch: pytest.MonkeyPatch, attr: str,
                                                               missing: str) -> None:
    fake = TrainerEntry("fake", "a test", f"tests.commands.test_trainer_dispatch:{attr}", TRAINERS["sft"].samples,
                        TRAINERS["sft"].reads_pairs, None, ())
    monkeypatch.setitem(TRAINERS, "fake", fake)
    with pytest.raises(ValueError, match=rf"^trainer 'fake' program: .*{missing}"):
        load_program("fake")


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="^unknown trainer 'nope'; known: rl, preference, reward_model, sft$"):
        load_program("nope")


class Result:
    """A TrainerResult with fixed closing lines."""

    step, wall_seconds = 0, 0.0

    def summary_lines(self) -> list[str]:
        return ["done: 0 steps (fake)", "stopped early: fake"]


class Recorder:
    """A TrainerProgram that records its calls (``calls``: (method, trainer))."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls

    def check(self, cfg: Any) -> None:
        self.calls.append(("check", cfg.trainer))

    def train(self, cfg: Any, progress: Any) -> Result:
        self.calls.append(("train", cfg.trainer))
        return Result()


RECIPES = {"rl": "grpo", "preference": "dpo", "reward_model": "reward_model", "sft": "sft"}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_train_runs_the_check_then_the_train_of_the_entrys_program(name: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[str, str]] = []
    for entry in TRAINERS.values():  # every program records: only the recipe's own may be called
        module, _, attr = entry.program.partition(":")
        monkeypatch.setattr(importlib.import_module(module), attr, Recorder(calls))
    monkeypatch.setattr(train_cmd, "print_rise", lambda cfg: print("  RISE"))
    assert main(["train", RECIPES[name], f"run_dir={tmp_path / 'run'}", "--no-progress"]) == 0
    assert calls == [("check", name), ("train", name)]
    rise = ["  RISE"] if name == "rl" else []  # the measured rise follows the done line (rl's entry asks for it)
    assert capsys.readouterr().out.splitlines() == ["done: 0 steps (fake)", *rise, "stopped early: fake"]
    assert not (tmp_path / "run").exists()


def test_every_entrys_checks_resolve_and_one_without_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    for e in TRAINERS.values():
        assert e.checks is not None and callable(import_dotted(e.checks, what=e.name))
    monkeypatch.setitem(TRAINERS, "sft", dataclasses.replace(TRAINERS["sft"], checks=None))
    (row,) = run_checks(load_run_config("sft", []))
    assert row[0] == "checks" and row[1] is None and "trainer=sft has no posttrain check yet" in row[2]


def _sft_run(tmp_path: Path) -> Path:
    run = tmp_path / "sft_run"
    (run / "checkpoints" / "step_2" / "actor").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "actor" / "config.json").write_text("{}")
    (run / "config.yaml").write_text("trainer: sft\nsft: {data: chats.jsonl}\n")
    return run


def test_report_of_a_run_that_samples_nothing_and_reads_no_pairs_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _sft_run(tmp_path)
    assert main(["report", str(run)]) == 2
    line = one_error_line(capsys)
    assert "trainer=sft" in line and "no report for it yet" in line and "held-out loss" in line, line
    assert not (run / "diagnostics").exists()


def test_eval_of_a_checkpoint_of_a_run_that_sampled_no_task_asks_for_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _sft_run(tmp_path) / "checkpoints" / "step_2"
    assert main(["eval", str(ckpt)]) == 2
    line = one_error_line(capsys)
    assert "trainer=sft measured held-out loss on sft.data" in line and "--task" in line, line


@pytest.mark.parametrize("recipe, trainer", [("sft", "sft"), ("dpo", "preference"), ("reward_model", "reward_model")])
def test_print_recipe_of_a_trainer_that_samples_nothing_names_it_not_the_rl_axes(
        recipe: str, trainer: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", recipe, "--print-recipe"]) == 0
    head = capsys.readouterr().out.split("---", 1)[0]
    assert f"  trainer     {trainer}: " in head and "  sampling " not in head and "  credit " not in head


def test_print_recipe_of_rl_keeps_the_six_axes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "dpo_online", "--print-recipe"]) == 0
    head = capsys.readouterr().out.split("---", 1)[0]
    assert "  sampling " in head and "  trainer " not in head
