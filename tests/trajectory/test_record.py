"""Validation of the trajectory record: errors name the trajectory and the field."""

import numpy as np
import pytest

from posttrain.trajectory import Finish, Reward, Role, Status, Trajectory, TrajectoryError, make_trajectory


def _traj(**kw):
    base = dict(
        traj_id="t0",
        prompt_id="p0",
        group_id="g0",
        prompt_ids=[5, 6, 7],
        action_ids=[8, 9],
        action_logprobs=[-0.5, -1.25],
        action_versions=[3, 4],
        finish="terminal",
    )
    base.update(kw)
    return make_trajectory(**base)


def test_make_trajectory_fills_masks_roles_and_versions():
    t = _traj()
    assert t.length == 5 and t.num_actions == 2 and t.prompt_length == 3
    assert t.action_mask.tolist() == [0, 0, 0, 1, 1]
    assert t.roles == (Role.PROMPT,) * 3 + (Role.ACTION,) * 2
    assert t.behavior_logprob.tolist() == [0.0, 0.0, 0.0, -0.5, -1.25]
    assert t.behavior_version.tolist() == [-1, -1, -1, 3, 4]
    assert t.version_span == 1
    assert t.finish is Finish.TERMINAL


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(action_logprobs=[-0.5, 0.1]), "behavior_logprob"),
        (dict(action_logprobs=[-0.5, float("nan")]), "behavior_logprob"),
        (dict(action_logprobs=[-0.5, float("-inf")]), "behavior_logprob"),
        (dict(action_versions=[-2, 0]), "behavior_version"),
        (dict(action_logprobs=[-0.5]), "behavior_logprob"),
    ],
)
def test_bad_per_token_values_name_the_field(change, field):
    with pytest.raises(TrajectoryError, match=rf"'t0'.*'{field}'"):
        _traj(**change)


def test_mask_must_agree_with_roles_and_be_binary():
    t = _traj()
    with pytest.raises(TrajectoryError, match="action_mask"):
        t.replace(action_mask=np.array([0, 0, 1, 1, 1]))
    with pytest.raises(TrajectoryError, match="action_mask"):
        t.replace(action_mask=np.array([0, 0, 0, 1, 2]))
    with pytest.raises(TrajectoryError, match="roles"):
        t.replace(roles=(Role.PROMPT,) * 4)


def test_observation_tokens_never_carry_logprobs():
    t = _traj()
    roles = (Role.PROMPT, Role.PROMPT, Role.PROMPT, Role.ACTION, Role.OBSERVATION)
    with pytest.raises(TrajectoryError, match="non-action"):
        t.replace(roles=roles, action_mask=np.array([0, 0, 0, 1, 0]))


def test_enums_and_infra_error_rules():
    with pytest.raises(ValueError):
        _traj(status="great")
    with pytest.raises(ValueError):
        _traj(finish="done")
    # infra_error never carries a reward, not even zero
    with pytest.raises(TrajectoryError, match="reward.total"):
        _traj(status=Status.INFRA_ERROR, reward=Reward({"task": 0.0}, {"task": 1.0}, 0.0))
    ok = _traj(status=Status.INFRA_ERROR)
    assert ok.reward.total is None
    with pytest.raises(TrajectoryError, match="verifier"):
        _traj(verifier="math")


def test_old_logprob_requires_version_and_records_are_immutable():
    t = _traj()
    with pytest.raises(TrajectoryError, match="old_version"):
        t.replace(old_logprob=np.array([0, 0, 0, -0.4, -1.0]))
    t2 = t.replace(old_logprob=np.array([0, 0, 0, -0.4, -1.0]), old_version=4)
    assert t2.old_version == 4 and t.old_logprob is None
    with pytest.raises(ValueError):
        t2.token_ids[0] = 3  # arrays are read-only


def test_equality_compares_arrays():
    assert _traj() == _traj()
    assert _traj() != _traj(action_logprobs=[-0.5, -1.0])
    assert isinstance(_traj(), Trajectory)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(old_logprob=[0, 0, 0, -0.4, 0.2], old_version=1), "old_logprob"),  # a log-prob > 0
        (dict(current_logprob=[0, 0, 0, -0.4, float("nan")]), "current_logprob"),
        (dict(ref_logprob=[0, -0.1, 0, -0.4, -1.0], ref_version=0), "ref_logprob"),  # non-zero off the actions
        (dict(advantage=[0.0, 0.0, 0.5]), "advantage"),  # wrong length
        (dict(behavior_logprob=[0, 0, 0, -0.4, 0.3]), "behavior_logprob"),
        (dict(ref_logprob=[0, 0, 0, -0.4, -1.0]), "ref_version"),
        (dict(status=Status.INFRA_ERROR, reward=Reward({"task": 0.0}, {"task": 1.0}, 0.0)), "reward.total"),
        (dict(reward=Reward({"task": 1.0}, {"task": 1.0}, float("inf"))), "reward.total"),
        (dict(verifier="math"), "verifier"),
        (dict(hidden_status=Status.CORRECT), "hidden_verifier"),
    ],
)
def test_replace_checks_what_it_changes(change, field):
    """replace() skips re-checking the unchanged token structure, never the changed fields."""
    with pytest.raises(TrajectoryError, match=rf"'t0'.*'{field}'"):
        _traj().replace(**change)


def test_replace_equals_a_fresh_construction():
    import dataclasses

    t = _traj(status=Status.CORRECT, verifier="v@1")
    kw = dict(old_logprob=[0, 0, 0, -0.4, -1.0], old_version=2, advantage=[0, 0, 0, 0.5, 0.5], status="wrong",
              current_logprob=np.array([0, 0, 0, -0.3, -1.1]), policy_lag=1)
    fast, full = t.replace(**kw), dataclasses.replace(t, **kw)
    assert fast == full and type(fast) is Trajectory
    assert fast.status is Status.WRONG and fast.old_logprob.dtype == np.float64
    with pytest.raises(ValueError):
        fast.advantage[3] = 1.0  # converted arrays are read-only too
    assert t.old_logprob is None and t.status is Status.CORRECT  # the original is untouched
    with pytest.raises(TypeError):
        t.replace(no_such_field=1)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(prompt_ids=[], action_ids=[], action_logprobs=[], action_versions=[]), "token_ids"),
        (dict(prompt_ids=[[5, 6], [7, 8]], action_ids=[], action_logprobs=[], action_versions=[]), "token_ids"),
        (dict(action_versions=[3]), "behavior_version"),  # one version for two actions
        (dict(action_versions=-1), "behavior_version"),
        (dict(old_logprob=[0, 0, 0, -0.4, 0.5], old_version=0), "old_logprob"),
        (dict(current_logprob=[0, 0.1, 0, -0.4, -0.5]), "current_logprob"),
        (dict(status=Status.INFRA_ERROR, reward=Reward({"task": 0.0}, {"task": 1.0}, 0.0)), "reward.total"),
    ],
)
def test_make_trajectory_checks_what_the_caller_supplies(change, field):
    """make_trajectory lays out the token structure itself; every value the caller gives is still checked."""
    with pytest.raises(TrajectoryError, match=rf"'t0'.*'{field}'"):
        _traj(**change)


def test_make_trajectory_equals_the_checked_construction():
    import dataclasses

    t = _traj(old_logprob=[0, 0, 0, -0.4, -1.0], old_version=2, status="correct", verifier="v@1")
    full = dataclasses.replace(t)  # a plain construction: every check, role conversion included
    assert t == full and all(isinstance(r, Role) for r in t.roles)
    with pytest.raises(TypeError):
        _traj(roles=(Role.PROMPT,) * 5)
