"""``optim.share_prompts`` in a run: each group's prompt forwarded once, and the run records the same samples and
log-probs and ends on the same weights as the padded forward (up to float rounding)."""

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
         "sampling.prompts_per_step=4", "sampling.group_size=4", "sampling.max_new_tokens=3", "optim.lr=1e-2",
         "eval.size=8", "eval.every=100", "logging.progress=false", "steps=3", "checkpoint_every=3"]


def test_shared_prompts_record_the_same_and_end_on_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # flaky_task: reward = first token is a digit
    runs = train_each(tmp_path, SMALL, "optim.share_prompts", (True, False))
    a, b = (Ledger(runs[s] / "ledger").read_trajectories() for s in (True, False))
    assert len(a) == len(b) == 3 * 16
    tol = shape_rtol(64) * 10  # float32 micro model, |log-prob| <= 10 (as in test_no_signal_rows_run)
    for ta, tb in zip(a, b, strict=True):
        assert ta.token_ids.tolist() == tb.token_ids.tolist()
        np.testing.assert_allclose(ta.old_logprob, tb.old_logprob, rtol=0, atol=tol)
        np.testing.assert_allclose(ta.current_logprob, tb.current_logprob, rtol=0, atol=tol)
        np.testing.assert_array_equal(ta.advantage, tb.advantage)
    d, bound = update_diff_at(runs[True], runs[False], 3)
    assert d <= bound, (d, bound)
