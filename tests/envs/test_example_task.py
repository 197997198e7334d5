"""examples/my_task.py: a user's task + verifier works with the task machinery and the CLI."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("my_task_example", ROOT / "examples" / "my_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_task_and_verifier_follow_the_protocols():
    from posttrain.envs import Task
    from posttrain.rewards import Verifier
    from posttrain.trajectory import Status

    task = _load().make_task(difficulty=5)
    assert isinstance(task, Task) and isinstance(task.verifier, Verifier)
    train = task.examples("train", 40, 0)
    assert train == task.examples("train", 40, 0)
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in task.examples("heldout", 10, 0)})
    e = train[0]
    assert task.verifier.verify(e.meta["answer"], e.reference).status is Status.CORRECT
    assert task.verifier.verify(e.prompt[:-1] + "x", e.reference).status is Status.WRONG
    assert task.verifier.verify("12", e.reference).status is Status.INVALID


def test_example_runs_through_posttrain_inspect():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "inspect", "task", "examples.my_task:make_task",
                          "--n", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("-> correct") == 3 and "verifier=reverse@1" in out.stdout
