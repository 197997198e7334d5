"""posttrain/bench/async_model.py: the speed-up model on cases computed by hand (pure; no clock)."""

from __future__ import annotations

import pytest

from posttrain.bench.async_model import (
    StepSplit,
    idle_for_speedup,
    predict_speedup,
    split_from_metrics,
)


def test_no_lead_is_the_sync_schedule():
    # eta = 0: call c starts after step c-1 finished -> exactly sync, whatever the times.
    p = predict_speedup(StepSplit((3.0, 1.0, 2.0), (1.0, 2.0, 0.5), (0.1, 0.1, 0.1)), max_staleness=0)
    assert p.speedup == pytest.approx(1.0) and p.sync_step_s == pytest.approx(9.8 / 3)


def test_one_step_off_with_constant_times():
    # r = 2, l = 1, 4 steps. Sync: 4 * 3 = 12. Async (eta 1): P = 2, 4, 6, 8; C = 3, 5, 7, 9 -> 12 / 9.
    p = predict_speedup(StepSplit.uniform(2.0, 1.0, steps=4), max_staleness=1)
    assert p.speedup == pytest.approx(12 / 9)
    assert p.async_step_s == pytest.approx(9 / 4)
    assert p.bound == pytest.approx(3 / 2)  # rollout-bound steady state: (2 + 1) / max(2, 1)


def test_workers_split_the_rollout():
    # N = 2: rho = 1, l = 1. Sync 4 * 2 = 8. Async: P = 1, 2, 3, 4; C = 2, 3, 4, 5 -> 8 / 5.
    p = predict_speedup(StepSplit.uniform(2.0, 1.0, steps=4), workers=2, max_staleness=1)
    assert p.speedup == pytest.approx(8 / 5) and p.bound == pytest.approx(2.0)


def test_streaming_recovers_the_idle_slots():
    # r = 2 with half the slots idle: rho = 1; l = 1. Sync 12 (streaming never shortens sync); async
    # C = 2, 3, 4, 5 -> 12 / 5; bound 3 / 1 = 1 + 1 / (1 - 0.5).
    s = StepSplit.uniform(2.0, 1.0, steps=4, idle_frac=0.5)
    p = predict_speedup(s, max_staleness=4, streaming=True)
    assert p.speedup == pytest.approx(12 / 5) and p.bound == pytest.approx(3.0)
    assert predict_speedup(s, max_staleness=4).speedup == pytest.approx(12 / 9)  # no streaming: as above


def test_a_larger_lead_absorbs_varying_rollout_times():
    # r = 3, 1, 3, 1; l = 2. Sync: 5 + 3 + 5 + 3 = 16 (mean step 4).
    # eta = 1: P0 = 3, C0 = 5; P1 = 3 + 1 = 4 (admitted at 0), C1 = 7; P2 = max(4, C0 = 5) + 3 = 8,
    #          C2 = 10; P3 = max(8, C1 = 7) + 1 = 9, C3 = 12 -> 16 / 12.
    # eta = 2: P0 = 3, P1 = 4, P2 = 7 (admitted at 0), P3 = max(7, C0 = 5) + 1 = 8;
    #          C0 = 5, C1 = 7, C2 = 9, C3 = 11 -> 16 / 11.
    s = StepSplit((3.0, 1.0, 3.0, 1.0), (2.0,) * 4, (0.0,) * 4)
    assert predict_speedup(s, max_staleness=1).speedup == pytest.approx(16 / 12)
    assert predict_speedup(s, max_staleness=2).speedup == pytest.approx(16 / 11)
    # Steady state: (2 + 2) / max(2, 2) = 2; 4 steps cannot reach it (the first call overlaps nothing).
    assert predict_speedup(s, max_staleness=2).bound == pytest.approx(2.0)


def test_the_sync_time_is_paid_by_the_learner_side():
    # r = 1, l = 1, s = 1, 2 steps. Sync 2 * 3 = 6. eta 1: P = 1, 2; C0 = 3, C1 = max(3, 2) + 2 = 5 -> 6 / 5.
    assert predict_speedup(StepSplit.uniform(1.0, 1.0, 1.0, steps=2)).speedup == pytest.approx(6 / 5)


def test_more_steps_cycle_the_measured_sequence():
    s = StepSplit((3.0, 1.0), (2.0, 2.0), (0.0, 0.0))
    p = predict_speedup(s, max_staleness=1, steps=4)  # = the 4-step sequence 3, 1, 3, 1 above
    assert p.steps == 4 and p.speedup == pytest.approx(16 / 12)


def test_published_figures_need_a_long_tail_under_the_model():
    assert idle_for_speedup(2.77) == pytest.approx(1 - 1 / 1.77)  # AReaL: ~0.435
    assert idle_for_speedup(2.35) == pytest.approx(1 - 1 / 1.35)  # veRL fully async: ~0.259
    i = idle_for_speedup(2.77)  # at balance (rho = l) the bound is exactly the published figure
    assert predict_speedup(StepSplit.uniform(1.0, 1.0 - i, steps=1, idle_frac=i), streaming=True,
                           max_staleness=10).bound == pytest.approx(2.77)


def test_split_from_a_sync_runs_metrics():
    ms = [{"time/step_s": 5.0, "time/rollout_s": 1.5, "time/reward_s": 0.5, "time/weight_sync_s": 0.25,
           "time/eval_s": 1.0, "rollout/group_idle_frac": 0.7},
          {"time/step_s": 3.0, "time/rollout_s": 1.0, "time/weight_sync_s": 0.5}]
    s = split_from_metrics(ms)
    assert s.rollout_s == (2.0, 1.0) and s.sync_s == (0.25, 0.5)
    assert s.learner_s == (5.0 - 1.0 - 2.0 - 0.25, 3.0 - 1.0 - 0.5) and s.idle_frac == (0.7, 0.0)


def test_split_of_an_overlapped_run_charges_the_learner_its_own_time():
    # one_step_off: step 1 waits 28 s for call 0; later calls (30 s) run beside a 60 s learner, so the step is the
    # learner's. Subtracting the concurrent rollout (the sync rule) would give the learner 30 s, half its time.
    ms = [{"time/step_s": 89.0, "time/rollout_s": 28.0, "time/weight_sync_s": 1.0, "time/learner_wait_s": 28.0,
           "time/quiesce_wait_s": 0.0},
          {"time/step_s": 71.0, "time/rollout_s": 29.5, "time/reward_s": 0.5, "time/weight_sync_s": 1.0,
           "time/learner_wait_s": 0.0, "time/quiesce_wait_s": 0.0, "time/eval_s": 10.0}]
    s = split_from_metrics(ms)
    assert s.rollout_s == (28.0, 30.0) and s.sync_s == (1.0, 1.0)
    assert s.learner_s == (60.0, 60.0) and s.wait_s == (28.0, 0.0)
    # the next call outlasting the learner: the learner waits for it inside the quiesce
    slow = [{"time/step_s": 50.0, "time/rollout_s": 45.0, "time/weight_sync_s": 1.0, "time/learner_wait_s": 0.0,
             "time/quiesce_wait_s": 9.0}]
    assert split_from_metrics(slow).learner_s == (40.0,) and split_from_metrics(slow).wait_s == (9.0,)
    # a sync run's rows have no waits: its split keeps the sync rule and no wait_s
    assert split_from_metrics([{"time/step_s": 5.0, "time/rollout_s": 2.0}]).wait_s == ()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"workers": 0}, "workers"), ({"max_staleness": -1}, "max_staleness"), ({"streaming": True}, "idle fraction"),
    ({"steps": 0}, "steps"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        predict_speedup(StepSplit.uniform(1.0, 1.0), **kwargs)


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="learner_s"):
        StepSplit((1.0, 1.0), (1.0,), (0.0, 0.0))
    with pytest.raises(ValueError, match="idle_frac"):
        StepSplit((1.0,), (1.0,), (0.0,), (1.0,))
