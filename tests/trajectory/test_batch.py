"""The one typed batch of an update step (issue 12): frozen log-probs and targets live on the
collated batch as tensors, and the records are rebuilt from it once, equal to the record round
trip (write the log-probs into each record, re-collate) that the test spells out itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.trajectory import TrajectoryBatch, TrajectoryError, collate, make_trajectory
from posttrain.trajectory.collate import with_update_record


def with_logprobs(batch: TrajectoryBatch, field: str, values: torch.Tensor, version: int) -> list:
    """The oracle: ``{field}_logprob`` written into each record (masked, float64, cut to its length)."""
    masked = (values.to(torch.float64) * batch.action_mask.to(torch.float64)).numpy()
    return [t.replace(**{f"{field}_logprob": masked[i, :n].copy(), f"{field}_version": version})
            for i, (t, n) in enumerate(zip(batch.trajectories, batch.lengths.tolist(), strict=True))]


def uncollate(batch: TrajectoryBatch) -> list:
    """The records with the coordinates the batch froze written back (the oracle of the rebuild)."""
    out = list(batch.trajectories)
    for field in ("old", "ref"):
        lp, version = getattr(batch, f"{field}_logprob"), getattr(batch, f"{field}_version")
        if lp is not None:
            out = with_logprobs(collate(out), field, lp, version)
    return out


def _traj(i: int, p: int, a: int):
    return make_trajectory(traj_id=f"t{i}", prompt_id=f"p{i}", group_id="g", prompt_ids=list(range(10, 10 + p)),
                           action_ids=list(range(50, 50 + a)), action_logprobs=[-0.1 * (k + 1) for k in range(a)],
                           action_versions=0, finish="terminal")


def _logprobs(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(shape, generator=g, dtype=torch.float64) * 5  # nonzero everywhere, padding too


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=5), st.integers(0, 1000))
def test_freeze_then_uncollate_equals_the_record_round_trip(shapes, seed):
    b = collate([_traj(i, p, a) for i, (p, a) in enumerate(shapes)])
    old, ref = _logprobs(tuple(b.input_ids.shape), seed), _logprobs(tuple(b.input_ids.shape), seed + 1)
    via_records = with_logprobs(collate(with_logprobs(b, "old", old, 3)), "ref", ref, 0)
    frozen = b.freeze("old", old, 3).freeze("ref", ref, 0)
    assert uncollate(frozen) == via_records
    # the tensors the learner reads equal what re-collating the records gave
    again = collate(via_records)
    assert torch.equal(frozen.old_logprob, again.old_logprob) and torch.equal(frozen.ref_logprob, again.ref_logprob)


def test_freeze_masks_records_the_version_and_leaves_the_input_batch_alone():
    b = collate([_traj(0, 2, 2), _traj(1, 1, 1)])
    f = b.freeze("old", torch.full(tuple(b.input_ids.shape), -0.7, dtype=torch.float32), version=5)
    assert f.old_logprob.dtype == torch.float64 and f.old_version == 5
    assert f.old_logprob.tolist() == [[0.0, 0.0, -0.699999988079071, -0.699999988079071], [0.0, -0.699999988079071, 0.0, 0.0]]
    assert b.old_logprob is None and b.old_version is None
    assert uncollate(b) == b.trajectories  # nothing frozen: the records as they are


def test_freeze_and_with_targets_refuse_bad_input():
    b = collate([_traj(0, 2, 2), _traj(1, 1, 1)])  # B=2, T=4
    with pytest.raises(ValueError, match="'old' or 'ref'"):
        b.freeze("behavior", torch.zeros(2, 4), 0)
    with pytest.raises(TrajectoryError, match=r"old_logprob has shape \(2, 3\)"):
        b.freeze("old", torch.zeros(2, 3), 0)
    with pytest.raises(TrajectoryError, match="final_values has shape"):
        b.with_targets(final_values=torch.zeros(2, 4))
    with pytest.raises(TypeError, match="unknown field 'old_logprob'"):
        b.with_targets(old_logprob=torch.zeros(2, 4))
    ok = b.with_targets(advantages=torch.ones(2), returns=torch.ones(2, 4), values=torch.zeros(2, 4),
                        final_values=torch.zeros(2))
    assert ok.advantages.shape == (2,) and b.advantages is None


def test_select_rows_carries_the_attached_tensors():
    b = collate([_traj(i, 2, i + 1) for i in range(3)]).freeze("old", _logprobs((3, 5), 0), 2)
    b = b.with_targets(advantages=torch.tensor([1.0, 2.0, 3.0]), final_values=torch.tensor([4.0, 5.0, 6.0]))
    s = b.select_rows([2, 0])
    assert s.advantages.tolist() == [3.0, 1.0] and s.final_values.tolist() == [6.0, 4.0]
    assert torch.equal(s.old_logprob, b.old_logprob[[2, 0]]) and s.old_version == 2
    assert [t.traj_id for t in uncollate(s)] == ["t2", "t0"]


def test_update_record_writes_the_frozen_coordinates_in_the_same_rebuild():
    b = collate([_traj(0, 2, 2), _traj(1, 1, 3)])
    shape = tuple(b.input_ids.shape)
    old, ref, cur = _logprobs(shape, 1), _logprobs(shape, 2), _logprobs(shape, 3)
    adv = torch.tensor([0.5, -0.5], dtype=torch.float64)
    f = b.freeze("old", old, 4).freeze("ref", ref, 0)
    got = with_update_record(f, cur, adv)
    want = with_update_record(collate(with_logprobs(collate(with_logprobs(b, "old", old, 4)), "ref", ref, 0)), cur, adv)
    assert got == want
    assert got[1].old_version == 4 and got[1].ref_version == 0
    np.testing.assert_array_equal(got[1].advantage, [0.0, -0.5, -0.5, -0.5])
