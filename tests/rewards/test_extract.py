"""Final-answer extraction: boxed > answer line > last number."""

import pytest

from posttrain.rewards.extract import (
    extract_answer_line,
    extract_boxed,
    extract_final_answer,
    extract_last_number,
    parse_integer,
)


def test_boxed_takes_the_last_one_with_balanced_braces():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_boxed("nothing") is None


def test_answer_line_and_last_number():
    assert extract_answer_line("work...\nAnswer: 42.\n") == "42"
    assert extract_answer_line("final answer = x+1") == "x+1"
    assert extract_last_number("it is 1,024 or -3.5 or 2/3 maybe") == "2/3"
    assert extract_last_number("1,024 apples") == "1024"


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{7}. Answer: 8", ("7", "boxed")),
        ("steps 3 4\nanswer: 8", ("8", "answer_line")),
        ("3 then 4", ("4", "last_number")),
        ("no digits", (None, "none")),
    ],
)
def test_final_answer_order(text, expected):
    assert extract_final_answer(text) == expected


def test_parse_integer_is_strict():
    assert parse_integer(" -12\n") == -12 and parse_integer("+3") == 3
    assert parse_integer("12a") is None and parse_integer("1 2") is None and parse_integer("") is None
