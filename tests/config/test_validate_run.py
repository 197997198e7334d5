"""The config floor runs nothing; the loop-side half of validation (posttrain/loop/validate.py) gives
the same one-line errors at load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from posttrain.config import ConfigError, load_config, parse_config, read_recipe
from posttrain.loop.validate import load_run_config, validate_run


def test_importing_the_config_loads_no_floor_above_it_and_no_torch() -> None:
    code = ("import sys, posttrain.config; print(sorted(m for m in sys.modules if m.startswith('posttrain.') and not "
            "m.startswith(('posttrain.config', 'posttrain.errors'))), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"


def test_parsing_checks_no_registry_and_validate_run_refuses_in_one_line() -> None:
    data, source = read_recipe("grpo", ["credit.estimator=nope"])
    cfg = parse_config(data, source)  # the config alone: a name is a string
    with pytest.raises(ConfigError) as e:
        validate_run(cfg, source)
    assert str(e.value).startswith(f"{source}: credit.estimator: unknown advantage estimator 'nope'; valid: ")
    assert "\n" not in str(e.value)


def test_section_checks_are_reported_together_under_their_keys(tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config("grpo", [f"model.path={tmp_path}", "reward.functions=[{path: 'no_such_mod_h4:f'}]"])
    msg = str(e.value)
    assert ": model.path: " in msg and "has no config.json" in msg
    assert "; " in msg and ": reward.functions.0: reward.functions 'no_such_mod_h4:f': cannot import" in msg


def test_the_commands_loader_gives_the_config_of_load_config() -> None:
    assert load_run_config("demo", ["steps=3"]) == load_config("demo", ["steps=3"])


def test_load_config_alone_names_no_registry_and_the_commands_loader_refuses() -> None:
    """The config floor's loader parses a name it cannot check; the commands' loader refuses it at load."""
    assert load_config("grpo", ["credit.estimator=nope"]).credit.estimator == "nope"
    with pytest.raises(ConfigError, match="credit.estimator: unknown advantage estimator 'nope'"):
        load_run_config("grpo", ["credit.estimator=nope"])


def test_a_checkpoint_given_as_model_path_is_told_to_use_its_actor(tmp_path) -> None:
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"is a posttrain checkpoint, not a model directory: use its policy, "
                                          rf"model.path={step / 'actor'}$"):
        load_run_config("grpo", [f"model.path={step}"])
