"""``optim.skip_no_signal_rows`` in a run: rows whose group got equal rewards skip the backward, and
the run records the same log-probs and ends on the same weights as without the skip (issue 12)."""

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
         "sampling.prompts_per_step=4", "sampling.group_size=4", "sampling.max_new_tokens=2", "optim.lr=1e-2",
         "eval.size=8", "eval.every=100", "logging.progress=false", "steps=3", "checkpoint_every=3"]


def test_skip_records_the_same_and_ends_on_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # flaky_task: reward = first token is a digit
    runs = train_each(tmp_path, SMALL, "optim.skip_no_signal_rows", (True, False))
    m = {s: Ledger(d / "ledger").read_metrics() for s, d in runs.items()}
    skipped = sum(x["no_signal_rows"] for x in m[True])
    assert skipped > 0 and sum(x["no_signal_rows"] for x in m[False]) == 0
    # every skipped row is a row whose group had one reward for all its samples
    a, b = (Ledger(runs[s] / "ledger").read_trajectories() for s in (True, False))
    groups: dict[str, list[float]] = {}
    for t in a:
        if t.reward.total is not None:  # infra errors are never trained
            groups.setdefault(t.group_id, []).append(float(t.reward.total))
    assert skipped == sum(len(g) for g in groups.values() if len(set(g)) == 1)
    tol = shape_rtol(64) * 10  # float32 micro model, |log-prob| <= 10 (as in test_fused_old_logprob)
    for ta, tb in zip(a, b, strict=True):
        assert ta.token_ids.tolist() == tb.token_ids.tolist()
        np.testing.assert_allclose(ta.old_logprob, tb.old_logprob, rtol=0, atol=tol)
        np.testing.assert_allclose(ta.current_logprob, tb.current_logprob, rtol=0, atol=tol)
        np.testing.assert_array_equal(ta.advantage, tb.advantage)
    d, bound = update_diff_at(runs[True], runs[False], 3)
    assert d <= bound, (d, bound)
