"""The loop takes pi_old from the update's own forward when an update is one optimizer step
(``optim.fuse_old_logprob``, default on): the ledger records the same old log-probs and versions
and the run ends on the same weights as with the separate no-grad forward (issue 12, part 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from posttrain.trajectory import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _ab_runs import train_each, update_diff_at  # noqa: E402
from _tolerance import shape_rtol  # noqa: E402

SMALL = ["model.path=builtin:micro", "task.name=flaky_task:digit_first", "task.kwargs={terms: 2}",
         "sampling.prompts_per_step=4", "sampling.group_size=4", "sampling.max_new_tokens=2", "optim.lr=1e-2", "eval.size=8", "eval.every=100",
         "logging.progress=false", "steps=3", "loss.kl_estimator=k3", "loss.kl_coef=0.05", "checkpoint_every=3"]


def test_fused_and_two_forward_runs_record_the_same_pi_old_and_end_on_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # flaky_task: reward = first token is a digit
    runs = train_each(tmp_path, SMALL, "optim.fuse_old_logprob", (True, False))
    m = {f: Ledger(d / "ledger").read_metrics() for f, d in runs.items()}
    assert all(x["update/fused_old_logprob"] == 1.0 for x in m[True])
    assert all(x["update/fused_old_logprob"] == 0.0 for x in m[False])
    a, b = (Ledger(runs[f] / "ledger").read_trajectories() for f in (True, False))
    assert len(a) == len(b) == 3 * 16
    # float32 micro model: rounding over its longest reduction (64), scaled by |log-prob| <= 10
    tol = shape_rtol(64) * 10
    for ta, tb in zip(a, b, strict=True):
        assert ta.token_ids.tolist() == tb.token_ids.tolist() and ta.old_version == tb.old_version
        np.testing.assert_allclose(ta.old_logprob, tb.old_logprob, rtol=0, atol=tol)
        assert ta.ref_logprob is not None
    for x, y in zip(m[True], m[False], strict=True):
        assert abs(x["kl/ref_mean"] - y["kl/ref_mean"]) <= tol
    d, bound = update_diff_at(runs[True], runs[False], 3)
    assert d <= bound, (d, bound)
