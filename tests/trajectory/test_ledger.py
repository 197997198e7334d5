"""The Parquet ledger: lossless round trip, append-only, and crash safety."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow.parquet as pq
import pytest

from posttrain.trajectory import Finish, Ledger, Reward, Role, Status, Trajectory


def _rich_trajectory(i: int) -> Trajectory:
    roles = (Role.SYSTEM, Role.PROMPT, Role.ACTION, Role.OBSERVATION, Role.ACTION, Role.ACTION)
    mask = np.array([r is Role.ACTION for r in roles], dtype=np.int8)
    lp = np.where(mask, -np.array([0, 0, 1 / 3, 0, 2 / 7, 1e-300]), 0.0)
    return Trajectory(
        traj_id=f"t{i}",
        prompt_id="p",
        group_id="g1",
        token_ids=np.array([1, 2, 3, 4, 5, 6]) + i,
        roles=roles,
        action_mask=mask,
        behavior_logprob=lp,
        behavior_version=np.where(mask, [0, 0, 7, 0, 8, 8], -1),
        old_logprob=lp * 1.0000001,
        old_version=9,
        finish=Finish.PAUSED if i else Finish.TRUNCATED,
        status=Status.WRONG if i else Status.INFRA_ERROR,
        reward=Reward({"task": 0.0, "format": 1.0}, {"task": 1.0, "format": 0.1}, 0.1) if i else Reward(),
        verifier="math@0.9",
        env_seed=1234,
        snapshot_id="snap",
        sampling={"temperature": 0.7, "top_p": 1.0, "n": 4},
        rng_seed=99,
        timings={"rollout_s": 0.25},
        policy_lag=2,
        meta={"answer": "42", "difficulty": 3, "flag": True, "none": None},
    )


def test_round_trip_is_lossless(tmp_path):
    led = Ledger(tmp_path)
    trajs = [_rich_trajectory(0), _rich_trajectory(1)]
    led.write_trajectories(3, trajs)
    led.write_metrics(3, {"reward_mean": 0.5, "n": 2, "note": "x"})
    back = led.read_trajectories()
    assert back == trajs
    assert back[1].behavior_logprob[5] == -1e-300  # float64 preserved exactly
    assert back[1].meta["difficulty"] == 3 and back[1].meta["flag"] is True
    assert led.read_metrics() == [{"step": 3, "reward_mean": 0.5, "n": 2, "note": "x"}]
    # ordinary tools read the files directly
    table = pq.read_table(tmp_path / "trajectories" / "step_000003.parquet")
    assert table.column("status").to_pylist() == ["infra_error", "wrong"]
    assert table.column("reward_total").to_pylist() == [None, 0.1]


def test_append_only(tmp_path):
    led = Ledger(tmp_path)
    led.write_trajectories(1, [_rich_trajectory(1)])
    with pytest.raises(FileExistsError, match="append-only"):
        led.write_trajectories(1, [_rich_trajectory(1)])


def test_discard_after_moves_but_keeps_files(tmp_path):
    led = Ledger(tmp_path)
    for s in (1, 2, 3):
        led.write_trajectories(s, [_rich_trajectory(1)])
    moved = led.discard_after(1)
    assert led.steps() == [1] and len(moved) == 2 and all(p.exists() for p in moved)


def test_killed_writer_never_corrupts_the_ledger(tmp_path):
    """A writer SIGKILLed in the middle of a large step leaves earlier steps readable."""
    led = Ledger(tmp_path)
    led.write_trajectories(1, [_rich_trajectory(1)])
    # The child writes half of the Parquet bytes, flushes, reports, then waits to be killed:
    # a deterministic "killed in the middle of a write".
    script = textwrap.dedent(
        f"""
        import io, time
        import posttrain.trajectory.ledger as L
        real = L.pq.write_table
        def half_then_hang(table, fh, **kw):
            buf = io.BytesIO(); real(table, buf, **kw); data = buf.getvalue()
            fh.write(data[: len(data) // 2]); fh.flush()
            print("half", flush=True); time.sleep(600)
        L.pq.write_table = half_then_hang
        from posttrain.trajectory import make_trajectory
        big = [make_trajectory(traj_id=str(i), prompt_id="p", group_id="g", prompt_ids=[1],
               action_ids=list(range(2000)), action_logprobs=[-0.5] * 2000,
               action_versions=0, finish="terminal") for i in range(20)]
        L.Ledger({str(tmp_path)!r}).write_trajectories(2, big)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    names = [p.name for p in (tmp_path / "trajectories").iterdir()]
    assert any(".tmp-" in n for n in names), names  # the writer really died mid-write
    assert led.steps() == [1]  # the half-written step is invisible
    assert led.read_trajectories() == [_rich_trajectory(1)]
    led.write_trajectories(2, [_rich_trajectory(2)])  # and the step can be written again
    assert led.steps() == [1, 2]
