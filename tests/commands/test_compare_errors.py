"""``posttrain compare`` refuses arguments that are neither runs nor recipes in one line, before training."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.commands import compare
from tests._cli_errors import one_error_line


def test_compare_of_missing_run_dirs_is_one_line_naming_compare_and_both_paths(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[str] = []
    monkeypatch.setattr(compare, "train_seed", lambda recipe, *a: trained.append(recipe))
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert line.startswith("posttrain compare: error: ") and "posttrain train" not in line.split(":")[0]
    assert f"{a}, {b}: no such run directory or recipe" in line
    assert "run directory holding config.yaml" in line and "recipe YAML file" in line
    assert trained == []  # refused before anything was trained


def test_compare_refuses_a_bad_second_item_before_training_the_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[str] = []
    monkeypatch.setattr(compare, "train_seed", lambda recipe, *a: trained.append(recipe))
    assert main(["compare", "grpo", "grpoo", "--seeds", "1", "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert line.startswith("posttrain compare: error: grpoo: no such run directory or recipe")
    assert trained == []
