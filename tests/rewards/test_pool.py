"""VerifierPool: per-call time limits, retries, crashes -> infra_error (never a zero reward)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from _verifiers_for_tests import (
    Crashes,
    Echo,
    Exits,
    FailsOnce,
    HangsBlockingAlarm,
    NotAVerdict,
    OnThread,
    Raises,
    Sleeps,
    Spins,
)

from posttrain.rewards import VerifierPool
from posttrain.rewards.basic import IntegerVerifier
from posttrain.trajectory import Status


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=1.0, retries=1, grace_s=1.0) as p:
        yield p


def test_results_come_back_in_order_from_several_workers(pool):
    items = [(Echo(), str(i), str(i if i % 3 else -1), {}) for i in range(12)]
    out = pool.verify_batch(items)
    assert [v.status for v in out] == [Status.WRONG if i % 3 == 0 else Status.CORRECT for i in range(12)]
    assert all(v.explanation.startswith("pid ") for v in out)  # verified in a worker process
    assert {v.explanation for v in out}.isdisjoint({f"pid {__import__('os').getpid()}"})


def test_builtin_verifiers_run_in_workers(pool):
    out = pool.verify_batch([(IntegerVerifier(), "46", 46, {}), (IntegerVerifier(), "x", 46, {})])
    assert [v.status for v in out] == [Status.CORRECT, Status.INVALID]


def test_exception_is_retried_then_infra_error_with_no_components(pool):
    before = dict(pool.counts)
    out = pool.verify_batch([(Raises(), "a", "a", {}), (Echo(), "b", "b", {})])
    assert out[0].status is Status.INFRA_ERROR and out[0].components == {}
    assert "RuntimeError: verifier bug" in out[0].explanation and "2 attempt" in out[0].explanation
    assert out[1].status is Status.CORRECT  # the other verification is unaffected
    assert pool.counts["errors"] - before.get("errors", 0) == 2  # first try + 1 retry
    assert pool.counts["infra_error"] - before.get("infra_error", 0) == 1


def test_transient_failure_succeeds_on_retry(pool, tmp_path):
    out = pool.verify_batch([(FailsOnce(marker_dir=str(tmp_path)), "k1", None, {})])
    assert out[0].status is Status.CORRECT and out[0].explanation == "second attempt"


def test_slow_verifier_times_out_in_the_worker(pool):
    t = time.perf_counter()
    out = pool.verify_batch([(Sleeps(), "a", None, {}), (Echo(), "b", "b", {})])
    # two attempts of a 1 s limit, run on one worker while the other serves Echo
    assert time.perf_counter() - t < 4.5
    assert out[0].status is Status.INFRA_ERROR and "exceeded 1s" in out[0].explanation
    assert out[1].status is Status.CORRECT


def test_non_verdict_return_is_an_infra_error(pool):
    assert pool.verify_batch([(NotAVerdict(), "a", None, {})])[0].status is Status.INFRA_ERROR


def test_crash_and_uninterruptible_hang_restart_the_pool_and_spare_other_items():
    with VerifierPool(workers=2, timeout_s=0.5, retries=0, grace_s=0.5) as p:
        out = p.verify_batch([(Crashes(), "a", None, {})] + [(Echo(), str(i), str(i), {}) for i in range(4)])
        assert out[0].status is Status.INFRA_ERROR and "died" in out[0].explanation
        assert p.counts["restarts"] >= 1
        # items in flight with the crash are charged too (the pool cannot tell who crashed it);
        # whatever is not infra_error must be the real verdict
        assert all(v.status in (Status.CORRECT, Status.INFRA_ERROR) for v in out[1:])
        out2 = p.verify_batch([(HangsBlockingAlarm(), "a", None, {}), (Echo(), "z", "z", {})])
        assert out2[0].status is Status.INFRA_ERROR and "workers killed" in out2[0].explanation
        assert out2[1].status is Status.CORRECT
        assert p.verify_batch([(Echo(), "ok", "ok", {})])[0].status is Status.CORRECT


def test_in_process_mode_converts_exceptions_too():
    p = VerifierPool(workers=0)
    out = p.verify_batch([(Raises(), "a", None, {}), (Echo(), "b", "b", {})])
    assert out[0].status is Status.INFRA_ERROR and out[1].status is Status.CORRECT
    assert p.metrics()["verify/infra_error"] == 1.0


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="mp_context"):
        VerifierPool(workers=1, mp_context="fork")
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(workers=0, timeout_s=0)


def test_in_process_guard_thread_exits_when_idle_and_comes_back(monkeypatch):
    """workers=0: the guard thread ends after IDLE_EXIT_S without work (pools that are never closed leak
    no threads) and the next call starts a new one."""
    from posttrain.rewards.pool import InlineGuard

    monkeypatch.setattr(InlineGuard, "IDLE_EXIT_S", 0.1)
    pool = VerifierPool(workers=0, timeout_s=5, retries=0)
    items = [(Echo(), "x", "x", {})]
    assert pool.verify_batch(items)[0].status is Status.CORRECT
    (t,) = pool.guard_threads()
    t.join(2)
    assert not t.is_alive() and pool.guard_threads() == []
    assert pool.verify_batch(items)[0].status is Status.CORRECT
    assert len(pool.guard_threads()) == 1
    pool.close()


def test_in_process_batch_is_one_hand_off(monkeypatch):
    """workers=0 verifies a batch at one queue hand-off to one guard thread, not one per item (the per-item
    hand-off was about 35x the verification at the demo's 512 samples a step)."""
    import posttrain.rewards.pool as pool_mod

    puts: list[object] = []

    class Counting(queue.SimpleQueue):  # type: ignore[type-arg]
        def put(self, item, block=True, timeout=None):
            puts.append(item)
            super().put(item, block, timeout)

    monkeypatch.setattr(pool_mod.queue, "SimpleQueue", Counting)
    p = VerifierPool(workers=0, timeout_s=5, retries=0)
    out = p.verify_batch([(OnThread(), str(i), None, {}) for i in range(50)])
    assert [v.status for v in out] == [Status.CORRECT] * 50
    assert len({v.explanation for v in out}) == 1  # one guard thread verified them all
    assert out[0].explanation != f"thread {threading.get_ident()}"  # not the caller's thread
    assert len([x for x in puts if x is not None]) == 1
    p.close()


def test_in_process_batch_deadline_is_per_item():
    """Each item has its own time limit: four 0.3 s verifications under a 0.8 s limit all succeed although the
    batch takes 1.2 s."""
    p = VerifierPool(workers=0, timeout_s=0.8, retries=0)
    out = p.verify_batch([(Sleeps(seconds=0.3), str(i), None, {}) for i in range(4)])
    assert [v.status for v in out] == [Status.CORRECT] * 4
    assert p.counts["timeouts"] == 0
    p.close()


@pytest.mark.timeout(30)
def test_in_process_batch_interrupts_only_the_stuck_item():
    """A pure-Python infinite loop in the middle of a batch: it is interrupted at its deadline (each attempt),
    becomes an infra_error after its retry, and the items before and after it keep their verdicts."""
    p = VerifierPool(workers=0, timeout_s=0.3, retries=1)
    t0 = time.perf_counter()
    out = p.verify_batch([(Echo(), "a", "a", {}), (Spins(), "x", None, {}), (Echo(), "b", "b", {}),
                          (Echo(), "c", "z", {})])
    assert time.perf_counter() - t0 < 10
    assert [v.status for v in out] == [Status.CORRECT, Status.INFRA_ERROR, Status.CORRECT, Status.WRONG]
    assert "spins exceeded 0.3s" in out[1].explanation and "2 attempt" in out[1].explanation
    assert out[1].components == {}
    assert {k: p.counts[k] for k in ("calls", "attempts", "ok", "timeouts", "retries", "infra_error")} == {
        "calls": 4, "attempts": 5, "ok": 3, "timeouts": 2, "retries": 1, "infra_error": 1}
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name == "verify-abandoned"]  # the loops were stopped
    p.close()


def test_in_process_counts_match_the_worker_path(pool):
    """The same batch through worker processes and in-process: the same statuses and the same counts."""
    items = [(Raises(), "a", None, {}), (Echo(), "b", "b", {}), (Echo(), "c", "d", {}), (NotAVerdict(), "e", None, {})]
    before = dict(pool.counts)
    via_workers = pool.verify_batch(items)
    worker_counts = {k: pool.counts[k] - before.get(k, 0) for k in pool.counts}
    inline = VerifierPool(workers=0, timeout_s=1.0, retries=1)
    in_process = inline.verify_batch(items)
    assert [v.status for v in in_process] == [v.status for v in via_workers]
    assert {k: v for k, v in inline.counts.items() if v} == {k: v for k, v in worker_counts.items() if v}
    inline.close()


def test_in_process_batch_verifier_exit_is_an_error_not_a_timeout():
    """A verifier that raises SystemExit ends the batch's worker body early: that item is an ``error`` (named),
    not a timeout, and the items after it are still verified."""
    p = VerifierPool(workers=0, timeout_s=5, retries=0)
    t0 = time.perf_counter()
    out = p.verify_batch([(Echo(), "a", "a", {}), (Exits(), "x", None, {}), (Echo(), "b", "b", {})])
    assert time.perf_counter() - t0 < 4  # not waited out to the 5 s limit
    assert [v.status for v in out] == [Status.CORRECT, Status.INFRA_ERROR, Status.CORRECT]
    assert "SystemExit" in out[1].explanation
    assert p.counts["errors"] == 1 and p.counts["timeouts"] == 0
    p.close()
