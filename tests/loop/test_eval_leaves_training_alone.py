"""Held-out evaluation does not perturb the training run.

Training and evaluation requests are each seeded from the run's seed and their own ids (``turn_seed``),
so evaluating more often must leave the training trajectory untouched: the same sampled tokens, rewards,
losses and gradient norms step for step. Recipes rely on it (``smollm2_instruction_following`` evaluates
every 10 steps, its figures compared with runs that evaluated every 20). Checked to fail when an
evaluation leaves the policy's weights changed (one parameter scaled by 1.01 in ``evaluate_run``: the
tokens of the next step differ); drawing from torch's global generator during evaluation does not
break it, since no training request reads that generator.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger

sys.path.insert(0, str(Path(__file__).parent.parent))
from _micro_run import MICRO_RUN  # noqa: E402

BASE = [*MICRO_RUN, "sft.steps=0", "steps=4", "seed=5", "eval.size=8", "eval.sampled_temperature=1.0",
        "optim.lr=1e-2"]


def _run(run_dir: Path, every: int) -> tuple[list[dict[str, float]], list[np.ndarray]]:
    train(load_run_config("grpo", [*BASE, f"eval.every={every}", f"run_dir={run_dir}"]))
    led = Ledger(run_dir / "ledger")
    metrics = led.read_metrics()
    tokens = [t.token_ids for _, t in sorted(led.iter_trajectories(), key=lambda st: (st[0], st[1].traj_id))]
    return metrics, tokens


def test_evaluating_every_step_leaves_the_training_run_unchanged(tmp_path):
    often_m, often_t = _run(tmp_path / "often", every=1)
    never_m, never_t = _run(tmp_path / "never", every=1000)
    # The runs really differ in evaluation: one scored the held-out set after every step, the other only
    # after the last (a run always evaluates its final policy).
    assert [("heldout/accuracy" in m) for m in often_m] == [True] * 4
    assert [("heldout/accuracy" in m) for m in never_m] == [False, False, False, True]
    # ... and sampled the same training tokens, so the same rewards and (same shapes, same threads) losses.
    assert len(often_t) == len(never_t) == 4 * 16
    for a, b in zip(often_t, never_t, strict=True):
        np.testing.assert_array_equal(a, b)
    for m_often, m_never in zip(often_m, never_m, strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "entropy"):
            assert m_often[key] == m_never[key], (key, m_often["step"], m_often[key], m_never[key])
