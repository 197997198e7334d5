"""A recipe that starts from an earlier stage's checkpoint (``model.path: runs/<run>/checkpoints/step_N/actor``)
loaded before that stage ran: one line naming the run and the step to train first."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.loop.validate import load_run_config


def test_a_missing_stage_checkpoint_names_the_run_to_train_first(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "sft_stage" / "checkpoints" / "step_000012" / "actor"
    with pytest.raises(ConfigError) as e:
        load_run_config("grpo", [f"model.path={path}"])
    msg = str(e.value)
    assert "\n" not in msg
    assert f"checkpoint of the run {str(tmp_path / 'runs' / 'sft_stage')!r}" in msg
    assert "not reached step_000012 (train that stage first" in msg
    with pytest.raises(ConfigError, match="is not a local model directory"):
        load_run_config("grpo", [f"model.path={tmp_path / 'elsewhere'}"])
