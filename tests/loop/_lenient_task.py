"""A test task whose training verifier passes every response: a reward the policy cannot fail, so an
evaluation-only verifier (eval.hidden_verifier) has passed trajectories to disagree with."""

from __future__ import annotations

import dataclasses

from posttrain.envs.chain_sum import ChainSumTask
from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status


class PassEverything:
    """Marks every response correct (reward 1): a hackable reward by construction."""

    name = "pass_everything"
    version = "1"

    def verify(self, response: str, reference: object, **context: object) -> Verdict:
        return Verdict(status=Status.CORRECT, components={"task": 1.0}, explanation="anything goes")


def lenient(**kwargs: object) -> ChainSumTask:
    """chain_sum prompts, every answer rewarded."""
    return dataclasses.replace(ChainSumTask(**kwargs), verifier=PassEverything())  # type: ignore[arg-type]
