"""Token-budget micro-batching, row slicing and the mini-batch shuffle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.learner.microbatch import minibatch_rows, split_by_token_budget, take_rows


def test_hand_example():
    # lengths 5, 3, 8, 2 with budget 10: sorted by length desc -> 2(8), 0(5), 1(3), 3(2).
    # [2]: 8 (2 rows would be 16 > 10); [0, 1]: 2*5 = 10 <= 10, adding a third -> 15 > 10; [3].
    assert split_by_token_budget([5, 3, 8, 2], 10) == [[2], [0, 1], [3]]
    # A row longer than the budget runs alone.
    assert split_by_token_budget([50, 1, 1], 10) == [[0], [1, 2]]
    assert split_by_token_budget([4, 4, 4, 4, 4], 100, max_rows=2) == [[0, 1], [2, 3], [4]]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    budget=st.integers(1, 200),
    max_rows=st.one_of(st.none(), st.integers(1, 8)),
)
def test_partition_within_budget(lengths, budget, max_rows):
    groups = split_by_token_budget(lengths, budget, max_rows=max_rows)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))  # a partition
    for g in groups:
        assert g == sorted(g)
        width = max(max(lengths[i] for i in g), 1)
        assert len(g) == 1 or len(g) * width <= budget
        assert max_rows is None or len(g) <= max_rows
    assert groups == split_by_token_budget(list(lengths), budget, max_rows=max_rows)  # deterministic


def test_bad_budget():
    with pytest.raises(ValueError, match="budget"):
        split_by_token_budget([1, 2], 0)
    with pytest.raises(ValueError, match="row 1"):
        split_by_token_budget([1, -2], 5)


def test_take_rows_trims_columns():
    x = torch.arange(12).reshape(3, 4)
    out = take_rows({"x": x, "n": torch.tensor([7, 8, 9]), "none": None}, [2, 0], width=2)
    assert out["x"].tolist() == [[8, 9], [0, 1]]
    assert out["n"].tolist() == [9, 7]
    assert out["none"] is None


def test_minibatch_rows_partition_and_resume():
    g = torch.Generator().manual_seed(3)
    parts = minibatch_rows(10, 3, g)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert sorted(len(p) for p in parts) == [3, 3, 4]
    # The generator state is all the shuffle depends on: saving it resumes the sequence.
    state = g.get_state()
    nxt = minibatch_rows(10, 3, g)
    g2 = torch.Generator()
    g2.set_state(state)
    assert minibatch_rows(10, 3, g2) == nxt
    with pytest.raises(ValueError, match="num_minibatches"):
        minibatch_rows(2, 3, g)
