"""Collate to padded learner tensors and back."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.trajectory import collate, make_trajectory, uncollate, with_logprobs


def _traj(i, p, a, lp=None):
    return make_trajectory(
        traj_id=f"t{i}",
        prompt_id=f"p{i}",
        group_id="g",
        prompt_ids=list(range(10, 10 + p)),
        action_ids=list(range(50, 50 + a)),
        action_logprobs=lp if lp is not None else [-0.1 * (k + 1) for k in range(a)],
        action_versions=i,
        finish="truncated" if i % 2 else "terminal",
        meta={"answer": str(i)},
    )


def test_layout_is_right_padded_and_aligned():
    b = collate([_traj(0, 2, 1), _traj(1, 1, 3)], pad_token_id=0)
    assert b.input_ids.tolist() == [[10, 11, 50, 0], [10, 50, 51, 52]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert b.action_mask.tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert b.behavior_logprob[1].tolist() == [0.0, -0.1, -0.2, -0.30000000000000004]
    assert b.behavior_version.tolist() == [[-1, -1, 0, -1], [-1, 1, 1, 1]]
    assert b.lengths.tolist() == [3, 4]
    assert b.old_logprob is None


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=5))
def test_collate_uncollate_round_trip(shapes):
    trajs = [_traj(i, p, a) for i, (p, a) in enumerate(shapes)]
    assert uncollate(collate(trajs)) == trajs


def test_with_logprobs_freezes_masked_values():
    trajs = [_traj(0, 2, 2), _traj(1, 1, 1)]
    b = collate(trajs)
    values = torch.full(b.input_ids.shape, -0.7, dtype=torch.float64)
    out = with_logprobs(b, "old", values, version=5)
    assert out[0].old_logprob.tolist() == [0.0, 0.0, -0.7, -0.7]
    assert out[1].old_logprob.tolist() == [0.0, -0.7]
    assert all(t.old_version == 5 for t in out)
    b2 = collate(out)
    np.testing.assert_array_equal(b2.old_logprob.numpy(), (values * b.action_mask).numpy())
