"""The one ``pairs_load`` check the offline preference and reward-model check lists share."""

from __future__ import annotations

import pytest

from posttrain.commands.check import run_checks
from posttrain.commands.check_pairs import pairs_load
from posttrain.config import RunConfig
from posttrain.errors import UserError
from posttrain.loop.validate import load_run_config


def test_the_shipped_pairs_load_with_both_splits_counted() -> None:
    cfg = load_run_config("reward_model", [])
    (name, ok, detail), train = pairs_load(cfg)
    assert (name, ok) == ("pairs_load", True)
    assert detail.startswith(f"{len(train)} training and ") and str(cfg.preference.data) in detail
    assert len(train) >= 2


@pytest.mark.parametrize("recipe", ["dpo", "reward_model"])
def test_a_pairs_file_with_an_empty_split_ends_either_list_at_pairs_load(recipe: str, tmp_path) -> None:
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"prompt": "a", "chosen": "x", "rejected": "y"}\n')
    results = run_checks(load_run_config(recipe, [f"preference.data={f}"]), 2)
    assert [(n, ok) for n, ok, _ in results] == [("pairs_load", False)]
    assert str(f) in results[0][2] and "no held-out pairs" in results[0][2]


def test_the_trainers_config_check_runs_first_and_fails_pairs_load() -> None:
    def refuse(cfg: RunConfig) -> None:
        raise UserError("preference.kwargs: beta must be > 0")

    result, train = pairs_load(load_run_config("dpo", []), config_check=refuse)
    assert result == ("pairs_load", False, "preference.kwargs: beta must be > 0") and train == []
