"""A successful Ray run prints nothing that looks like a failure.

Producer shutdown sends each rollout actor a ``pause``; the backend then kills the actors. A pause
still queued at the kill was reported by Ray as ``(raylet) Task RolloutActor.pause failed ...
killed by ray.kill`` on a run that ended well. The backend now waits for its pause calls before
the kill. Each test starts its own cluster in a subprocess (not the session's ``ray_env``), since
what is checked is the process's own output through to Ray's shutdown.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A failure as a user reads it: Ray's "Task ... failed", a traceback, any "...Error" name, and Ray's own
# error-level log lines ("[date time E pid tid] file.cc:line: ...", e.g. the warning that a restartable
# actor's constructor arguments live in the object store and "the actor restart will fail").
FAILURE = re.compile(r"[Ff]ailed|FAILED|Traceback|Error|\[[^\]]* E \d+ \d+\]|will fail")
# ... except the raylet's disk monitor, an error-level line about the host (its /tmp over 95% full), not the run.
HOST_DISK = re.compile(r"file_system_monitor\.cc:\d+: \S+ is over \d+% full")


def _failure_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if FAILURE.search(ln) and not HOST_DISK.search(ln)]


def test_failure_lines_skip_only_the_host_disk_monitor():
    """Hand cases: the disk-full line of a crowded host is not the run's failure; every other error line is."""
    disk = ("\x1b[33m(raylet)\x1b[0m [2026-12-05 18:38:43,511 E 28292 28307] (raylet) file_system_monitor.cc:116: "
            "/tmp/ray/session_x is over 95% full, available space: 11.8 GB; capacity: 251.9 GB. Object creation "
            "will fail if spilling is required.")
    killed = "(raylet) Task RolloutActor.pause failed: the actor died, killed by ray.kill"
    other_e = "[2026-12-05 18:38:43,511 E 28292 28307] core_worker.cc:512: actor restart will fail"
    assert _failure_lines("\n".join([disk, "done: 2 steps", killed, other_e])) == [killed, other_e]


def _run(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(300)
def test_pause_then_close_prints_no_failed_task():
    """The shutdown order itself: pauses sent right before ``close()`` are answered, not killed."""
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests/distributed")
        import ray.cloudpickle
        import _distributed_helpers as helpers
        from posttrain.loop.backends import RayBackendConfig, build_ray_backend, builtin_engine_factory

        ray.cloudpickle.register_pickle_by_value(helpers)
        cfg = RayBackendConfig(local_num_cpus=2, num_rollout_workers=2, num_reward_workers=0,
                               cpus_per_rollout_worker=0.5, startup_timeout_s=90)
        backend = build_ray_backend(builtin_engine_factory(helpers.micro_engine_model(), eos_token_id=1), cfg)
        for _ in range(3):
            backend.rollout.pause()
        backend.close()
        print("closed")
    """)
    p = _run(code, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "closed" in p.stdout
    assert _failure_lines(out) == [], out[-3000:]


@pytest.mark.timeout(400)
def test_async_ray_run_prints_no_failure(tmp_path):
    """``posttrain train grpo system.backend=ray system.mode=async`` (2 steps, micro model) ends
    with exit 0 and no line that reads as a failure on stdout or stderr."""
    args = ["train", "grpo", "system.backend=ray", "system.mode=async", "steps=2", f"run_dir={tmp_path}",
            "model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}",
            "sampling.prompts_per_step=4", "sampling.group_size=4", "sampling.max_new_tokens=3",
            "eval.size=8", "eval.every=100", "logging.progress=false", "system.ray.startup_timeout_s=90"]
    p = _run(f"import sys; from posttrain.cli import main; sys.exit(main({args!r}))", timeout=360)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "done: 2 steps" in out
    assert _failure_lines(out) == [], out[-3000:]
