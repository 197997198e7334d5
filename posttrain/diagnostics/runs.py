"""Which runs a directory holds, and what each one is doing: the runs page of ``posttrain view``.

A *run* is a directory holding any of ``config.yaml``, ``metrics.jsonl`` or ``ledger/`` (what
``posttrain train`` writes first, posttrain/loop/run_dir.py). ``posttrain view DIR`` lists DIR
itself when it is a run (with the ``failed_<time>/`` folders a fresh run moved aside inside it),
else every run found below DIR (a few levels deep, never inside a run's own folders).

A run's status, decided from its files alone:

- ``running``: some process holds the flock of ``RUN/.lock`` (``/proc/locks``; elsewhere a
  non-blocking shared-lock probe);
- ``failed``: a ``failed_<time>/`` folder (moved aside by the next fresh run), or a run with no
  complete checkpoint that did not reach its last step (it stopped before its first checkpoint);
- ``stopped``: a guard stopped it (a ``stopped`` reason in ``metrics.jsonl``), or it has a
  complete checkpoint but did not reach ``steps`` of its ``config.yaml`` (interrupted or crashed;
  ``resume=true`` continues it);
- ``finished``: its last logged step reached ``steps``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

LOCK_NAME = ".lock"  # the run-directory lock (posttrain/loop/run_dir.py, RunDirLock)
FAILED_PREFIX = "failed_"
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "ledger")
# A run's own folders: never searched for more runs.
RUN_SUBDIRS = frozenset(
    {
        "ledger",
        "checkpoints",
        "diagnostics",
        "tensorboard",
        "wandb",
        "mlruns",
        "mlflow",
        "reference",
        "reward_model",
        "engine_model",
    }
)
MAX_DEPTH = 4
_CKPT = re.compile(r"^step_(\d+)$")


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a directory holding any of :data:`RUN_MARKERS`."""
    return path.is_dir() and any((path / m).exists() for m in RUN_MARKERS)


def _walk(d: Path, depth: int) -> Iterator[Path]:
    try:
        children = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    for c in children:
        if is_run_dir(c):
            yield c
            yield from (f for f in sorted(c.glob(f"{FAILED_PREFIX}*")) if is_run_dir(f))
        elif depth < MAX_DEPTH and c.name not in RUN_SUBDIRS:
            yield from _walk(c, depth + 1)


def find_runs(root: str | Path) -> list[Path]:
    """``root`` itself when it is a run (then its ``failed_*`` runs), else every run below it, sorted.

    Raises ``FileNotFoundError`` (one line naming ``root``) when ``root`` is not a directory or holds
    no run.
    """
    r = Path(root)
    if not r.is_dir():
        raise FileNotFoundError(f"{r}: no such directory")
    if is_run_dir(r):
        return [r, *(f for f in sorted(r.glob(f"{FAILED_PREFIX}*")) if is_run_dir(f))]
    found = list(_walk(r, 1))
    if not found:
        raise FileNotFoundError(
            f"{r}: not a run directory and no run below it (a run holds config.yaml, "
            "metrics.jsonl or ledger/)"
        )
    return found


def run_id(root: Path, run: Path) -> str:
    """The run's id on the page: its path relative to ``root`` (``@`` for ``root`` itself)."""
    rel = run.relative_to(root).as_posix()
    return "@" if rel == "." else rel


def _proc_locks_holds(path: Path) -> bool | None:
    """Whether ``/proc/locks`` lists a lock on ``path``'s inode; None when it cannot be read (not Linux)."""
    try:
        st = path.stat()
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in text.splitlines():
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        for p in parts:
            dev = p.split(":")
            if len(dev) == 3:
                try:
                    if (int(dev[0], 16), int(dev[1], 16), int(dev[2])) == want:
                        return True
                except ValueError:
                    pass
                break
    return False


def lock_held(run: Path) -> bool:
    """Whether a process holds the run's ``.lock`` (the run is writing)."""
    path = run / LOCK_NAME
    if not path.is_file():
        return False
    held = _proc_locks_holds(path)
    if held is not None:
        return held
    try:  # not Linux: probe with a shared lock, dropped at once
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)


def checkpoints(run: Path) -> list[dict[str, Any]]:
    """Every ``checkpoints/step_N`` folder, oldest first: ``{"step", "path", "complete"}`` (complete:
    ``meta.json`` written, which a checkpoint writes last)."""
    d = run / "checkpoints"
    if not d.is_dir():
        return []
    out = [
        {"step": int(m.group(1)), "path": str(p), "complete": (p / "meta.json").is_file()}
        for p in d.iterdir()
        if (m := _CKPT.match(p.name)) and p.is_dir()
    ]
    return sorted(out, key=lambda c: c["step"])


def read_config(run: Path) -> dict[str, Any]:
    """The mapping in ``RUN/config.yaml``; ``{}`` when missing or unreadable."""
    try:
        data = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def recipe_axes(config: Mapping[str, Any]) -> dict[str, str]:
    """The recipe's six axes (``posttrain train --print-recipe``) from a recorded config; ``{}`` when the
    config does not validate (written by another version)."""
    if not config:
        return {}
    try:
        from posttrain.config.run import RECORDED, RunConfig

        return RunConfig.model_validate(dict(config), context=RECORDED).axes()
    except Exception:  # noqa: BLE001 - a config this version cannot read still lists the run
        return {}


def run_status(run: Path, metrics: list[dict[str, Any]], config: Mapping[str, Any]) -> tuple[str, str]:
    """``(status, why)``: status one of running / finished / failed / stopped (module docstring)."""
    last = int(metrics[-1]["step"]) if metrics else None
    planned = config.get("steps")
    stopped = next((m["stopped"] for m in reversed(metrics) if m.get("stopped")), None)
    ckpts = [c["step"] for c in checkpoints(run) if c["complete"]]
    if run.name.startswith(FAILED_PREFIX):
        return "failed", "moved aside by the next fresh run: it stopped before its first checkpoint"
    if lock_held(run):
        return "running", f"a process holds {LOCK_NAME}" + (f"; last step {last}" if last is not None else "")
    if stopped:
        return "stopped", f"stopped by a guard at step {last}: {stopped}"
    if isinstance(planned, int) and last is not None and last >= planned:
        return "finished", f"reached steps={planned}"
    where = f"last step {last}" if last is not None else "nothing logged"
    if ckpts:
        return "stopped", (
            f"{where} of steps={planned}; resume=true continues from checkpoint step {ckpts[-1]}"
        )
    return "failed", f"{where} of steps={planned} and no complete checkpoint"
