"""The tool-environment example of docs/tasks_and_verifiers.md (examples/tool_env/) trains through
``posttrain train``, the doc shows its files verbatim, and the shipped tool_calc recipe's ledger
records per-token roles, masks and versions across turns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.trajectory import Ledger, Role

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples" / "tool_env"
DOC = ROOT / "docs" / "tasks_and_verifiers.md"
FILES = ("shop.py", "recipe.yaml")
pytestmark = pytest.mark.timeout(600)


def _doc_blocks() -> dict[str, str]:
    pat = re.compile(r"<!-- examples/tool_env/(\S+) -->\n```[a-z]*\n(.*?)```", re.S)
    return {name: body for name, body in pat.findall(DOC.read_text())}


def test_doc_shows_the_example_files_verbatim() -> None:
    blocks = _doc_blocks()
    assert set(blocks) == set(FILES)
    for name in FILES:
        assert blocks[name] == (EX / name).read_text(), f"docs/tasks_and_verifiers.md and examples/tool_env/{name} differ"


def _train(tmp_path: Path, recipe: str, *overrides: str) -> list:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", recipe, f"run_dir={tmp_path / 'run'}",
                        "--no-progress", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return Ledger(tmp_path / "run" / "ledger").read_trajectories()


def _check_turns(trajs: list, steps: int, episodes: int) -> int:
    """Roles / masks / versions of every episode; returns how many episodes had >= 2 turns."""
    assert len(trajs) == steps * episodes
    multi = 0
    for t in trajs:
        act = [r is Role.ACTION for r in t.roles]
        assert t.action_mask.tolist() == [int(a) for a in act]
        assert all((v >= 0) == a for v, a in zip(t.behavior_version.tolist(), act, strict=True))
        assert all(lp == 0.0 for lp, a in zip(t.behavior_logprob.tolist(), act, strict=True) if not a)
        turns = list(t.steps.action_tokens)
        assert sum(turns) == t.num_actions and len(turns) == t.meta["turns"]
        if len(turns) >= 2:
            multi += 1
            # prompt, then action / observation alternating: an observation sits between the turns
            runs = [r for i, r in enumerate(t.roles) if i == 0 or t.roles[i - 1] is not r]
            assert runs[:4] == [Role.PROMPT, Role.ACTION, Role.OBSERVATION, Role.ACTION]
    return multi


def test_tool_env_example_trains_through_posttrain_train(tmp_path: Path) -> None:
    trajs = _train(tmp_path, "examples/tool_env/recipe.yaml")
    assert _check_turns(trajs, 2, 2 * 4) > 0
    assert {t.verifier for t in trajs} == {"shop@1"}
    # GiGPO's step record is in the ledger
    assert all(len(t.steps.anchors) == t.meta["turns"] for t in trajs)


def test_tool_calc_recipe_two_steps_ledger_roles_masks_versions(tmp_path: Path) -> None:
    trajs = _train(tmp_path, "tool_calc", "steps=2", "model.path=builtin:micro", "sft.steps=2", "sft.examples=8",
                   "sft.batch_size=4", "sampling.prompts_per_step=2", "sampling.group_size=2",
                   "sampling.max_new_tokens=30", "eval.size=2", "eval.every=2",
                   "env.stop_strings=['</tool_call>', '</answer>', 'e', 'o', '1']")
    assert _check_turns(trajs, 2, 2 * 2) > 0
    versions = {int(v) for t in trajs for v in t.behavior_version.tolist() if v >= 0}
    assert versions == {0, 1}  # step 1 sampled under v0, step 2 under v1 (sync)
