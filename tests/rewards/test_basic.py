"""String verifiers: status convention invalid (no answer) / wrong / correct, and components."""

import pytest

from posttrain.rewards import VERIFIERS, build_verifier
from posttrain.rewards.basic import (
    ChoiceVerifier,
    CombinedVerifier,
    ExactVerifier,
    FormatVerifier,
    IntegerVerifier,
    RegexVerifier,
)
from posttrain.trajectory import Status


@pytest.mark.parametrize(
    "resp, ref, status",
    [("46", 46, Status.CORRECT), (" 46\n", "46", Status.CORRECT), ("-3", -3, Status.CORRECT),
     ("47", 46, Status.WRONG), ("46.0", 46, Status.INVALID), ("forty", 46, Status.INVALID), ("", 1, Status.INVALID)],
)
def test_integer(resp, ref, status):
    v = IntegerVerifier().verify(resp, ref)
    assert v.status is status
    assert v.components == {"task": float(status is Status.CORRECT), "format": float(status is not Status.INVALID)}


def test_exact_normalisation_and_alternatives():
    assert ExactVerifier().verify("  Paris  France ", "Paris France").correct
    assert not ExactVerifier().verify("paris", "Paris").correct
    assert ExactVerifier(casefold=True).verify("paris", "Paris").correct
    assert ExactVerifier().verify("b", ["a", "b"]).correct
    assert ExactVerifier().verify("   ", "a").status is Status.INVALID


def test_regex_both_modes():
    v = RegexVerifier(pattern=r"ANSWER=(\w+)")
    assert v.verify("ANSWER=x then ANSWER=y", "y").correct  # the last match counts
    assert v.verify("ANSWER=x", "y").status is Status.WRONG
    assert v.verify("nothing", "y").status is Status.INVALID
    assert RegexVerifier().verify(" 2024-01-05 ", r"\d{4}-\d{2}-\d{2}").correct


@pytest.mark.parametrize(
    "resp, status",
    [("B", Status.CORRECT), ("(b)", Status.CORRECT), ("I think... Answer: B", Status.CORRECT),
     ("A or maybe C", Status.WRONG), ("none of these", Status.INVALID)],
)
def test_choice(resp, status):
    assert ChoiceVerifier().verify(resp, "B").status is status


def test_format_and_combine():
    fmt = FormatVerifier(pattern=r"\d+")
    assert fmt.verify("12", None).components == {"format": 1.0}
    assert fmt.verify("12!", None).status is Status.INVALID
    both = CombinedVerifier([ExactVerifier(), FormatVerifier(pattern=r"[a-z]+")])
    v = both.verify("abc", "abd")
    # status from the primary (exact: wrong); "format" from exact (1.0) wins over the format check
    assert v.status is Status.WRONG and v.components == {"task": 0.0, "format": 1.0}
    assert both.version == "exact-1+format-1"


def test_registry_builds_every_builtin_by_name():
    assert {"integer", "exact", "regex", "choice", "format", "combine", "math", "countdown", "code"} <= set(VERIFIERS)
    assert build_verifier("exact", casefold=True).verify("A", "a").correct
    with pytest.raises(KeyError, match="valid:"):
        build_verifier("nope")
