"""What the update saw, in the record and the ledger: ``current_logprob``, ``advantage``, the
evaluation-only verifier's verdict (issue 15) and a multi-turn episode's step record (issue 23);
ledgers written before these columns still load."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from posttrain.trajectory import Ledger, Status, TrajectoryError, collate, make_trajectory
from posttrain.trajectory.collate import with_update_record
from posttrain.trajectory.ledger import TRAJECTORY_SCHEMA, trajectory_to_row
from posttrain.trajectory.record import StepRecord

NEW_COLUMNS = ("current_logprob", "advantage", "hidden_verifier", "hidden_status", "step_anchors", "step_rewards",
               "step_action_tokens")


def _t(i: int, n_actions: int = 2, **rest):
    return make_trajectory(traj_id=f"t{i}", prompt_id="p", group_id="g", prompt_ids=[1, 2, 3],
                           action_ids=list(range(10, 10 + n_actions)), action_logprobs=[-0.5] * n_actions,
                           action_versions=0, finish="terminal", **rest)


def test_new_fields_round_trip_through_the_ledger(tmp_path):
    t = _t(0, current_logprob=[0, 0, 0, -0.25, -1 / 3], advantage=[0, 0, 0, 0.75, -1e-3],
           status="correct", verifier="exact@1", hidden_verifier="math@2", hidden_status="wrong")
    led = Ledger(tmp_path)
    led.write_trajectories(1, [t, _t(1)])
    back = led.read_trajectories()
    assert back[0] == t and back[1] == _t(1)
    assert back[0].current_logprob.tolist() == [0, 0, 0, -0.25, -1 / 3]
    assert back[0].hidden_status is Status.WRONG and back[1].advantage is None


def test_the_step_record_round_trips_through_the_ledger(tmp_path):
    steps = StepRecord(anchors=(7, -3), rewards=(0.0, 0.5), action_tokens=(1, 1))
    t = _t(0, steps=steps)
    led = Ledger(tmp_path)
    led.write_trajectories(1, [t, _t(1)])
    back = led.read_trajectories()
    assert back[0].steps == steps and back[1].steps is None


def test_a_ledger_written_before_the_new_columns_still_loads(tmp_path):
    old_schema = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name not in NEW_COLUMNS])
    rows = [{k: v for k, v in trajectory_to_row(_t(i)).items() if k not in NEW_COLUMNS} for i in range(2)]
    (tmp_path / "trajectories").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=old_schema), tmp_path / "trajectories" / "step_000001.parquet")
    back = Ledger(tmp_path).read_trajectories()
    assert [t.traj_id for t in back] == ["t0", "t1"]
    assert all(t.current_logprob is None and t.advantage is None and t.hidden_status is None and t.steps is None
               for t in back)


def test_with_update_record_masks_broadcasts_and_drops_unseen_rows():
    batch = collate([_t(0, 2), _t(1, 3)], pad_token_id=0)  # T = 6; row 0 has one padding position
    cur = torch.full((2, 6), -0.5, dtype=torch.float64)
    cur[0, 5] = float("nan")  # padding: must not mark the row unseen
    cur[1, 4] = float("nan")  # an action token never forwarded: the row records no current log-probs
    out = with_update_record(batch, cur, torch.tensor([2.0, -1.0], dtype=torch.float64))
    assert out[0].current_logprob.tolist() == [0, 0, 0, -0.5, -0.5]
    assert out[1].current_logprob is None
    assert out[0].advantage.tolist() == [0, 0, 0, 2.0, 2.0]
    assert out[1].advantage.tolist() == [0, 0, 0, -1.0, -1.0, -1.0]
    none = with_update_record(batch, None, torch.zeros(2, 6))
    assert all(t.current_logprob is None and t.advantage.tolist() == [0.0] * t.length for t in none)


@pytest.mark.parametrize("field, kw, match", [
    ("current_logprob", {"current_logprob": [0, 0, 0, 0.1, -1]}, "log-prob > 0"),
    ("advantage", {"advantage": [0, 0, 0, float("inf"), 1]}, "not finite"),
    ("advantage", {"advantage": [0, 1.0, 0, 1, 1]}, "0.0 on non-action"),
    ("hidden_verifier", {"hidden_status": "wrong"}, "without the verifier"),
    ("hidden_verifier", {"hidden_verifier": "noversion", "hidden_status": "wrong"}, "name@version"),
])
def test_bad_new_fields_are_refused_naming_the_field(field, kw, match):
    with pytest.raises(TrajectoryError, match=f"field '{field}'.*{match}"):
        _t(0, **kw)
    assert np.isfinite(_t(0, advantage=[0, 0, 0, -3.0, 5.0]).advantage).all()  # negative/positive both valid
