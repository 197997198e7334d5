"""Composition: weighted sum over the weighted components; raw components all kept."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.rewards.compose import compose


def test_hand_computed_total_and_unweighted_components_kept():
    # 1.0 * 1.0 + 0.5 * 0.0 + (-0.1) * 3.0 = 0.7 ; "rm" has no weight: kept, not summed
    r = compose({"task": 1.0, "format": 0.0, "cost": 3.0, "rm": 9.0}, {"task": 1.0, "format": 0.5, "cost": -0.1})
    assert r.total == pytest.approx(0.7)
    assert r.components == {"task": 1.0, "format": 0.0, "cost": 3.0, "rm": 9.0}
    assert r.weights == {"task": 1.0, "format": 0.5, "cost": -0.1}


def test_missing_weighted_component_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"\['format'\]"):
        compose({"task": 1.0}, {"task": 1.0, "format": 0.5})


def test_non_finite_values_are_errors():
    with pytest.raises(ValueError, match="component"):
        compose({"task": math.nan}, {"task": 1.0})
    with pytest.raises(ValueError, match="weight"):
        compose({"task": 1.0}, {"task": math.inf})


finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(st.dictionaries(st.sampled_from("abcde"), st.tuples(finite, finite), min_size=1), finite)
def test_total_is_linear_in_the_weights(cw, scale):
    comps = {k: c for k, (c, _) in cw.items()}
    w = {k: x for k, (_, x) in cw.items()}
    base = compose(comps, w).total
    scaled = compose(comps, {k: scale * x for k, x in w.items()}).total
    assert scaled == pytest.approx(scale * base, rel=1e-9, abs=1e-3)
