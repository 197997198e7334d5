"""``posttrain train grpo rollout.engine=vllm`` end to end against a real vLLM process (this CPU).

What a user types, run as a subprocess of the main environment: the trainer starts vLLM from the
vLLM environment (``make vllm-env``; tests/rollout/_vllm_env.py says how it is found or opted
out), pushes each update's weights to it, and records the behaviour log-probs and versions vLLM
returned. The model is the ``tiny`` preset (head_dim 32: vLLM's CPU attention needs >= 32).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm_env import vllm_python, vllm_wanted  # noqa: E402

from posttrain.trajectory import Ledger  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# fp32 on both sides: vLLM's CPU kernels and the learner's eager forward differ by rounding only.
# Measured on this CPU: |log kappa| max ~5e-7 (tiny) / ~1e-6 (3m); a wrong token, position or
# weight version is off by > 1e-2.
KAPPA_MAX = 1e-4

RUN = ["model.path=builtin:tiny", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=4",
       "sampling.group_size=4", "sampling.max_new_tokens=6", "eval.size=8", "eval.every=100",
       "guards.max_truncation_rate=1.0", "checkpoint_every=0"]

MODES = {"sync": ["steps=2"], "async": ["steps=3", "system.mode=async"]}


@pytest.mark.parametrize("mode", list(MODES) if vllm_wanted() else [], ids=str)
def test_train_grpo_with_vllm(tmp_path: Path, mode: str) -> None:
    py = vllm_python()
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "grpo", "rollout.engine=vllm", f"rollout.vllm.python={py}",
           *RUN, *MODES[mode], f"run_dir={tmp_path}", "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    log = tmp_path / "engine_server.log"
    assert p.returncode == 0, p.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    assert "vLLM" in log.read_text() or "vllm" in log.read_text()  # the engine really was vLLM
    led = Ledger(tmp_path / "ledger")
    steps = int(MODES[mode][0].split("=")[1])
    trajs = led.read_trajectories()
    versions: set[int] = set()
    for t in trajs:
        acts = t.action_mask.astype(bool)
        versions |= set(t.behavior_version[acts].tolist())
        assert np.all(t.behavior_logprob[acts] < 0)  # sampled at temperature 1: real log-probs from vLLM
    assert versions <= set(range(steps)) and 0 in versions and max(versions) >= 1
    metrics = [m for m in led.read_metrics() if "logkappa/p99" in m]
    assert len(metrics) == steps
    for m in metrics:
        assert 0 < m["logkappa_abs_max"] < KAPPA_MAX
        assert m["logkappa_abs_mean"] <= m["logkappa/p99"] <= m["logkappa_abs_max"]

