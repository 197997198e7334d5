"""``posttrain eval`` of a checkpoint of a run that evaluated no task: offline preference and reward-model runs.

Such a run measured held-out *pair* accuracy on ``preference.data``; its ``config.yaml`` holds the default
task. ``posttrain eval CKPT`` used to say "evaluating as the run ... did: task arithmetic" and print an
accuracy the run never measured (offline DPO), or fail on the reward model's score head; and ``--task``
was refused as a key the trainer leaves without effect, so the policy could not be evaluated on a task
at all. Now the first is one line saying what the run measured, and ``--task`` / ``--env`` evaluate the
policy as a model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from tests._cli_errors import one_error_line

TASK = ["--task", "chain_sum", "--task-kwargs", '{"terms": 2}', "--n", "4", "--max-new-tokens", "2"]


def _run(tmp_path: Path, recipe: str) -> Path:
    run_dir = tmp_path / recipe
    assert main(["train", recipe, "steps=1", "model.path=builtin:micro", f"run_dir={run_dir}", "--no-progress"]) == 0
    (ckpt,) = sorted((run_dir / "checkpoints").iterdir())
    return ckpt


def test_an_offline_preference_checkpoint_is_not_evaluated_on_a_task_it_never_had(tmp_path: Path, capsys) -> None:
    ckpt = _run(tmp_path, "dpo")
    capsys.readouterr()
    assert main(["eval", str(ckpt)]) == 2
    line = one_error_line(capsys)
    assert "trainer=preference" in line and "pair accuracy" in line and "--task" in line, line
    # with a task named, its policy is evaluated like a model directory (no "as the run did" claim)
    assert main(["eval", str(ckpt), *TASK]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)
    assert res["task"] == "chain_sum" and res["config_from"] is None and 0.0 <= res["heldout/accuracy"] <= 1.0
    assert "as the run" not in out.err and "trainer=preference" in out.err


@pytest.mark.parametrize("argv", [[], TASK], ids=["as_the_run", "with_a_task"])
def test_a_reward_model_checkpoint_is_refused_in_one_line_saying_what_it_is(tmp_path: Path, capsys, argv) -> None:
    ckpt = _run(tmp_path, "reward_model")
    capsys.readouterr()
    assert main(["eval", str(ckpt), *argv]) == 2
    line = one_error_line(capsys)
    assert "trainer=reward_model" in line and "does not generate" in line and "reward.model.path" in line, line
