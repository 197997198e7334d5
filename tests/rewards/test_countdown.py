"""Countdown's safe evaluator and verifier: only + - * / on integers, numbers at most once."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.rewards.countdown import CountdownVerifier, ExpressionError, check_numbers, safe_evaluate
from posttrain.trajectory import Status


def test_hand_computed_values_and_used_numbers():
    assert safe_evaluate("(3+5)*2") == (Fraction(16), [3, 5, 2])
    assert safe_evaluate("8/4-1") == (Fraction(1), [8, 4, 1])


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os').system('true')", "Call"),
        ("x+1", "Name"),
        ("2**10", "Pow"),
        ("-3+5", "UnaryOp"),
        ("(1).real", "Attribute"),
        ("3/0", "division by zero"),
        ("7/2", "inexact"),
        ("1.5+1", "Constant"),
        ("(1+", "syntax"),
        ("1+" * 150 + "1", "longer than"),
    ],
)
def test_rejects_everything_else_with_a_reason(expr, why):
    with pytest.raises(ExpressionError, match=why):
        safe_evaluate(expr)


def test_numbers_multiset():
    assert check_numbers([3, 3], [3, 5]) is not None  # 3 used twice, given once
    assert check_numbers([3, 5], [5, 3, 2]) is None
    assert check_numbers([3, 5], [5, 3, 2], use_all=True) is not None


REF = {"numbers": [2, 3, 5], "target": 16}


@pytest.mark.parametrize(
    "resp, status",
    [("(3+5)*2", Status.CORRECT), ("(3+5)*2 = 16", Status.CORRECT), ("3+5+2", Status.WRONG),
     ("(5+3)*2*1", Status.WRONG), ("(3+3)*2", Status.WRONG), ("import os", Status.INVALID), ("", Status.INVALID)],
)
def test_verifier(resp, status):
    v = CountdownVerifier().verify(resp, REF)
    assert v.status is status, v.explanation


@st.composite
def expr_trees(draw, depth=3):
    if depth == 0 or draw(st.booleans()):
        n = draw(st.integers(0, 20))
        return str(n), Fraction(n)
    (ls, lv), (rs, rv) = draw(expr_trees(depth=depth - 1)), draw(expr_trees(depth=depth - 1))
    op = draw(st.sampled_from("+-*/"))
    if op == "/" and (rv == 0 or (lv / rv).denominator != 1):
        op = "+"
    val = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if op == "/" else None}[op]
    return f"({ls}{op}{rs})", val


@given(expr_trees())
def test_agrees_with_exact_fraction_arithmetic(tree):
    text, value = tree
    assert safe_evaluate(text)[0] == value
