"""Learned reward vs verifier agreement, by hand."""

from __future__ import annotations

import pytest

from posttrain.diagnostics.learned_reward import learned_agreement, learned_component_names
from posttrain.trajectory import Reward, Status, make_trajectory


def _t(i: int, group: str, status: Status, rm: float | None):
    comps = {"task": float(status is Status.CORRECT)} | ({} if rm is None else {"rm": rm})
    reward = Reward(components={}, weights={"task": 1.0}, total=None) if status is Status.INFRA_ERROR else \
        Reward(components=comps, weights={"task": 1.0}, total=comps["task"])
    return make_trajectory(traj_id=f"t{i}", prompt_id=group, group_id=group, prompt_ids=[5], action_ids=[6],
                           action_logprobs=[-1.0], action_versions=0, finish="terminal", status=status, reward=reward)


def test_agreement_by_hand() -> None:
    trajs = [
        # group a: correct 2.0 vs wrong 1.0 (agree), vs invalid 2.0 (tie: 1/2)
        _t(0, "a", Status.CORRECT, 2.0), _t(1, "a", Status.WRONG, 1.0), _t(2, "a", Status.INVALID, 2.0),
        # group b: correct 0.0 vs wrong 3.0 (disagree); an infra_error row is left out
        _t(3, "b", Status.CORRECT, 0.0), _t(4, "b", Status.WRONG, 3.0), _t(5, "b", Status.INFRA_ERROR, None),
        # group c: all wrong -> no pair; a row without the component is left out
        _t(6, "c", Status.WRONG, 5.0), _t(7, "c", Status.WRONG, None),
    ]
    a = learned_agreement(trajs, "rm")
    assert a.n == 6 and a.pairs == 3
    assert a.pairwise_agreement == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert a.mean_correct == pytest.approx(1.0) and a.mean_other == pytest.approx((1.0 + 2.0 + 3.0 + 5.0) / 4)
    assert "0.500 of 3" in a.lines()[1]
    none = learned_agreement(trajs, "judge")
    assert (none.n, none.pairs, none.pairwise_agreement, none.mean_correct) == (0, 0, None, None)
    assert "n/a" in none.lines()[0]


def test_component_names_from_a_saved_config() -> None:
    assert learned_component_names({"reward": {"model": None, "judge": None}}) == []
    assert learned_component_names({"reward": {"model": {"path": "x", "name": "rm"},
                                               "judge": {"url": "u", "name": "j2"}}}) == ["rm", "j2"]
    assert learned_component_names({}) == []
