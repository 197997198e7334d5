"""Shaping components: DAPO overlong and effort penalties as their own components."""

import pytest

from posttrain.rewards.shaping import add_components, effort_components, overlong_components
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.trajectory import Status


def test_overlong_hand_computed():
    # L_max=10, L_cache=4: soft start at 6. L=5 -> 0; L=8 -> (6-8)/4 = -0.5; L=10 -> -1.0; L=12 -> -1
    assert overlong_components([5, 8, 10, 12], 10, 4) == [
        {"overlong": 0.0}, {"overlong": -0.5}, {"overlong": -1.0}, {"overlong": -1.0}]


def test_effort_hand_computed():
    # tau * b = 1.5 * 4 = 6 : 6 is not over, 7 is
    assert effort_components([6, 7], [4, 4], 1.5) == [{"effort": 0.0}, {"effort": -1.0}]


def test_add_components_keeps_task_and_skips_infra():
    vs = [Verdict(Status.CORRECT, {"task": 1.0}), infra_error("x")]
    out = add_components(vs, overlong_components([8, 8], 10, 4))
    assert out[0].components == {"task": 1.0, "overlong": -0.5} and out[1] is vs[1]
    with pytest.raises(ValueError, match="already"):
        add_components([out[0]], [{"overlong": 0.0}])
