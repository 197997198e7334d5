"""The request queue: a model's jobs run in seq_id order, sampling jobs of one sampler batch, waits are bounded."""

from __future__ import annotations

import time

import pytest

from posttrain.errors import UserError
from posttrain.serve.futures import FutureTable, Job, JobQueue, Outcome


def _job(rid: str, key: str | None = None, seq: int | None = None, batch: str | None = None) -> Job:
    return Job(rid, lambda: Outcome(b""), order_key=key, seq=seq, batch_key=batch,
               batch_work=(lambda jobs: [Outcome(b"")] * len(jobs)) if batch else None)


def test_a_models_jobs_run_in_seq_order_whatever_the_arrival_order() -> None:
    q = JobQueue()
    q.open_order("m", 1)
    q.submit(_job("optim", "m", 2))  # arrives before the forward_backward it follows
    assert q.take(0.05) == []  # seq 1 has not arrived: nothing of m may run
    q.submit(_job("fb", "m", 1))
    q.submit(_job("other"))
    assert [j.request_id for j in q.take(0.05)] == ["fb"]
    assert [j.request_id for j in q.take(0.05)] == ["optim"]
    assert [j.request_id for j in q.take(0.05)] == ["other"]
    with pytest.raises(UserError, match="already used"):
        q.submit(_job("again", "m", 2))
    with pytest.raises(UserError, match="unknown model"):
        q.submit(_job("x", "nope", 1))


def test_sampling_jobs_of_one_sampler_are_taken_together() -> None:
    q = JobQueue()
    for rid, b in [("a", "s1"), ("b", "s2"), ("c", "s1")]:
        q.submit(_job(rid, batch=b))
    assert [j.request_id for j in q.take(0.05)] == ["a", "c"]
    assert [j.request_id for j in q.take(0.05)] == ["b"]


def test_waits_are_bounded() -> None:
    t = FutureTable()
    t.add("r")
    t0 = time.monotonic()
    assert t.wait("r", 0.1) is None  # still pending: the client is told to try again
    assert time.monotonic() - t0 < 2.0
    t.resolve("r", Outcome(b"x"))
    assert t.wait("r", 0.1) == Outcome(b"x")
    with pytest.raises(KeyError):
        t.wait("unknown", 0.1)
    q = JobQueue()
    q.close()
    assert q.take(5.0) == []  # a closed queue returns at once


def test_clients_take_turns() -> None:
    """Round-robin over clients: a client with a long queue delays another by one job, not by its queue."""
    q = JobQueue()
    for i in range(3):
        q.submit(Job(f"a{i}", lambda: Outcome(b""), client="A"))
    q.submit(Job("b0", lambda: Outcome(b""), client="B"))
    q.submit(Job("b1", lambda: Outcome(b""), client="B"))
    order = [q.take(0.05)[0].request_id for _ in range(5)]
    assert order == ["a0", "b0", "a1", "b1", "a2"]


def test_a_missing_seq_id_holds_a_model_for_gap_s_only() -> None:
    q = JobQueue(gap_s=0.2)
    q.open_order("m", 1)
    q.submit(_job("second", "m", 2))  # seq 1 never arrives (the client failed before sending it)
    assert q.take(0.05) == []
    t0 = time.monotonic()
    assert [j.request_id for j in q.take(5.0)] == ["second"]
    assert 0.1 < time.monotonic() - t0 < 2.0
    with pytest.raises(UserError, match="already used"):
        q.submit(_job("late", "m", 1))


def test_dropped_jobs_leave_the_queue_and_their_seq_ids_count_as_used() -> None:
    q = JobQueue()
    q.open_order("m", 1)
    for rid, seq in [("fb", 1), ("opt", 2)]:
        q.submit(Job(rid, lambda: Outcome(b""), order_key="m", seq=seq, client="A"))
    q.submit(Job("s", lambda: Outcome(b""), client="B"))
    assert [j.request_id for j in q.drop(lambda j: j.client != "A")] == ["fb", "opt"]
    assert len(q) == 1 and [j.request_id for j in q.take(0.05)] == ["s"]
    q.submit(Job("next", lambda: Outcome(b""), order_key="m", seq=3, client="A"))
    assert [j.request_id for j in q.take(0.05)] == ["next"]  # runs at once: 1 and 2 were consumed
