"""The synchronous loop end to end on a micro model: ledger, statuses, recipes, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.config import RECIPES_DIR
from posttrain.loop.preflight import preflight
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger, Status
from tests._required_keys import with_required

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from _micro_run import MICRO_RUN  # noqa: E402

SMALL = [
    *MICRO_RUN,
    "eval.size=16",
    "eval.every=2",
    "sft.steps=0",  # from the random micro model (the shipped recipes warm up with SFT)
]


def _cfg(tmp_path, recipe="grpo", extra=()):
    return load_run_config(recipe, [*SMALL, f"run_dir={tmp_path}", *extra])


def test_grpo_learns_from_the_verifier_reward(tmp_path):
    """From a random micro model, GRPO raises P(first token is a digit) from ~10% to ~100%."""
    sys.path.insert(0, str(HERE))
    try:
        train(load_run_config("grpo", [*SMALL, f"run_dir={tmp_path}", "task.name=flaky_task:digit_first",
                                   "sampling.prompts_per_step=8", "sampling.group_size=8", "sampling.max_new_tokens=2",
                                   "eval.every=1000", "optim.lr=1e-2", "steps=20"]))
    finally:
        sys.path.remove(str(HERE))
    rewards = [m["reward/mean"] for m in Ledger(tmp_path / "ledger").read_metrics()]
    assert sum(rewards[:3]) / 3 < 0.25, rewards
    assert sum(rewards[-3:]) / 3 > 0.8, rewards


def test_ledger_records_every_step_with_frozen_versions(tmp_path):
    st = train(_cfg(tmp_path, extra=["steps=2", "loss.kl_estimator=k3", "loss.kl_coef=0.01"]))
    assert st.step == 2
    led = Ledger(tmp_path / "ledger")
    assert led.steps() == [1, 2] and led.steps("metrics") == [1, 2]
    for step, t in led.iter_trajectories():
        acts = t.behavior_version[t.action_mask.astype(bool)]
        # Sync: sampled by the version the learner then recomputed pi_old under.
        assert set(acts.tolist()) == {step - 1} and t.old_version == step - 1
        assert t.ref_version == 0 and t.ref_logprob is not None
        assert t.status is not None and t.verifier == "integer@1"
        assert t.reward.total == pytest.approx(sum(t.reward.weights[k] * t.reward.components[k] for k in t.reward.weights))
        # on-policy in float32: behavior and recomputed old log-probs agree
        np.testing.assert_allclose(t.old_logprob, t.behavior_logprob, atol=1e-4)
    m = led.read_metrics()[-1]
    for key in ("reward/mean", "train/accuracy", "length/p95", "clip_frac_high", "ratio_mean", "kl",
                "entropy", "grad_norm", "adv/zero_group_frac", "tokens/generated", "time/rollout_s",
                "time/learner_s", "logkappa_abs_max"):
        assert key in m, key
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 3  # step 0 eval + 2 steps


def test_infra_errors_are_excluded_and_counted_never_zero_reward(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        st = train(_cfg(tmp_path, extra=["steps=2", "task.name=flaky_task:flaky", "sampling.max_new_tokens=2",
                                          "sampling.prompts_per_step=8", "eval.every=100"]))
    finally:
        sys.path.remove(str(HERE))
    assert st.step == 2
    led = Ledger(tmp_path / "ledger")
    trajs = led.read_trajectories()
    infra = [t for t in trajs if t.status is Status.INFRA_ERROR]
    assert infra, "the crashing verifier should have produced infra errors"
    assert all(t.reward.total is None and t.old_logprob is None for t in infra)  # excluded from the update
    assert all("7" in t.meta["response"] for t in infra)
    metrics = led.read_metrics()
    assert sum(m["status/infra_error"] for m in metrics) == len(infra)
    assert all(m["tokens/trained"] <= m["tokens/generated"] for m in metrics)


def _rl_recipe(path: Path) -> bool:
    """Whether a shipped recipe trains with the RL loop (``trainer`` absent or ``rl``); the preference and
    reward-model trainers run end to end in tests/loop/test_preference_training.py and
    tests/loop/test_reward_model_training.py."""
    import yaml

    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("trainer", "rl") == "rl"


# demo and tool_calc carry long SFT warm-ups; tool_calc's 2 steps run in tests/envs/test_tool_env_example.py
@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")
                                          if p.stem not in ("demo", "tool_calc") and _rl_recipe(p)))
def test_every_recipe_runs(tmp_path, recipe):
    extra = ["steps=2", "sampling.group_size=4" if recipe != "ppo" else "sampling.group_size=1"]
    if recipe in ("dapo",):
        extra += ["reward.overlong_max_len=3", "reward.overlong_cache_len=1"]
    if recipe == "smollm2_instruction_following":  # its task kwarg (on_topic) belongs to its own task
        extra += ["task.name=instruction_following", "task.kwargs={on_topic: true}"]
    cfg = load_run_config(recipe, with_required(recipe, [*SMALL, f"run_dir={tmp_path}", *extra]))
    preflight(cfg)  # as posttrain train does: a config the first step would fail on fails here, naming the key
    st = train(cfg)
    assert st.step == 2
    last = Ledger(tmp_path / "ledger").read_metrics()[-1]
    if cfg.sampling.dynamic_sampling and "loss" not in last:  # no group of the tiny model had a signal: no update,
        assert last["sampling/shortfall_groups"] == cfg.sampling.prompts_per_step  # and the shortfall says so
    else:
        assert np.isfinite(last["loss"])


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _run_ok(cmd, env):
    p = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def _sigkill_once_hung(run, cut_dir, marker, env):
    """Start ``run`` into ``cut_dir`` with a verifier that hangs once ``marker`` exists; SIGKILL it there."""
    hang = f"task.kwargs={{terms: 2, hang_when: '{marker}'}}"
    proc = subprocess.Popen([*run, f"run_dir={cut_dir}", hang], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint in time"
    time.sleep(1.0)
    assert proc.poll() is None  # still stuck in the verifier
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_sigkill_mid_step_then_resume_matches_uninterrupted_run(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    marker = cut_dir / "checkpoints" / "step_000002" / "meta.json"
    common = [*SMALL, "steps=4", "checkpoint_every=1", "seed=3", "task.name=flaky_task:hanging"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = [sys.executable, "-m", "posttrain.cli", "train", "grpo", *common, "--no-progress"]
    _run_ok([*run, f"run_dir={ref_dir}"], env)

    # The verifier hangs at the first verification after checkpoint 2 is complete: inside step 3.
    _sigkill_once_hung(run, cut_dir, marker, env)
    assert Ledger(cut_dir / "ledger").steps() == [1, 2]  # the killed step left nothing in the ledger

    # The resume drops the fault-injection knob (task.kwargs.hang_when): a recipe change, so forced.
    _run_ok([*run, f"run_dir={cut_dir}", "resume=true", "resume_force=true"], env)
    a, b = Ledger(ref_dir / "ledger"), Ledger(cut_dir / "ledger")
    assert a.steps() == b.steps() == [1, 2, 3, 4]
    ta_all, tb_all = a.read_trajectories(), b.read_trajectories()
    assert len(ta_all) == len(tb_all)
    for ta, tb in zip(ta_all, tb_all, strict=True):
        assert ta.prompt_id == tb.prompt_id  # the data cursor continued exactly
        assert ta.token_ids.tolist() == tb.token_ids.tolist()
        assert ta.behavior_version.tolist() == tb.behavior_version.tolist()
        assert (ta.old_version, ta.ref_version) == (tb.old_version, tb.ref_version)
        np.testing.assert_allclose(ta.behavior_logprob, tb.behavior_logprob, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ta.old_logprob, tb.old_logprob, rtol=0, atol=1e-6)
    wa = _weights(ref_dir / "checkpoints" / "step_000004" / "actor")
    wb = _weights(cut_dir / "checkpoints" / "step_000004" / "actor")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_async_learner_sigkill_then_resume_discards_and_counts_the_queue(tmp_path):
    """Kill the learner process mid-step in async mode; the resume continues from the last checkpoint,
    the samples that were queued / in flight at that checkpoint are discarded and counted, and the
    ledger has every step exactly once."""
    import json

    cut_dir = tmp_path / "cut"
    marker = cut_dir / "checkpoints" / "step_000002" / "meta.json"
    common = [*SMALL, "steps=4", "checkpoint_every=1", "seed=3", "task.name=flaky_task:hanging",
              "system.mode=async", "system.max_staleness=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = [sys.executable, "-m", "posttrain.cli", "train", "grpo", *common, "--no-progress"]
    _sigkill_once_hung(run, cut_dir, marker, env)  # the rollout worker hangs verifying after checkpoint 2
    # The learner may have consumed queued groups past checkpoint 2: resume is from the latest one.
    last = sorted((cut_dir / "checkpoints").glob("step_*"))[-1]
    inflight = json.loads((last / "meta.json").read_text())["extra"]["run_state"]["inflight_at_checkpoint"]
    assert inflight > 0  # async: samples were queued or in flight when that checkpoint was written

    _run_ok([*run, f"run_dir={cut_dir}", "resume=true", "resume_force=true"], env)  # without hang_when: forced
    led = Ledger(cut_dir / "ledger")
    assert led.steps() == [1, 2, 3, 4]
    ids = [t.traj_id for t in led.read_trajectories()]
    assert len(ids) == len(set(ids)) == 4 * 4 * 4  # nothing trained twice, no step short
    final = json.loads((cut_dir / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert final["extra"]["run_state"]["discarded_on_resume"] == inflight
