"""Issue 39, deliverable 4: :class:`~posttrain.loop.run.Run` keeps only the run directory's state; the parts are
passed explicitly. The rollout side reads them with the run's prompt cursor through a
:class:`~posttrain.loop.sampling_lifecycle.SamplingSource`; the engine's release before an update keeps its
log-once state in the set it is given."""

from __future__ import annotations

import logging
import types

import pytest

from posttrain.loop.builders import build_task
from posttrain.loop.run import Run
from posttrain.loop.sampling_lifecycle import SamplingSource
from posttrain.loop.update import release_engine
from posttrain.loop.validate import load_run_config

FORWARDED = ("engine", "learner", "task", "tokenizer", "renderer", "verify_batch", "plain_model", "heldout",
             "kl_coef_value", "observe_kl", "release_engine")


def test_run_forwards_no_part() -> None:
    assert [n for n in FORWARDED if hasattr(Run, n)] == []


def test_the_source_draws_the_runs_prompts_at_its_cursor() -> None:
    """``SamplingSource.next_prompts(n)`` is :meth:`Run.next_prompts` over the source's task: seed
    ``seed * 7919 + cursor``, the cursor advanced by ``n``, the drawn examples recorded for ReMax."""
    cfg = load_run_config("grpo", ["model.path=builtin:micro", "task.name=chain_sum", "seed=3"])
    task = build_task(cfg)
    run = types.SimpleNamespace(cfg=cfg, state=types.SimpleNamespace(cursor=0), step_examples={})
    run.next_prompts = types.MethodType(Run.next_prompts, run)
    src = SamplingSource(cfg=cfg, engine=None, learner=None, task=task, tokenizer=None,  # type: ignore[arg-type]
                         renderer=None, verify_batch=None, plain_model=None, run=run)  # type: ignore[arg-type]
    first, second = src.next_prompts(2), src.next_prompts(3)
    assert first == list(task.examples("train", 2, seed=3 * 7_919))
    assert second == list(task.examples("train", 3, seed=3 * 7_919 + 2))
    assert run.state.cursor == 5 and src.state is run.state
    assert set(run.step_examples) == {ex.prompt_id for ex in first + second}


def test_release_engine_logs_once_per_set(caplog: pytest.LogCaptureFixture) -> None:
    """The log-once state is the set the caller holds (a run's ``logged_once``): a second run warns again."""
    cfg = load_run_config("grpo", ["system.engine_sleep=true"])
    engine, first, second = object(), set[str](), set[str]()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert [release_engine(engine, cfg, first) for _ in range(3)] == [False] * 3
        assert release_engine(engine, cfg, second) is False
    lines = [r.getMessage() for r in caplog.records if "system.engine_sleep" in r.getMessage()]
    assert len(lines) == 2 and first == second != set()
    assert release_engine(engine, load_run_config("grpo"), set()) is False  # the setting off: nothing released
