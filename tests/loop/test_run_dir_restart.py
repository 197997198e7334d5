"""Issue 22, deliverable 3: a run directory a user can always go on from.

- A run that stopped before its first checkpoint is started again into its directory by the same
  command: its files are moved, all of them, to ``failed_<time>/`` with one warning line.
- A run with a checkpoint is still refused to a fresh start (resume it, or another run_dir), and a
  live (locked) run's files are never touched.
- Keys that change no arithmetic (``PLACEMENT_ONLY``: checkpoint_every, logging, eval.every,
  guards, ...) may change on resume; config.yaml records the new values. Any other key still
  needs resume_force.
"""

from __future__ import annotations

import fcntl
import json
import logging
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.errors import UserError
from posttrain.loop import training_loop
from posttrain.loop.run_dir import PLACEMENT_ONLY, placement_changes, recipe_diff, refuse_to_overwrite
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.trajectory import Ledger

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100", "optim.lr=0.001",
        "logging.progress=false"]


def _cfg(run_dir: Path, *extra: str):
    return load_run_config(None, [*TINY, f"run_dir={run_dir}", *extra])  # the defaults, whatever the recipes hold


def _crash_at(monkeypatch: pytest.MonkeyPatch, step_k: int) -> None:
    real = training_loop.update_step

    def hooked(run, producer, step, produced, t_step):
        if step == step_k:
            raise RuntimeError(f"crash in step {step_k}")
        return real(run, producer, step, produced, t_step)

    monkeypatch.setattr(training_loop, "update_step", hooked)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != ".lock"}


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_same_command_restarts_a_run_that_stopped_before_its_first_checkpoint(tmp_path, monkeypatch, caplog,
                                                                                   capsys):
    """The issue's trap: step 2 fails (no checkpoint: checkpoint_every=0), leaving config.yaml,
    metrics.jsonl (steps 0, 1) and the step-1 ledger; the same command used to say "already holds a
    run ... resume=true" and resume=true "holds no complete checkpoint"."""
    recipe = tmp_path.parent / f"{tmp_path.name}.yaml"
    recipe.write_text("name: t\n")
    args = ["train", str(recipe), *TINY, f"run_dir={tmp_path}", "steps=3", "checkpoint_every=0", "--no-progress"]
    _crash_at(monkeypatch, 2)
    assert main(args) == 1
    monkeypatch.undo()
    failed = _files(tmp_path)
    assert {"config.yaml", "metrics.jsonl"} <= set(failed) and _metric_steps(tmp_path) == [0, 1]
    assert Ledger(tmp_path / "ledger").steps() == [1]
    capsys.readouterr()

    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert main(args) == 0
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("failed_")]
    (line,) = [r.getMessage() for r in caplog.records if "stopped before its first checkpoint" in r.getMessage()]
    assert "\n" not in line and str(tmp_path) in line and "last step logged: 1" in line and f"{moved}/" in line
    assert _files(moved) == failed  # nothing of the failed run is lost
    assert _metric_steps(tmp_path) == [0, 1, 2, 3]  # the new run starts afresh beside it
    assert Ledger(tmp_path / "ledger").steps() == [1, 2, 3]


def test_a_run_with_a_checkpoint_is_still_refused_and_a_live_run_is_untouched(tmp_path, monkeypatch):
    _crash_at(monkeypatch, 2)
    with pytest.raises(RuntimeError):
        train(_cfg(tmp_path, "steps=3", "checkpoint_every=1"))  # step 1 is checkpointed
    monkeypatch.undo()
    before = _files(tmp_path)
    with pytest.raises(UserError, match="already holds a run.*resume=true"):
        train(_cfg(tmp_path, "steps=3"))
    assert _files(tmp_path) == before and not list(tmp_path.glob("failed_*"))

    live = tmp_path / "live"  # a run still going (no checkpoint yet) holds the lock
    live.mkdir()
    (live / "metrics.jsonl").write_text('{"step": 0}\n')
    with open(live / ".lock", "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match="in use by another run"):
            train(_cfg(live, "steps=1"))
    assert _files(live) == {"metrics.jsonl": b'{"step": 0}\n'} and not list(live.glob("failed_*"))


def test_refuse_to_overwrite_moves_only_the_runs_files(tmp_path):
    """Unit: a half-written checkpoint (no meta.json) is not a checkpoint; the run's files move, a
    file that is not the run's stays, an empty directory is left alone."""
    assert refuse_to_overwrite(tmp_path) is None
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)  # crashed save: no meta.json
    (tmp_path / "config.yaml").write_text("name: x\n")
    (tmp_path / "notes.txt").write_text("mine")
    dest = refuse_to_overwrite(tmp_path)
    assert dest is not None and dest.parent == tmp_path and dest.name.startswith("failed_")
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoints", "config.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name, "notes.txt"]


def test_placement_only_keys_may_change_on_resume_and_config_yaml_records_them(tmp_path, caplog):
    train(_cfg(tmp_path, "steps=2", "checkpoint_every=1"))
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        st = train(_cfg(tmp_path, "steps=4", "resume=true", "checkpoint_every=2", "eval.every=1",
                        "guards.max_truncation_rate=1.0"))
    assert st.step == 4
    assert ("resume: placement-only keys changed (checkpoint_every: 1 -> 2; eval.every: 100 -> 1; "
            "guards.max_truncation_rate: 0.9 -> 1.0)") in caplog.text
    rec = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (rec["checkpoint_every"], rec["eval"]["every"], rec["guards"]["max_truncation_rate"]) == (2, 1, 1.0)
    # checkpoints at 1, 2 (first run), then every 2 steps: 4 (3 would have been written with 1)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == [
        "step_000001", "step_000002", "step_000004"]
    assert _metric_steps(tmp_path)[-2:] == [3, 4]


def test_an_arithmetic_key_is_still_refused_and_placement_keys_are_not_listed(tmp_path):
    train(_cfg(tmp_path, "steps=1"))
    with pytest.raises(UserError) as e:
        train(_cfg(tmp_path, "steps=2", "resume=true", "optim.lr=0.002", "checkpoint_every=5"))
    msg = str(e.value)
    assert "optim.lr: 0.001 -> 0.002" in msg and "resume_force=true" in msg
    assert "checkpoint_every" not in msg


def test_recipe_diff_and_placement_changes_split_the_keys():
    old = {"steps": 2, "checkpoint_every": 10, "logging": {"progress": True}, "optim": {"lr": 0.001},
           "eval": {"every": 10, "size": 200}, "guards": {"action": "warn"}, "learner": {"strategy": "single"}}
    new = {"steps": 3, "checkpoint_every": 5, "logging": {"progress": False}, "optim": {"lr": 0.001},
           "eval": {"every": 2, "size": 100}, "guards": {"action": "stop"}, "learner": {"strategy": "ddp"}}
    assert recipe_diff(old, new) == ["eval.size: 200 -> 100"]
    assert placement_changes(old, new) == ["checkpoint_every: 10 -> 5", "eval.every: 10 -> 2",
                                           "guards.action: 'warn' -> 'stop'", "learner.strategy: 'single' -> 'ddp'",
                                           "logging.progress: True -> False"]
    assert "optim.lr" not in PLACEMENT_ONLY and "eval.size" not in PLACEMENT_ONLY


def test_after_ctrl_c_before_the_first_checkpoint_the_printed_command_starts_again(tmp_path, monkeypatch, capsys):
    """Ctrl-C in step 1 (no checkpoint yet) prints how to start again; that very command now works."""
    import shlex

    recipe = tmp_path.parent / f"{tmp_path.name}.yaml"
    recipe.write_text("name: t\n")
    real = training_loop.update_step

    def interrupt(run, producer, step, produced, t_step):
        raise KeyboardInterrupt

    monkeypatch.setattr(training_loop, "update_step", interrupt)
    assert main(["train", str(recipe), *TINY, f"run_dir={tmp_path}", "steps=2", "--no-progress"]) == 130
    monkeypatch.setattr(training_loop, "update_step", real)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("posttrain train:")]
    assert "no checkpoint was written yet; start again with: posttrain train" in line
    assert f"{tmp_path}/failed_<time>/" in line
    command = shlex.split(line.split("start again with: ")[1].split(" (this run's files")[0])
    assert main([*command[1:], "--no-progress"]) == 0
    assert _metric_steps(tmp_path) == [0, 1, 2]
    (moved,) = tmp_path.glob("failed_*")
    assert _metric_steps(moved) == [0]  # the interrupted run's step-0 evaluation, kept
