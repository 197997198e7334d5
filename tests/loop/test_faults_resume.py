"""Issue 9 / classes 2 and 3: resume protects the run's history, the run directory is locked, and
run-directory errors (file, read-only, disk full, Ctrl-C) are one line with a way to go on."""

from __future__ import annotations

import builtins
import errno
import fcntl
import io
import json
import logging
import os
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.errors import UserError
from posttrain.learner import checkpoint as ckpt
from posttrain.loop import training_loop
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2", "sft.steps=0",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100",
        "logging.progress=false"]


def _cfg(run_dir: Path, *extra: str):
    return load_run_config("grpo", [*TINY, f"run_dir={run_dir}", *extra])


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _interrupt_at(monkeypatch, step_k: int, exc: BaseException) -> None:
    """Make the training loop raise ``exc`` when step ``step_k`` starts its update."""
    real = training_loop.update_step

    def hooked(run, producer, step, produced, t_step):
        if step == step_k:
            raise exc
        return real(run, producer, step, produced, t_step)

    monkeypatch.setattr(training_loop, "update_step", hooked)


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("posttrain train:")]


# ------------------------------------------------------------------ class 2: resume protects history
def test_resume_with_a_changed_recipe_is_refused_with_the_diff_unless_forced(tmp_path, caplog):
    train(_cfg(tmp_path, "steps=2"))
    before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(UserError) as e:
        train(_cfg(tmp_path, "steps=3", "resume=true", "optim.lr=0.002", "seed=1"))
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "config.yaml") in msg
    assert f"optim.lr: {load_run_config('grpo').optim.lr} -> 0.002" in msg and "seed: 0 -> 1" in msg and "resume_force=true" in msg
    assert "steps" not in msg  # extending the run is not a recipe change
    assert (tmp_path / "config.yaml").read_text() == before  # history untouched
    assert Ledger(tmp_path / "ledger").steps() == [1, 2]

    with caplog.at_level(logging.WARNING, logger="posttrain"):
        st = train(_cfg(tmp_path, "steps=3", "resume=true", "optim.lr=0.002", "seed=1", "resume_force=true"))
    assert st.step == 3
    assert (tmp_path / "config.step_000002.yaml").read_text() == before  # the old recipe is kept
    assert f"optim.lr: {load_run_config('grpo').optim.lr} -> 0.002" in caplog.text


def test_resume_without_a_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    with pytest.raises(UserError, match="holds no complete checkpoint"):
        train(_cfg(tmp_path, "steps=1", "resume=true"))
    assert not (tmp_path / "ledger").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_metrics_never_repeat_steps_after_a_resume(tmp_path, monkeypatch):
    _interrupt_at(monkeypatch, 4, RuntimeError("crash in step 4"))
    with pytest.raises(RuntimeError):
        train(_cfg(tmp_path, "steps=4", "checkpoint_every=2"))
    assert _metric_steps(tmp_path) == [0, 1, 2, 3]  # step 3 was logged after checkpoint 2
    monkeypatch.undo()
    train(_cfg(tmp_path, "steps=4", "checkpoint_every=2", "resume=true"))
    assert _metric_steps(tmp_path) == [0, 1, 2, 3, 4]
    assert Ledger(tmp_path / "ledger").steps() == [1, 2, 3, 4]


def test_a_locked_run_dir_refuses_a_second_run_and_the_lock_is_released(tmp_path):
    with open(tmp_path / ".lock", "a+") as holder:  # another run holds the directory
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError) as e:
            train(_cfg(tmp_path, "steps=1"))
        fcntl.flock(holder, fcntl.LOCK_UN)
    assert "\n" not in str(e.value) and f"run_dir {tmp_path}" in str(e.value) and "in use" in str(e.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing written into the other run's directory
    train(_cfg(tmp_path, "steps=1"))  # the directory is free again
    with open(tmp_path / ".lock", "a+") as probe:  # and the finished run released it
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    train(_cfg(tmp_path, "steps=4", "checkpoint_every=2"))
    latest = tmp_path / "checkpoints" / "step_000004"
    weights = latest / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # torn by a failing disk
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        st = train(_cfg(tmp_path, "steps=5", "checkpoint_every=2", "resume=true"))
    assert "step_000004" in caplog.text and "falling back" in caplog.text
    assert st.step == 5
    assert Ledger(tmp_path / "ledger").steps() == [1, 2, 3, 4, 5]
    assert _metric_steps(tmp_path) == [0, 1, 2, 3, 4, 5]


# ------------------------------------------------------------------ class 3: run-directory errors, one line
def test_run_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "notadir"
    f.write_text("x")
    rc = main(["train", "grpo", *TINY, f"run_dir={f}", "steps=1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert str(f) in line and "is a file" in line


def test_read_only_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    # Root ignores permission bits, so the read-only file system is simulated: every open for
    # writing under run_dir fails with EACCES / EROFS as it would for a normal user.
    real_os_open, real_open = os.open, builtins.open

    def denied(path: object) -> bool:
        return str(path).startswith(str(run_dir))

    def os_open(path, flags, *a, **k):
        if denied(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_os_open(path, flags, *a, **k)

    def py_open(file, mode="r", *a, **k):
        if denied(file) and any(c in mode for c in "wax+"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)
    monkeypatch.setattr(io, "open", py_open)
    rc = main(["train", "grpo", *TINY, f"run_dir={run_dir}", "steps=1", "--no-progress"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert str(run_dir) in line and "not writable" in line


def test_disk_full_while_checkpointing_is_one_line_and_leaves_no_tmp(tmp_path, capsys, monkeypatch):
    real = ckpt._write_learner_state
    calls = []

    def full_disk(learner_state, tmp):
        calls.append(tmp)
        if len(calls) == 2:  # the second checkpoint (step 2) hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "learner_state.pt"))
        return real(learner_state, tmp)

    monkeypatch.setattr(ckpt, "_write_learner_state", full_disk)
    rc = main(["train", "grpo", *TINY, f"run_dir={tmp_path}", "steps=3", "checkpoint_every=1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert "disk full" in line and "learner_state.pt" in line and "step_000001 is intact" in line
    assert "resume=true" in line
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    assert leftovers == []
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step_000001"]
    monkeypatch.undo()
    assert main(["train", "grpo", *TINY, f"run_dir={tmp_path}", "steps=3", "checkpoint_every=1", "resume=true",
                 "--no-progress"]) == 0
    assert _metric_steps(tmp_path) == [0, 1, 2, 3]


def test_ctrl_c_exits_130_with_one_resume_line_and_the_resume_continues(tmp_path, capsys, monkeypatch):
    _interrupt_at(monkeypatch, 4, KeyboardInterrupt())
    args = ["train", "grpo", *TINY, f"run_dir={tmp_path}", "steps=5", "checkpoint_every=2", "--no-progress"]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err
    (line,) = _error_lines(err)
    assert "interrupted" in line and "step_000002 is intact" in line and "resume=true" in line
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step_000002"]
    monkeypatch.undo()
    assert main([*args, "resume=true"]) == 0  # the lock was released; the run goes on from step 2
    assert Ledger(tmp_path / "ledger").steps() == [1, 2, 3, 4, 5]
    assert _metric_steps(tmp_path) == [0, 1, 2, 3, 4, 5]


def test_a_fresh_run_into_a_finished_run_is_refused_and_changes_nothing(tmp_path):
    """resume=false into a directory with another run's history: one line, nothing overwritten."""
    train(_cfg(tmp_path, "steps=2"))
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(UserError) as e:
        train(_cfg(tmp_path, "steps=2", "seed=5"))
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and "resume=true" in msg
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == files
