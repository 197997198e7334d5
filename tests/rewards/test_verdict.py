"""Verdict validation: statuses, finite components, no reward on infra errors."""

import pytest

from posttrain.rewards.verdict import Verdict, graded, infra_error
from posttrain.trajectory import Status


def test_status_is_coerced_and_components_copied():
    comps = {"task": 1.0}
    v = Verdict("correct", comps, "ok")
    comps["task"] = 0.0
    assert v.status is Status.CORRECT and v.components == {"task": 1.0} and v.correct


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_component_is_an_error(bad):
    with pytest.raises(ValueError, match="'task'"):
        Verdict(Status.WRONG, {"task": bad})


def test_infra_error_carries_no_components():
    assert infra_error("pool died").components == {}
    with pytest.raises(ValueError, match="never a zero"):
        Verdict(Status.INFRA_ERROR, {"task": 0.0})


def test_graded_sets_task_and_status():
    assert graded(True).components == {"task": 1.0} and graded(True).status is Status.CORRECT
    w = graded(False, status_if_wrong=Status.INVALID, extra={"format": 0.0})
    assert w.status is Status.INVALID and w.components == {"task": 0.0, "format": 0.0}
