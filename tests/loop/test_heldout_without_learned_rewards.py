"""Held-out accuracy is the task verifier's, whatever ``reward.model`` / ``reward.judge`` do.

A run with a learned reward verified its single-turn held-out responses through the learned-reward path:
each was scored by the reward model or the judge (the score was reported nowhere), and a row the scorer
could not score became ``infra_error``, so a judge outage removed held-out problems from the accuracy (or
ended the run with "nothing could be judged"), while the episodes' held-out evaluation and ``posttrain
eval`` never scored them. The held-out evaluation now verifies with the verifier alone on every path.
"""

from __future__ import annotations

import dataclasses

from posttrain.evaluation.heldout import HeldoutRun
from posttrain.loop.builders import build_model
from posttrain.loop.heldout import evaluate_run
from posttrain.loop.validate import load_run_config
from posttrain.rewards.learned import ComponentScorer, LearnedRewards

CFG = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.max_new_tokens=2",
       "eval.size=6"]


def test_a_failing_learned_scorer_does_not_touch_the_heldout_verdicts() -> None:
    cfg = load_run_config(None, CFG)
    tok, model = build_model(cfg)
    hr = HeldoutRun.from_config(cfg, model, tok)
    scored: list[int] = []

    def down(prompts, responses):  # a judge that cannot be reached: no value for any row
        scored.append(len(responses))
        return ["judge unreachable"] * len(responses)

    try:
        plain = evaluate_run(hr)
        learned = dataclasses.replace(hr, verify_batch=LearnedRewards(hr.verify_batch, [ComponentScorer("judge", down)]))
        res = evaluate_run(learned)
    finally:
        hr.close()
    assert plain.infra_errors == 0 and plain.n == 6
    assert res.status_counts == plain.status_counts and res.accuracy == plain.accuracy  # the verifier's verdicts
    assert scored == []  # held-out responses are not sent to the scorer
