"""The run directory's guards: usable and writable, locked by one run, its recipe protected on resume.

- :func:`prepare_run_dir` creates ``run_dir`` and turns "is a file", "read-only" and the like
  into one-line :class:`~posttrain.errors.UserError` s naming the path;
- :class:`RunDirLock` holds an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` for the run's
  lifetime, so a second run into the same directory fails at once instead of interleaving its
  checkpoints, ledger and metrics with the first (the kernel drops the lock when the process
  dies, so a crash never leaves a stale lock behind);
- :func:`refuse_to_overwrite` keeps a fresh run out of another run's history: a directory with a
  complete checkpoint is refused (resume it, or choose another run_dir); a run that stopped before
  its first checkpoint is moved aside into ``failed_<UTC time>/`` and the new run starts there
  (:func:`holds_run_files` says whether there is any such file, e.g. after an interrupt);
- :func:`recipe_diff` lists what a ``resume=true`` would change against the run's ``config.yaml``
  (run controls such as ``steps`` and the keys of :data:`PLACEMENT_ONLY`, which change no
  arithmetic, may change; see :data:`RESUME_MAY_CHANGE`);
- :func:`write_text_atomic` writes a small file through a temp file and a rename, never leaving a
  ``.tmp`` behind (disk full included).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from posttrain.config.ray import REMOVED_KEYS as RAY_REMOVED_KEYS
from posttrain.errors import UserError

LOCK_NAME = ".lock"
FAILED_PREFIX = "failed_"
# What a run writes into its directory: moved together into failed_<time>/ when the run stopped before
# its first checkpoint (anything else in the directory is not the run's and stays where it is).
RUN_FILES = ("config.yaml", "config.step_*.yaml", "metrics.jsonl", "ledger", "checkpoints", "sft_losses.json",
             "tensorboard", "wandb", "mlruns", "mlflow", "engine_model", "engine_server*.log", "report.json",
             "report.png", "reference", "heldout_outcomes.jsonl")

log = logging.getLogger("posttrain")


class RunDirError(UserError, ValueError):
    """A user-fixable problem of the run directory or of a resume: one line, exit code 2 (also a
    ``ValueError``, which callers outside the command line may catch as such)."""

# Run controls a resume may change without resume_force: how long and where the run goes on
# (``steps``: extending a finished run is the usual resume).
RESUME_MAY_CHANGE = ("resume", "resume_force", "steps", "run_dir")
# Keys the config no longer has (config/ray.py REMOVED_KEYS): an older run's config.yaml lists them, the recipe
# cannot; their absence is no difference.
REMOVED = tuple(f"system.ray.{k}" for k in RAY_REMOVED_KEYS)
# The one set of keys that change no arithmetic of a step (what is sampled, rewarded, trained): a
# resume may change them without resume_force, and config.yaml then records the new values. A key
# matches itself and every key below it (``logging`` = ``logging.*``).
PLACEMENT_ONLY = (
    # where the learner runs, not what it computes: a checkpoint resumes on any of these (learner ranks'
    # DCP shards reshard on load; strategies agree within the documented tolerance). Not precision.
    "learner.strategy", "learner.world_size", "learner.device", "learner.rank_timeout_s",
    "learner.startup_timeout_s", "learner.weight_bucket_mb",
    # how the weights reach the engines (the same bytes, checksummed, either way)
    "system.ray.weight_sync",
    # how often the state is saved and how visibly the run goes on
    "checkpoint_every", "logging",
    # when the held-out evaluation runs (it reads the weights, draws from its own seeded generator and
    # leaves the training RNG alone; revisions are then judged at the new cadence)
    "eval.every",
    # monitors: they warn or stop the run, never change a step
    "guards",
    # bounds that only turn a hang into a loud failure
    "rollout.vllm.startup_timeout_s", "rollout.http.connect_timeout_s", "system.queue_timeout_s",
    # where the built-in engine runs (same samples within the float tolerance, tests/rollout/test_builtin_server.py)
    "rollout.process", "rollout.server",
    "system.ray.startup_timeout_s", "system.ray.transfer_timeout_s", "system.ray.learner_timeout_s",
)


def _user_error(msg: str) -> RunDirError:
    return RunDirError(msg)


def describe_os_error(e: OSError) -> str:
    """A short reason for an OSError: ``disk full``, ``read-only``, ``permission denied`` or its text."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk full (no space left on device)"
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return e.strerror or str(e)


def prepare_run_dir(run_dir: str | Path) -> Path:
    """Create ``run_dir`` (and parents) and check it is a writable directory; returns it.

    Raises ``UserError`` (one line naming the path) when it, or a parent, is a file, or when it
    cannot be created or written.
    """
    d = Path(run_dir)
    if d.exists() and not d.is_dir():
        raise _user_error(f"run_dir {d}: is a file, not a directory (choose another run_dir)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise _user_error(f"run_dir {d}: a parent of it is a file, not a directory") from None
    except OSError as e:
        raise _user_error(f"run_dir {d}: cannot be created: {describe_os_error(e)}") from None
    return d


def _last_logged_step(run_dir: Path) -> int | None:
    """The step of the last line of ``metrics.jsonl`` (0 = the step-0 evaluation), or None."""
    try:
        lines = [ln for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run_files(run_dir: Path) -> list[Path]:
    """The entries of :data:`RUN_FILES` present in ``run_dir`` (sorted, no duplicates)."""
    return sorted({p for pattern in RUN_FILES for p in run_dir.glob(pattern)})


def holds_run_files(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any of a run's files (:data:`RUN_FILES`; not ``.lock`` nor ``failed_*/``):
    False for a directory that does not exist, so an interrupted run can say that nothing was written."""
    return run_dir.is_dir() and bool(_run_files(run_dir))


def refuse_to_overwrite(run_dir: Path) -> Path | None:
    """A fresh run (``resume=false``) never writes into another run's history, and never loses it.

    - A complete checkpoint under ``checkpoints/`` (see
      :func:`~posttrain.learner.checkpoint.complete_checkpoints`): ``RunDirError`` naming the
      directory and the two ways on (``resume=true``, or another run_dir); nothing is touched.
    - The files of a run that stopped before its first checkpoint (:data:`RUN_FILES`: config.yaml,
      metrics.jsonl, ledger/, a half-written checkpoint...): moved, all together, into
      ``<run_dir>/failed_<UTC YYYYmmdd-HHMMSS>/``, with one warning naming the last logged step
      and the folder; returns that folder. The new run then starts in the emptied directory.
    - Nothing of a run: returns None.

    Called under the directory's :class:`RunDirLock`, so a live run's files are never moved.
    """
    from posttrain.learner.checkpoint import complete_checkpoints

    if complete_checkpoints(run_dir / "checkpoints"):
        raise _user_error(
            f"run_dir {run_dir} already holds a run (checkpoints); continue it with resume=true, "
            f"or choose another run_dir (nothing was written)"
        )
    files = _run_files(run_dir)
    if not files:
        return None
    step = _last_logged_step(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = run_dir / f"{FAILED_PREFIX}{stamp}"
    n = 1
    while dest.exists():
        dest = run_dir / f"{FAILED_PREFIX}{stamp}-{n}"
        n += 1
    try:
        dest.mkdir()
        for p in files:
            os.replace(p, dest / p.name)
    except OSError as e:
        raise _user_error(f"run_dir {run_dir}: cannot move the previous run's files to {dest}: "
                          f"{describe_os_error(e)}") from None
    where = "nothing was logged" if step is None else f"last step logged: {step}"
    log.warning("run_dir %s: the previous run stopped before its first checkpoint (%s); starting again, its "
                "files moved to %s/", run_dir, where, dest)
    return dest


class RunDirLock:
    """Exclusive lock of a run directory (``<run_dir>/.lock``, ``fcntl.flock``), released by :meth:`release`.

    The lock file holds the owner's pid, for the error message of the second run. Acquiring
    also proves the directory is writable (a read-only one fails here, as one line).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        try:
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _user_error(f"run_dir {self.run_dir}: not writable ({describe_os_error(e)})") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            self._fd = None
            raise _user_error(f"run_dir {self.run_dir}: in use by another run (pid {owner}); wait for it to "
                              "finish or choose another run_dir") from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            self.release()
            raise _user_error(f"run_dir {self.run_dir}: not writable ({describe_os_error(e)})") from None

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race a waiting run."""
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _changes(old: Mapping[str, object], new: Mapping[str, object], keep: Callable[[str], bool]) -> list[str]:
    fo, fn = _flatten(old), _flatten(new)
    out = []
    for k in sorted(set(fo) | set(fn)):
        if not keep(k):
            continue
        a, b = fo.get(k, "<absent>"), fn.get(k, "<absent>")
        if a != b:
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


def recipe_diff(old: Mapping[str, object], new: Mapping[str, object]) -> list[str]:
    """``["key: old -> new", ...]`` for the dotted keys that differ, except :data:`RESUME_MAY_CHANGE`
    :data:`PLACEMENT_ONLY` and :data:`REMOVED` (a listed key covers the keys below it).

    ``old`` is the run's ``config.yaml``, ``new`` the resolved config (``model_dump(mode="json")``);
    a key one side lacks shows as ``<absent>``.
    """
    return _changes(old, new, lambda k: not _matches(k, RESUME_MAY_CHANGE + PLACEMENT_ONLY + REMOVED))


def placement_changes(old: Mapping[str, object], new: Mapping[str, object]) -> list[str]:
    """``["key: old -> new", ...]`` for the :data:`PLACEMENT_ONLY` keys that differ: what a resume
    changes without ``resume_force`` (the new values are recorded in ``config.yaml``)."""
    return _changes(old, new, lambda k: _matches(k, PLACEMENT_ONLY))


def schedule_horizon_change(old: Mapping[str, object], new: Mapping[str, object]) -> str | None:
    """``"steps: A -> B with optim.schedule=S"`` when a resume changes ``steps`` under a decaying learning-rate
    schedule (``linear`` / ``cosine``, in ``old`` or ``new``), else None.

    The schedule's horizon is ``steps`` (x ``ppo_epochs`` x ``num_minibatches`` optimizer steps, see
    posttrain/learner/schedule.py), rebuilt from the recipe on resume: another ``steps`` re-stretches the
    curve, so the learning rate from the resumed step on is not the one the steps already taken followed
    (after a finished linear run it jumps from its floor back up). ``old`` / ``new`` as :func:`recipe_diff`'s.
    """
    a, b = old.get("steps"), new.get("steps")
    schedules = {str(o.get("schedule")) for o in (old.get("optim"), new.get("optim")) if isinstance(o, Mapping)}
    decaying = sorted(schedules - {"constant", "None"})
    if a == b or not decaying:
        return None
    return f"steps: {a!r} -> {b!r} with optim.schedule={'/'.join(decaying)}"


def read_config_yaml(path: Path) -> dict[str, Any] | None:
    """The mapping in a run's ``config.yaml``, or None when it is missing or unreadable."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via ``<path>.tmp`` + rename; on any error the temp file is removed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
