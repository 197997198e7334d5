"""Hash split and rejection sampling shared by the procedural tasks."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.envs.task import TaskExample, check_split, resolve_verifier, sample_split, split_of
from posttrain.rewards.basic import ExactVerifier


@given(st.text(min_size=1, max_size=30))
def test_split_of_is_a_pure_function_of_the_key(key):
    assert split_of(key, 0.1) == split_of(key, 0.1) in ("train", "heldout")


def test_split_fraction_is_roughly_respected():
    keys = [f"k{i}" for i in range(20000)]
    frac = sum(split_of(k, 0.1) == "heldout" for k in keys) / len(keys)
    assert 0.09 < frac < 0.11  # binomial sd = sqrt(0.09/20000) ~ 0.002


def test_split_is_monotone_in_the_fraction():
    # raising the held-out fraction only moves problems train -> heldout, never back
    keys = [f"k{i}" for i in range(2000)]
    assert {k for k in keys if split_of(k, 0.1) == "heldout"} <= {k for k in keys if split_of(k, 0.3) == "heldout"}


def _draw_digit(rng: random.Random):
    d = rng.randrange(10)
    return str(d), TaskExample(prompt_id=str(d), prompt=f"{d}=", reference=d)


def test_small_space_fills_with_repeats_after_exhausting_unique_problems():
    held = [str(d) for d in range(10) if split_of(f"digits|{d}", 0.5) == "heldout"]
    out = sample_split("digits", "heldout", 25, 0, _draw_digit, 0.5)
    assert len(out) == 25 and {e.prompt_id for e in out} == set(held)
    assert len({e.prompt_id for e in out[: len(held)]}) == len(held)  # unique first


def test_bad_arguments():
    with pytest.raises(ValueError, match="valid: train, heldout"):
        check_split("test")
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_of("x", 1.0)
    with pytest.raises(ValueError, match="needs a 'name'"):
        resolve_verifier({"casefold": True})
    assert resolve_verifier({"name": "exact", "casefold": True}) == ExactVerifier(casefold=True)
