"""The loop writes what the update saw into the ledger (issue 15, parts 1-2): per token the
current policy's log-probs (with one optimiser step per update they are pi_old) and the advantage
the update used (GRPO: the group-normalised reward, constant over a row's action tokens)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol  # noqa: E402

SMALL = ["model.path=builtin:micro", "task.name=flaky_task:digit_first", "task.kwargs={terms: 2}",
         "sampling.prompts_per_step=2", "sampling.group_size=4", "sampling.max_new_tokens=2", "optim.lr=1e-2",
         "eval.size=4", "eval.every=100", "logging.progress=false", "steps=2", "checkpoint_every=100", "sft.steps=0"]


def test_ledger_holds_current_logprobs_and_the_advantages_used(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # flaky_task: reward = first token is a digit
    cfg = load_run_config("grpo", [*SMALL, f"run_dir={tmp_path / 'r'}"])
    train(cfg)
    trajs = Ledger(tmp_path / "r" / "ledger").read_trajectories()
    assert len(trajs) == 2 * 8
    groups = defaultdict(list)
    for t in trajs:
        act = t.action_mask.astype(bool)
        assert t.current_logprob is not None and t.advantage is not None and t.old_logprob is not None
        # one optimiser step per update: pi_theta seen by the update is pi_old
        np.testing.assert_allclose(t.current_logprob[act], t.old_logprob[act], rtol=0, atol=shape_rtol(64) * 10)
        assert (t.advantage[~act] == 0).all() and np.ptp(t.advantage[act]) == 0
        groups[t.group_id].append((t.reward.total, float(t.advantage[act][0])))
    eps = cfg.credit.kwargs.get("eps", 1e-6) if cfg.credit.kwargs else 1e-6
    for members in groups.values():
        r = np.array([m[0] for m in members])
        a = np.array([m[1] for m in members])
        assert abs(a.sum()) <= 1e-5  # centred within the group
        if np.ptp(r) > 0:
            assert np.all(np.sign(a) == np.sign(r - r.mean()))  # above the group mean -> positive
        else:
            assert np.all(a == 0) or np.all(np.abs(a) <= eps)
