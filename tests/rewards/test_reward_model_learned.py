"""Learned components in the guarded verification path: scores added beside the verifier's, failures honest."""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.config.feedback import RewardConfig
from posttrain.errors import UserError
from posttrain.rewards import VerifierPool, build_verifier
from posttrain.rewards.learned import ComponentScorer, LearnedRewards, add_component, build_learned_rewards
from posttrain.rewards.scoring import PromptedVerifyBatch, judge
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.trajectory import Status


@dataclasses.dataclass(frozen=True)
class Ex:
    prompt_id: str
    prompt: str
    reference: object
    meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Comp:
    token_ids: list[int]


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def length_scorer(prompts, responses):
    """Hand-checkable: score = len(prompt) + 10 * len(response); a response 'boom' cannot be scored."""
    return ["scorer failed on 'boom'" if r == "boom" else len(p) + 10.0 * len(r)
            for p, r in zip(prompts, responses, strict=True)]


def test_add_component_by_hand() -> None:
    vs = [Verdict(Status.CORRECT, {"task": 1.0}, "ok"), infra_error("pool died"), Verdict(Status.WRONG, {"task": 0.0}),
          Verdict(Status.WRONG, {"task": 0.0}, "wrong 7")]
    seen = []

    def scorer(p, r):
        seen.append((list(p), list(r)))
        return length_scorer(p, r)

    out = add_component(vs, ["ab", "x", "abc", "a"], ["1", "2", "22", "boom"], "rm", scorer)
    assert seen == [(["ab", "abc", "a"], ["1", "22", "boom"])]  # the infra_error row is not scored
    assert out[0] == Verdict(Status.CORRECT, {"task": 1.0, "rm": 12.0}, "ok")
    assert out[1] is vs[1]
    assert out[2].components == {"task": 0.0, "rm": 23.0} and out[2].status is Status.WRONG
    assert out[3].status is Status.INFRA_ERROR and not out[3].components  # no reward, never rm = 0
    assert "scorer failed on 'boom'" in out[3].explanation and "wrong: wrong 7" in out[3].explanation
    with pytest.raises(ValueError, match="already in the verdict"):
        add_component(out[:1], ["a"], ["b"], "rm", length_scorer)
    with pytest.raises(ValueError, match="returned 0 values for 1 rows"):
        add_component(vs[:1], ["a"], ["b"], "rm", lambda p, r: [])


def test_scoring_judge_hands_the_prompts_to_the_wrapped_pool_path() -> None:
    pool = VerifierPool(workers=0, timeout_s=5.0)
    wrapped = LearnedRewards(pool.verify_batch, [ComponentScorer("rm", length_scorer)])
    assert isinstance(wrapped, PromptedVerifyBatch) and not isinstance(pool.verify_batch, PromptedVerifyBatch)
    verifier = build_verifier("integer")
    exs = [Ex("p0", "1+1=", 2), Ex("p1", "2+2=", 4), Ex("p2", "3+3=", 6)]
    comps = [Comp([ord("2")]), Comp([ord("5")]), Comp([ord(c) for c in "boom"])]
    texts, verdicts = judge(comps, exs, verifier=verifier, tokenizer=Tok(), verify_batch=wrapped)
    assert texts == ["2", "5", "boom"]
    assert verdicts[0].status is Status.CORRECT and verdicts[0].components == {"task": 1.0, "format": 1.0, "rm": 14.0}
    assert verdicts[1].status is Status.WRONG and verdicts[1].components["rm"] == 14.0
    assert verdicts[2].status is Status.INFRA_ERROR
    # without prompts (a hidden verifier re-judging): the pool's verdicts, nothing added
    plain = wrapped([(verifier, "2", 2, {})])
    assert "rm" not in plain[0].components
    pool.close()


def test_build_learned_rewards_is_the_inner_path_without_learned_keys() -> None:
    def inner(items):
        return []

    assert build_learned_rewards(RewardConfig(), inner) is inner
    with pytest.raises(UserError, match="no such model directory"):
        build_learned_rewards(RewardConfig(model={"path": "/nonexistent/reward_model"}), inner)
    wrapped = build_learned_rewards(RewardConfig(judge={"url": "http://127.0.0.1:9"}), inner)
    assert isinstance(wrapped, LearnedRewards) and [c.name for c in wrapped.components] == ["judge"]
