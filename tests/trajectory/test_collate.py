"""Collate to padded learner tensors and back."""


from posttrain.trajectory import collate, make_trajectory


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


