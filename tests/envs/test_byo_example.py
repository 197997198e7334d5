"""The bring-your-own example of docs/tasks_and_verifiers.md (examples/byo/) runs, and the doc shows its files verbatim."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
BYO = ROOT / "examples" / "byo"
DOC = ROOT / "docs" / "tasks_and_verifiers.md"
FILES = ("data.jsonl", "rewards.py", "recipe.yaml")


def _doc_blocks() -> dict[str, str]:
    """``{file name: code block}`` for each block the doc marks ``<!-- examples/byo/NAME -->``."""
    pat = re.compile(r"<!-- examples/byo/(\S+) -->\n```[a-z]*\n(.*?)```", re.S)
    return {name: body for name, body in pat.findall(DOC.read_text())}


def test_doc_shows_the_example_files_verbatim() -> None:
    blocks = _doc_blocks()
    assert set(blocks) == set(FILES)
    for name in FILES:
        assert blocks[name] == (BYO / name).read_text(), f"docs/tasks_and_verifiers.md and examples/byo/{name} differ"


def test_byo_recipe_trains_and_the_extra_column_reaches_the_reward(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", "examples/byo/recipe.yaml",
                        f"run_dir={tmp_path / 'run'}", "--no-progress"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {f"byo/{r['id']}": r for r in map(json.loads, (BYO / "data.jsonl").read_text().splitlines())}
    traj_files = sorted((tmp_path / "run" / "ledger" / "trajectories").glob("step_*.parquet"))
    assert len(traj_files) == 2
    seen = 0
    for f in traj_files:
        for t in pq.read_table(f).to_pylist():
            assert t["status"] != "infra_error"  # a reward function that raised would be one
            meta = json.loads(t["meta"])
            comps = dict(t["reward_components"])  # the ledger stores maps as (key, value) pairs
            budget = rows[t["prompt_id"]]["max_chars"]  # the extra column of this row
            assert comps["within_budget"] == float(len(meta["response"].strip()) <= budget)
            assert dict(t["reward_weights"]) == {"task": 1.0, "within_budget": 0.1}
            assert t["reward_total"] == comps["task"] + 0.1 * comps["within_budget"]
            assert meta["prompt_format"] == "chat" and json.loads(meta["prompt_source"])["messages"] == \
                rows[t["prompt_id"]]["messages"]
            assert t["verifier"] == "integer@1+extract=last_number+within_budget=examples.byo.rewards:within_budget"
            seen += 1
    assert seen == 2 * 4 * 4  # steps x prompts x group size
