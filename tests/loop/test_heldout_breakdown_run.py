"""End to end on the micro model: a run logs, at every evaluation, the per-family constraint rates of each
held-out set of ``instruction_following`` (only the families that set asks for) and, for a tool environment,
the tool calls per held-out episode (not for the no-tool evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.envs.instruction_following import InstructionFollowingTask
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

pytestmark = pytest.mark.timeout(600)

_MICRO = ["model.path=builtin:micro", "sampling.prompts_per_step=2", "sampling.group_size=2", "steps=1",
          "eval.every=1", "logging.progress=false", "guards.max_truncation_rate=1.0"]


def _evaluations(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "heldout/accuracy" in r]


def test_instruction_following_run_logs_each_sets_family_rates(tmp_path: Path) -> None:
    train(load_run_config(None, [*_MICRO, "task.name=instruction_following", "sampling.max_new_tokens=6",
                                 "eval.size=6", "seed=2", f"run_dir={tmp_path}"]))
    evs = _evaluations(tmp_path)
    assert [r["step"] for r in evs] == [0, 1]
    task = InstructionFollowingTask()
    for split in ("heldout", "heldout_unseen"):
        asked = {s["family"] for ex in task.examples(split, 6, seed=2) for s in json.loads(ex.reference)}
        for r in evs:
            rates = {k[len(split) + len("/ifc/"):]: v for k, v in r.items() if k.startswith(f"{split}/ifc/")}
            assert set(rates) == asked, (split, r["step"])
            assert all(0.0 <= v <= 1.0 for v in rates.values())
            assert f"{split}/tool_calls_mean" not in r  # no tools in this task


def test_tool_environment_run_logs_tool_calls_per_held_out_episode(tmp_path: Path) -> None:
    train(load_run_config(None, [*_MICRO, "env.name=calculator_tool", "env.tool_prompt=none", "env.max_turns=2",
                                 "env.max_tokens=120", "env.eval_without_tools=true", "sampling.max_new_tokens=8",
                                 "eval.size=2", f"run_dir={tmp_path}"]))
    for r in _evaluations(tmp_path):
        assert r["heldout/tool_calls_mean"] >= 0.0  # logged, 0.0 included (the random micro model rarely calls)
        assert "heldout_notool/tool_calls_mean" not in r and "heldout_notool/accuracy" in r
        assert not any("/ifc/" in k for k in r)
