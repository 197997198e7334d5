"""Issue 22 / deliverable 4: failed verifications are counted exactly and are loud.

A step in which every verification failed reports its statuses like any other step (the metrics count
what the ledger holds); a step's or an evaluation's failed fraction at ``guards.max_infra_error_fraction``
warns one line every time (stops with ``guards.action=stop``); a run in which nothing could be judged
ends with a non-zero exit naming why.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.loop.guards import NothingJudgedError, breaches, check_guards
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger, Status

REWARDS = Path(__file__).parent.parent / "rewards"  # _reward_fns_for_tests: `boom` raises on every call
SMALL = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
         "sampling.group_size=2", "sampling.max_new_tokens=3", "eval.size=4", "eval.every=100", "eval.samples=null",
         "eval.sampled_temperature=1.0", "logging.progress=false", "reward.retries=0"]
BOOM = 'reward.functions=[{path: "_reward_fns_for_tests:boom"}]'


@pytest.fixture
def boom_on_path():
    sys.path.insert(0, str(REWARDS))
    try:
        yield
    finally:
        sys.path.remove(str(REWARDS))


def test_a_step_where_every_verification_failed_counts_them_like_the_ledger(tmp_path, boom_on_path):
    """Every verification raises: each step is skipped (nothing to train on), yet its metrics count its
    infra errors, exactly the ledger's (before: no status/* key at all on such a step, i.e. 0 vs 4)."""
    cfg = load_run_config(None, [*SMALL, BOOM, f"run_dir={tmp_path}", "steps=2"])
    with pytest.raises(NothingJudgedError):
        train(cfg)
    led = Ledger(tmp_path / "ledger")
    in_ledger = Counter(step for step, t in led.iter_trajectories() if t.status is Status.INFRA_ERROR)
    assert in_ledger == {1: 4, 2: 4}  # 2 prompts x 2 samples per step, every one an infra error
    for m in led.read_metrics():
        assert m["skipped"] == 1.0
        assert m["status/infra_error"] == in_ledger[m["step"]]
        assert m["status/correct"] == m["status/wrong"] == 0.0


def test_nothing_judged_warns_every_step_and_exits_nonzero_naming_why(tmp_path, boom_on_path, caplog, capsys):
    """On the command line: one warning line per evaluation and per step, then exit code 2 with a last
    line saying nothing could be judged, the first failure's reason and where to look (before: exit 0, 'done')."""
    recipe = tmp_path / "loud.yaml"
    recipe.write_text("name: loud\n")  # the defaults: no SFT warm-up, one minibatch
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        rc = main(["train", str(recipe), *SMALL, BOOM, f"run_dir={tmp_path / 'run'}", "steps=3", "--no-progress"])
    assert rc == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("posttrain train: error: nothing could be judged")
    assert "reward service down" in last and str(tmp_path / "run" / "ledger") in last
    # the step-0 and the final (step 3, held on a skipped step too) evaluations, greedy and sampled (4 held-out
    # prompts each) + 3 steps x 4 samples
    assert "all 28 verifications" in last
    warned = [r.getMessage() for r in caplog.records if "every verification failed" in r.getMessage()]
    assert len(warned) == 7  # each of the two evaluations' two passes and each of the 3 steps, one line each
    assert sum(w.startswith("guard: training step") for w in warned) == 3
    assert sum(w.startswith("guard: evaluation heldout:") for w in warned) == 2
    assert sum(w.startswith("guard: evaluation heldout_sampled:") for w in warned) == 2
    # the evaluation schedule holds on skipped steps: the final step's held-out figure is in the metrics
    final = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["step"] == 3 and final["skipped"] == 1.0 and "heldout/accuracy" in final


def test_a_run_warns_once_per_step_whose_failed_fraction_reaches_the_threshold(tmp_path, caplog):
    """flaky_task's verifier raises on responses holding a '7': with the threshold at 1%, each step whose
    ledger holds an infra error warns exactly once, with that step's counts; the other steps do not."""
    here = str(Path(__file__).parent)
    sys.path.insert(0, here)
    try:
        cfg = load_run_config(None, [*SMALL, "task.name=flaky_task:flaky", "sampling.prompts_per_step=8",
                                 "sampling.max_new_tokens=2", f"run_dir={tmp_path}", "steps=3",
                                 "guards.max_infra_error_fraction=0.01"])
        with caplog.at_level(logging.WARNING, logger="posttrain"):
            train(cfg)
    finally:
        sys.path.remove(here)
    led = Ledger(tmp_path / "ledger")
    per_step = Counter(step for step, t in led.iter_trajectories() if t.status is Status.INFRA_ERROR)
    assert per_step, "the crashing verifier should have failed on some responses"
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("guard: training step")]
    expected = [f"guard: training step: failed verifications {n / 16:.2f} >= 0.01 ({n} of 16 samples"
                if n < 16 else "guard: training step: every verification failed (16 of 16 samples"
                for _, n in sorted(per_step.items())]
    assert [w.split(" infra_error/")[0] for w in warned] == expected


def _guards(*overrides: str):
    return load_run_config(None, list(overrides)).guards


def test_failed_fraction_threshold_warns_for_steps_and_evaluations():
    """guards.max_infra_error_fraction: a breach when that fraction of a step's (status/*) or an
    evaluation's (<prefix>/status/*) samples has no verdict; 1.0 (default) = only when all failed."""
    step = {"status/correct": 2.0, "status/wrong": 1.0, "status/infra_error": 1.0, "status/env_failure": 0.0}
    ev = {"heldout/status/correct": 1.0, "heldout/status/infra_error": 3.0, "heldout/infra_errors": 3.0}
    assert breaches(_guards(), {**step, **ev}) == []  # 1/4 and 3/4 failed: under the default (all)
    found = breaches(_guards("guards.max_infra_error_fraction=0.25"), {**step, **ev})
    assert len(found) == 2
    assert found[0].startswith("training step: failed verifications 0.25 >= 0.25 (1 of 4 samples")
    assert found[1].startswith("evaluation heldout: failed verifications 0.75 >= 0.25 (3 of 4 samples")
    assert [b[:18] for b in breaches(_guards("guards.max_infra_error_fraction=0.5"), {**step, **ev})] == [
        "evaluation heldout"]
    # env_failure (an episode's environment broke) carries no verdict either
    assert breaches(_guards("guards.max_infra_error_fraction=0.5"),
                    {"status/correct": 1.0, "status/env_failure": 1.0, "status/infra_error": 0.0})
    # a key that merely ends in "status/..." under another name is not read
    assert breaches(_guards("guards.max_infra_error_fraction=0.1"), {"xstatus/infra_error": 1.0}) == []


def test_failed_fraction_stops_the_run_with_action_stop():
    m = {"status/correct": 0.0, "status/infra_error": 4.0}
    assert check_guards(_guards("guards.action=warn"), dict(m)) is None
    reason = check_guards(_guards("guards.action=stop"), dict(m))
    assert reason is not None and "every verification failed (4 of 4 samples" in reason


def test_failed_fraction_key_is_a_bounded_fraction():
    assert _guards().max_infra_error_fraction == 1.0
    assert _guards("guards.max_infra_error_fraction=0.5").max_infra_error_fraction == 0.5
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="max_infra_error_fraction"):
            _guards(f"guards.max_infra_error_fraction={bad}")


def test_eval_of_a_checkpoint_whose_verifications_all_fail_warns_and_exits_nonzero(tmp_path, boom_on_path, caplog,
                                                                                     capsys):
    """`posttrain eval` judges like the run (its config.yaml, the same failing reward): one warning line per
    evaluation pass and exit 2 naming the checkpoint (before: exit 0 with accuracy 0.0 printed as a result)."""
    run_dir = tmp_path / "run"
    with pytest.raises(NothingJudgedError):
        train(load_run_config(None, [*SMALL, BOOM, f"run_dir={run_dir}", "steps=1"]))
    ckpt = run_dir / "checkpoints" / "step_000001"
    assert ckpt.is_dir()  # the final checkpoint is written before the run says nothing was judged
    capsys.readouterr()
    caplog.clear()  # the training run's own warnings
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        rc = main(["eval", str(ckpt)])
    assert rc == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nothing could be judged: all 8 held-out verifications" in last and str(ckpt) in last
    warned = [r.getMessage() for r in caplog.records if "every verification failed" in r.getMessage()]
    assert sorted(w.split(":")[1].strip() for w in warned) == ["evaluation heldout", "evaluation heldout_sampled"]
