"""The run directory's guards: usable and writable, locked by one run, its recipe protected on resume.

- :func:`prepare_run_dir` creates ``run_dir`` and turns "is a file", "read-only" and the like
  into one-line :class:`~posttrain.cli.UserError` s naming the path;
- :class:`RunDirLock` holds an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` for the run's
  lifetime, so a second run into the same directory fails at once instead of interleaving its
  checkpoints, ledger and metrics with the first (the kernel drops the lock when the process
  dies, so a crash never leaves a stale lock behind);
- :func:`recipe_diff` lists what a ``resume=true`` would change against the run's ``config.yaml``
  (run controls such as ``steps`` may change; see :data:`RESUME_MAY_CHANGE`);
- :func:`write_text_atomic` writes a small file through a temp file and a rename, never leaving a
  ``.tmp`` behind (disk full included).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import yaml

from posttrain.cli import UserError

LOCK_NAME = ".lock"


class RunDirError(UserError, ValueError):
    """A user-fixable problem of the run directory or of a resume: one line, exit code 2.

    Also a ``ValueError``: under ``python -m posttrain.cli`` the CLI module runs as ``__main__``,
    a second copy whose ``UserError`` is another class, but it prints ``ValueError`` s as one line too.
    """

# Keys a resume may change without resume_force: they control how long / where / how visibly the
# run goes on, not what it trains (``steps``: extending a finished run is the usual resume).
RESUME_MAY_CHANGE = ("resume", "resume_force", "steps", "run_dir", "logging")
# Where the learner runs, not what it computes: a checkpoint resumes on any of these (learner ranks'
# DCP shards reshard on load; strategies agree within the documented tolerance). Not precision.
PLACEMENT_ONLY = ("learner.strategy", "learner.world_size", "learner.device", "learner.rank_timeout_s",
                  "learner.startup_timeout_s", "learner.weight_bucket_mb")


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


def refuse_to_overwrite(run_dir: Path) -> None:
    """A fresh run (``resume=false``) never writes into a directory that holds another run's history.

    History = a checkpoint, a ledger step file or a non-empty ``metrics.jsonl``; raises
    ``RunDirError`` naming the directory and the two ways on (resume it, or another run_dir).
    """
    held = []
    if any((run_dir / "checkpoints").glob("step_*")):
        held.append("checkpoints")
    if any((run_dir / "ledger").rglob("*.parquet")):
        held.append("ledger")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        held.append("metrics.jsonl")
    if held:
        raise _user_error(
            f"run_dir {run_dir} already holds a run ({', '.join(held)}); continue it with resume=true, "
            f"or choose another run_dir (nothing was written)"
        )


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


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def recipe_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["key: old -> new", ...]`` for the dotted keys that differ, except :data:`RESUME_MAY_CHANGE`
    and :data:`PLACEMENT_ONLY`.

    ``old`` is the run's ``config.yaml``, ``new`` the resolved config (``model_dump(mode="json")``);
    a key one side lacks shows as ``<absent>``.
    """
    fo, fn = _flatten(old), _flatten(new)
    out = []
    for k in sorted(set(fo) | set(fn)):
        if k.split(".")[0] in RESUME_MAY_CHANGE or k in PLACEMENT_ONLY:
            continue
        a, b = fo.get(k, "<absent>"), fn.get(k, "<absent>")
        if a != b:
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


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
