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
       "guards.max_truncation_rate=1.0", "checkpoint_every=0",
       # from the random init (no SFT warm-up: a warmed-up policy samples tokens whose fp32 log-prob rounds to 0)
       "sft.steps=0", "optim.num_minibatches=1"]

MODES = {
    "sync": ["steps=2"],
    "async": ["steps=3", "system.mode=async"],
    # partial rollout: vLLM aborts the unfinished samples once a quarter have finished, resumes them next call
    # (on the tiny model with a likelier eos, so sample lengths vary: see _varied_tiny)
    "partial": ["steps=3", "system.partial_fraction=0.25", "sampling.max_new_tokens=12"],
    # the same in async mode: calls stream groups; paused samples resume under the weights of later updates
    "async_partial": ["steps=3", "system.mode=async", "system.partial_fraction=0.25", "system.max_staleness=2",
                      "sampling.max_new_tokens=12"],
    # the Ray rollout worker builds the engine from the same key (its own vLLM server process)
    "ray": ["steps=2", "system.backend=ray", "system.ray.num_rollout_workers=1", "system.ray.num_reward_workers=0",
            "system.ray.local_num_cpus=2", "system.ray.cpus_per_rollout_worker=0.1",
            "system.ray.startup_timeout_s=300", "system.ray.transfer_timeout_s=120"],
}


def _varied_tiny(d: Path) -> str:
    """The tiny model with its eos embedding pushed towards the mean embedding: sampled lengths spread
    over 1..12 tokens (measured with the built-in engine) instead of nearly all hitting the limit."""
    import torch

    from posttrain.loop.builders import build_model
    from posttrain.loop.validate import load_run_config

    tok, model = build_model(load_run_config("grpo", ["model.path=builtin:tiny"]))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[tok.eos_token_id] += 4.0 * emb.mean(0) / emb.mean(0).norm()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return f"model.path={d}"


@pytest.mark.parametrize("mode", list(MODES) if vllm_wanted() else [], ids=str)
def test_train_grpo_with_vllm(tmp_path: Path, mode: str) -> None:
    py = vllm_python()
    extra = [_varied_tiny(tmp_path / "varied")] if mode.endswith("partial") else []
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "grpo", "rollout.engine=vllm", f"rollout.vllm.python={py}",
           *RUN, *MODES[mode], *extra, f"run_dir={tmp_path / 'run'}", "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    # one log per server: engine_server.log locally, engine_server.<pid>.log in each Ray rollout worker
    logs = sorted((tmp_path / "run").glob("engine_server*.log"))
    text = "".join(f.read_text() for f in logs)
    assert p.returncode == 0, p.stderr[-3000:] + text[-3000:]
    assert len(logs) == 1 and (logs[0].name == "engine_server.log") == (mode != "ray")
    assert "Initializing a V1 LLM engine" in text  # the engine really was vLLM
    led = Ledger(tmp_path / "run" / "ledger")
    steps = int(MODES[mode][0].split("=")[1])
    trajs = led.read_trajectories()
    versions: set[int] = set()
    for t in trajs:
        acts = t.action_mask.astype(bool)
        versions |= set(t.behavior_version[acts].tolist())
        assert np.all(t.behavior_logprob[acts] < 0)  # sampled at temperature 1: real log-probs from vLLM
    assert versions <= set(range(steps)) and 0 in versions and max(versions) >= 1
    if mode.endswith("partial"):
        resumed = [t for t in trajs if t.meta["pauses"] > 0]
        assert resumed, "some samples must have been paused by vLLM and resumed"
        for t in resumed:  # tokens of one trajectory from several weight versions, in order
            v = t.behavior_version[t.action_mask.astype(bool)]
            assert (np.diff(v) >= 0).all() and int(v.max() - v.min()) == t.meta["version_span"]
    metrics = led.read_metrics()
    assert len(metrics) == steps
    # engine mismatch is measured on the tokens sampled under pi_old's own weights (policy lag apart:
    # lag/logratio_*); step 1 always has them
    same = [m for m in metrics if m["logkappa/tokens"] > 0]  # the others have only lag/logratio_*
    assert same and same[0]["step"] == 1
    for m in same:
        assert m["logkappa_abs_max"] < KAPPA_MAX
        assert m["logkappa_abs_mean"] <= m["logkappa/p99"] <= m["logkappa_abs_max"]
    # two implementations, so not bit-identical: a zero everywhere would mean vLLM's numbers were not used
    assert max(m["logkappa_abs_max"] for m in same) > 0

