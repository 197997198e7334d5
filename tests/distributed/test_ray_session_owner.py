"""A run with Ray learner ranks leaves no Ray session it started, and leaves the user's own session up.

``learner.world_size > 1`` with ``system.backend=ray`` starts learner ranks as Ray actors. The rollout
backend is built first (posttrain/loop/parts.py), so it is the part that starts Ray and, at the end of
the run, shuts down the session it started; the ranks join that session. (Built after the learner, the
ranks started Ray, the backend found it running and owned nothing: the run ended with Ray still up.)
Each run is in a subprocess of its own (not the session's ``ray_env``): what is checked is the state
of Ray in the process that ran ``train``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["model.path=builtin:micro", "model.dtype=float64", "task.name=chain_sum", "task.kwargs={terms: 2}",
        "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=1",
        "eval.every=100", "logging.progress=false", "steps=1", "sft.steps=0", "optim.num_minibatches=1",
        "system.backend=ray", "system.ray.local_num_cpus=2", "system.ray.num_rollout_workers=1",
        "system.ray.num_reward_workers=0", "system.ray.cpus_per_rollout_worker=0.2",
        "system.ray.cpus_per_learner=0.25", "system.ray.startup_timeout_s=120", "learner.strategy=ddp",
        "learner.world_size=2", "learner.startup_timeout_s=240"]


def _ray_after_run(tmp_path: Path, user_session: bool) -> str:
    """Run ``train`` on ``ARGS`` in a fresh process (after its own ``ray.init`` when ``user_session``) and
    return its last stdout line: ``ray initialized after the run: True|False``."""
    code = textwrap.dedent(f"""
        import ray
        from posttrain.loop.training_loop import train
        from posttrain.loop.validate import load_run_config

        if {user_session!r}:
            ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
        train(load_run_config("grpo", {[*ARGS, f"run_dir={tmp_path / 'run'}"]!r}))
        print("ray initialized after the run:", ray.is_initialized())
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=500,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(540)
def test_a_run_that_started_ray_shuts_it_down(tmp_path: Path) -> None:
    assert _ray_after_run(tmp_path, user_session=False) == "ray initialized after the run: False"


@pytest.mark.timeout(540)
def test_a_run_in_the_users_ray_session_leaves_it_running(tmp_path: Path) -> None:
    assert _ray_after_run(tmp_path, user_session=True) == "ray initialized after the run: True"
