"""Resuming with another ``steps`` under a decaying learning-rate schedule: the schedule's horizon is
``steps`` (x ppo_epochs x num_minibatches optimizer steps), rebuilt from the recipe on resume, so the
learning rate of the resumed steps would follow another curve than the steps already taken. Refused in
one line naming ``steps`` and ``optim.schedule`` unless ``resume_force=true``, which decays over the new
horizon from the resumed step (hand-computed below; the first resumed step used to take the rate saved with
the optimizer, and a forced ``optim.lr`` never took effect); a constant schedule extends as before."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from posttrain.errors import UserError
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100", "optim.lr=0.001",
        "logging.progress=false", "checkpoint_every=1",
        "loss.entropy_coef=0.01"]  # the entropy bonus has a gradient on every row: each RL step takes its optimizer step


def _cfg(run_dir: Path, *extra: str):
    return load_run_config(None, [*TINY, f"run_dir={run_dir}", *extra])


def _lr(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_another_steps_with_a_decaying_schedule_is_refused_naming_both_keys(tmp_path: Path, schedule: str) -> None:
    train(_cfg(tmp_path, "steps=2", f"optim.schedule={schedule}"))
    with pytest.raises(UserError) as e:
        train(_cfg(tmp_path, "steps=4", f"optim.schedule={schedule}", "resume=true"))
    msg = str(e.value)
    assert "\n" not in msg and f"steps: 2 -> 4 with optim.schedule={schedule}" in msg and "resume_force=true" in msg


def test_resume_force_decays_over_the_new_steps_from_the_resumed_step(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    train(_cfg(tmp_path, "steps=2", "optim.schedule=linear"))
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        st = train(_cfg(tmp_path, "steps=4", "optim.schedule=linear", "resume=true", "resume_force=true"))
    assert st.step == 4
    assert "steps: 2 -> 4 with optim.schedule=linear" in caplog.text
    lr = _lr(tmp_path)
    # linear, no warm-up, one optimizer step per RL step: the rate used at optimizer step s of a horizon T is
    # 1e-3 * (1 - s / T). Steps 1-2 ran with T=2 (s=0, 1), steps 3-4 with T=4 (s=2, 3).
    assert [lr[s] for s in (1, 2, 3, 4)] == pytest.approx([1e-3, 5e-4, 5e-4, 2.5e-4])


def test_a_constant_schedule_extends_without_resume_force_and_a_forced_lr_takes_effect(tmp_path: Path) -> None:
    train(_cfg(tmp_path, "steps=1"))
    assert train(_cfg(tmp_path, "steps=2", "resume=true")).step == 2
    # optim.lr changed through resume_force: the rate of the resumed steps is the new one (it was the saved one)
    assert train(_cfg(tmp_path, "steps=3", "resume=true", "resume_force=true", "optim.lr=0.002")).step == 3
    assert [_lr(tmp_path)[s] for s in (1, 2, 3)] == pytest.approx([1e-3, 1e-3, 2e-3])
