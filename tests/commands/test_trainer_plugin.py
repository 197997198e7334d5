"""A new trainer is one module and one registry entry (posttrain/config/trainers.py: "A new trainer is one module
with its ``PROGRAM`` and one entry here"): with a :class:`~posttrain.config.trainers.TrainerEntry` for the toy
trainer of ``tests/commands/_toy_trainer.py`` added to ``TRAINERS`` (and no file of posttrain changed),
``RunConfig`` takes ``trainer: toy`` and ``posttrain train`` runs the toy's ``check`` and ``train`` and prints its
closing lines; without the entry the same recipe is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.trainers import TRAINERS, TrainerEntry, TrainerView
from posttrain.loop.validate import load_run_config
from tests._cli_errors import one_error_line
from tests.commands._toy_trainer import LOG


def _never(c: TrainerView) -> bool:
    return False


TOY = TrainerEntry("toy", "a toy trainer defined in the tests", "tests.commands._toy_trainer:PROGRAM",
                   samples=_never, reads_pairs=_never, checks=None, examples=(), heldout="nothing")


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRAINERS`` with the toy's entry added (removed again after the test)."""
    monkeypatch.setitem(TRAINERS, "toy", TOY)


def _recipe(tmp_path: Path, steps: int) -> Path:
    path = tmp_path / "toy.yaml"
    path.write_text(f"trainer: toy\nsteps: {steps}\nrun_dir: {tmp_path / 'run'}\n")
    return path


def test_run_config_takes_the_new_trainer_name(toy: None) -> None:
    cfg = load_run_config(None, ["trainer=toy", "steps=2"])
    assert cfg.trainer == "toy" and cfg.steps == 2


def test_posttrain_train_runs_the_new_trainers_program(toy: None, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(_recipe(tmp_path, 3)), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert (run / LOG).read_text().splitlines() == ["step 1", "step 2", "step 3"]
    assert capsys.readouterr().out.splitlines() == ["done: 3 steps (toy)", f"toy log: {run / LOG}"]


def test_the_new_trainers_check_runs_before_anything_is_written(toy: None, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(_recipe(tmp_path, 0)), "--no-progress"]) == 2
    assert "trainer=toy needs steps >= 1, got steps=0" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_without_the_entry_the_name_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "toy" not in TRAINERS
    assert main(["train", str(_recipe(tmp_path, 3)), "--no-progress"]) == 2
    assert "unknown trainer 'toy'; known: rl, preference, reward_model, sft" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()
