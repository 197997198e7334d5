"""Issue 9 / class 1: held-out evaluation and training verify through one guarded path, and a
crash loses at most the steps since the last (periodic, by default) checkpoint."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from posttrain.learner.checkpoint import latest_checkpoint
from posttrain.loop import training_loop
from posttrain.loop.heldout import evaluate
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger, Status

HERE = Path(__file__).parent
SMALL = ["model.path=builtin:micro", "task.kwargs={terms: 2}", "sampling.prompts_per_step=4",
         "sampling.group_size=4", "sampling.max_new_tokens=3", "eval.size=16", "logging.progress=false", "sft.steps=0"]


@pytest.fixture
def tricky_task():
    sys.path.insert(0, str(HERE))
    try:
        from test_faults_tasks import failure_kind, tricky

        yield tricky, failure_kind
    finally:
        sys.path.remove(str(HERE))


@dataclasses.dataclass
class _Tok:
    def __call__(self, text: str):
        return type("Enc", (), {"input_ids": [1, 2]})()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(map(str, ids))


@dataclasses.dataclass
class _Comp:
    token_ids: list[int]
    request_id: str  # evaluation matches completions to requests by id (engines may reorder)
    sample_index: int = 0  # ... and sample index (one sample per request here)


class _Engine:
    """Answers every request with the digits of its example's reference (so each valid verdict is correct)."""

    def __init__(self, examples) -> None:
        self.answers = {f"eval{i}-{ex.prompt_id}": [int(c) for c in str(ex.reference)] for i, ex in enumerate(examples)}

    def generate(self, reqs):
        return [_Comp(self.answers[r.request_id], r.request_id) for r in reqs]


@pytest.mark.timeout(60)
def test_heldout_eval_survives_every_verifier_failure_without_workers(tricky_task):
    """Raise, NaN / non-Verdict, unparsable gold and a pure-Python infinite loop: each sample is an
    infra_error, excluded from the accuracy denominator and counted; nothing raises or hangs."""
    from posttrain.rewards import VerifierPool

    tricky, kind = tricky_task
    task = tricky(terms=2)
    exs = task.examples("heldout", 40, seed=0)
    kinds = [kind(ex.reference) for ex in exs]
    assert {"loop", "raise", "nan", "gold", None} <= set(kinds)
    pool = VerifierPool(workers=0, timeout_s=0.2, retries=0)
    t0 = time.perf_counter()
    res = evaluate(_Engine(exs), _Tok(), task, exs, max_new_tokens=3, verify_batch=pool.verify_batch)
    n_bad = sum(k is not None for k in kinds)
    assert res.infra_errors == n_bad and res.as_metrics()["heldout/infra_errors"] == n_bad
    assert res.status_counts[Status.CORRECT.value] == len(exs) - n_bad
    assert res.accuracy == 1.0  # the infra errors are not wrong answers
    assert pool.counts["timeouts"] == kinds.count("loop")
    assert time.perf_counter() - t0 < 0.2 * kinds.count("loop") + 10
    time.sleep(0.1)
    # the interrupted pure-Python loops are gone, not spinning in abandoned threads (the one idle
    # guard thread that serves this thread's next call stays)
    assert not [t for t in threading.enumerate() if t.name == "verify-abandoned"]
    threads = pool.guard_threads()
    assert len(threads) == 1  # one idle guard serves this thread's next call
    pool.close()  # and it ends with the pool (or after InlineGuard.IDLE_EXIT_S idle): no leak
    threads[0].join(2)
    assert not threads[0].is_alive()


def test_heldout_eval_without_a_pool_is_guarded_too(tricky_task):
    """``evaluate`` called on its own (``posttrain eval``, benchmarks) verifies through a default
    in-process pool: a verifier that raises, returns NaN or cannot parse the gold answer is an
    infra error, not an exception out of the evaluation."""
    tricky, kind = tricky_task
    task = tricky(terms=2)
    exs = [ex for ex in task.examples("heldout", 40, seed=0) if kind(ex.reference) != "loop"]
    res = evaluate(_Engine(exs), _Tok(), task, exs, max_new_tokens=3)
    assert res.infra_errors == sum(kind(ex.reference) is not None for ex in exs) > 0
    assert res.accuracy == 1.0


@pytest.mark.timeout(120)
def test_training_run_with_hanging_verifier_and_no_workers_finishes(tmp_path, tricky_task):
    """reward.workers=0 + reward.timeout_s: both the training and the held-out verification time out
    instead of freezing the run; held-out infra errors are counted."""
    tricky, _ = tricky_task
    cfg = load_run_config("grpo", [*SMALL, "task.name=test_faults_tasks:tricky", f"run_dir={tmp_path}", "steps=1",
                               "eval.every=1", "reward.timeout_s=0.2", "reward.retries=0"])
    st = train(cfg)
    assert st.step == 1
    baseline = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])  # the step-0 held-out eval
    assert baseline["step"] == 0 and baseline["heldout/infra_errors"] > 0
    assert baseline["heldout/infra_errors"] == baseline["heldout/status/infra_error"]
    trajs = Ledger(tmp_path / "ledger").read_trajectories()
    assert any(t.status is Status.INFRA_ERROR and "exceeded 0.2s" in t.meta["explanation"] for t in trajs)
    assert all(t.reward.total is None for t in trajs if t.status is Status.INFRA_ERROR)


def test_default_checkpointing_bounds_the_loss_of_a_crash(tmp_path, monkeypatch):
    """checkpoint_every defaults to 10: a crash at step 11 keeps checkpoint 10 (the old default 0
    checkpointed only at the end, so the crash lost every step)."""
    assert load_run_config(None).checkpoint_every == 10
    real = training_loop.update_step

    def crash_at_11(run, producer, step, produced, t_step):
        if step == 11:
            raise RuntimeError("simulated crash")
        return real(run, producer, step, produced, t_step)

    monkeypatch.setattr(training_loop, "update_step", crash_at_11)
    cfg = load_run_config("grpo", [*SMALL, "task.name=chain_sum", f"run_dir={tmp_path}", "steps=12",
                               "sampling.prompts_per_step=2", "sampling.group_size=2", "eval.every=100",
                               "eval.size=4", "sampling.max_new_tokens=2"])
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg)
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.name.endswith("_000010")
