"""Answer extraction modes (reward.extract) on hand-written free-form responses; nothing readable is invalid."""

from __future__ import annotations

import pickle

import pytest

from posttrain.rewards.basic import ExactVerifier, IntegerVerifier
from posttrain.rewards.extract import EXTRACT_MODES, ExtractVerifier, extract_answer, with_extraction
from posttrain.rewards.math_answer import MathVerifier
from posttrain.trajectory import Status

REASONING = "First 12 + 30 = 42, then subtract 2: 40. So the result is 40."


@pytest.mark.parametrize("text, expected", [
    (REASONING, "40"),                                   # several numbers: the last
    ("we owe -7 dollars", "-7"),                         # negative
    ("pi is about 3.14", "3.14"),                        # decimal
    ("the total is 1,234,567 apples", "1234567"),        # thousands commas removed
    ("a ratio of 2/3", "2/3"),
    ("It is 42.", "42"),                                 # sentence period is not a decimal point
    ("no digits here", None),
])
def test_last_number(text, expected) -> None:
    assert extract_answer(text, "last_number") == expected


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),                       # nested braces
    (r"\boxed{1} then \boxed{{a}+\{b\}}", r"{a}+\{b\}"),               # the last one, nested
    (r"\boxed{ 7 } and 9 later", "7"),                                  # a later number does not count
    (r"\boxed{unclosed", None),
    (r"\boxed{}", None),                                                # empty is no answer
    ("Answer: 5", None),                                                # other formats are not read
])
def test_boxed(text, expected) -> None:
    assert extract_answer(text, "boxed") == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>3+5 is 8</think> <answer>8</answer>", "8"),
    ("<answer>1</answer> wait <ANSWER>\n -2 \n</ANSWER>", "-2"),        # last tag, case, multi-line
    ("<answer> </answer>", None),
    ("<answer>8", None),
    ("8", None),
])
def test_answer_tag(text, expected) -> None:
    assert extract_answer(text, "answer_tag") == expected


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown answer extraction 'xml'"):
        extract_answer("x", "xml")
    with pytest.raises(ValueError, match="reward.extract: unknown mode"):
        ExtractVerifier(IntegerVerifier(), "xml")


def test_extract_verifier_statuses_missing_is_invalid_not_wrong() -> None:
    v = ExtractVerifier(IntegerVerifier(), "answer_tag")
    assert v.name == "integer" and v.version.endswith("+extract=answer_tag")
    ok = v.verify("<think>5+3</think><answer>8</answer>", 8)
    assert ok.status is Status.CORRECT and ok.components == {"task": 1.0, "format": 1.0}
    bad = v.verify("<answer>9</answer>", 8)
    assert bad.status is Status.WRONG and bad.components["task"] == 0.0
    none = v.verify("the answer is 8", 8)  # a number, but not in the required format
    assert none.status is Status.INVALID and none.components == {"task": 0.0, "format": 0.0}
    assert "no answer found by extract=answer_tag" in none.explanation
    ln = ExtractVerifier(IntegerVerifier(), "last_number")
    assert ln.verify(REASONING, 40).status is Status.CORRECT
    assert ln.verify("I do not know", 40).status is Status.INVALID
    assert pickle.loads(pickle.dumps(ln)).verify("= 40", 40).status is Status.CORRECT  # pool workers


def test_exact_verifier_with_boxed() -> None:
    v = with_extraction(ExactVerifier(), "boxed")
    assert isinstance(v, ExtractVerifier)
    assert v.verify(r"the set is \boxed{\{1, 2\}}", r"\{1, 2\}").status is Status.CORRECT


def test_math_verifier_takes_the_mode_itself() -> None:
    pytest.importorskip("math_verify")
    m = with_extraction(MathVerifier(), "boxed")
    assert isinstance(m, MathVerifier) and m.extract == "boxed" and m.version == "1+extract=boxed"
    assert m.verify(r"so x = \boxed{\frac{1}{2}}", "0.5").status is Status.CORRECT
    assert m.verify(r"\boxed{\frac{1}{3}}", "0.5").status is Status.WRONG
    assert m.verify("0.5", "0.5").status is Status.INVALID  # no fast path: the format is required
    assert with_extraction(m, "auto").version == "1"
    assert MathVerifier().verify("0.5", "1/2").status is Status.CORRECT  # auto: unchanged behaviour
    with pytest.raises(ValueError, match="unknown extract"):
        MathVerifier(extract="nope")


def test_none_leaves_the_verifier_alone_and_modes_are_the_config_choices() -> None:
    v = IntegerVerifier()
    assert with_extraction(v, "none") is v
    from typing import get_args

    from posttrain.config import RewardConfig

    choices = set(get_args(RewardConfig.model_fields["extract"].annotation))
    assert choices == {"none", *EXTRACT_MODES}
