"""math verifier: extraction + math-verify equivalence, with math-verify's alarms disabled."""

import threading

import pytest

from posttrain.rewards.math_answer import MathVerifier
from posttrain.trajectory import Status

V = MathVerifier()


@pytest.mark.parametrize(
    "resp, gold, status",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5", Status.CORRECT),
        ("Answer: 3/4", r"\frac{3}{4}", Status.CORRECT),
        (r"\boxed{[1,2)}", "[1,2)", Status.CORRECT),
        (r"\boxed{(1,2]}", "[1,2)", Status.WRONG),
        (r"\boxed{\{1,2\}}", r"\{2,1\}", Status.CORRECT),
        ("I get 7, no wait, 8", "8", Status.CORRECT),
        ("I get 7", "8", Status.WRONG),
        ("46", "46", Status.CORRECT),
        ("no number here", "3", Status.INVALID),
    ],
)
def test_equivalences(resp, gold, status):
    v = V.verify(resp, gold)
    assert v.status is status, v.explanation
    assert v.components["format"] == float(status is not Status.INVALID)


def test_integer_fast_path_is_named_in_the_explanation():
    assert "fast path" in V.verify("12", 12).explanation


def test_works_outside_the_main_thread():
    # math-verify's signal.alarm would raise ValueError in a thread; our call disables it.
    out = []
    t = threading.Thread(target=lambda: out.append(V.verify(r"\boxed{0.25}", r"\frac{1}{4}")))
    t.start()
    t.join(60)
    assert out and out[0].status is Status.CORRECT
