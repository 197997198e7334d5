"""The append-only Parquet ledger: one file per step, written atomically.

Layout under ``root``::

    trajectories/step_000001.parquet   one row per trajectory (per-token fields as lists)
    metrics/step_000001.parquet        one row of scalar step metrics

A file is written to ``<name>.tmp-<pid>`` in the same directory, flushed, fsynced and renamed
(``os.replace`` is atomic on POSIX), so a writer killed mid-write leaves only a temp file that
readers ignore: the ledger is never corrupted. Writing a step that already exists is an error
(append-only). Any Parquet tool (DuckDB, pandas, polars) reads the files directly.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.trajectory.enums import Finish, Role, Status
from posttrain.trajectory.record import Reward, StepRecord, Trajectory

_STEP_RE = re.compile(r"^step_(\d{6,})\.parquet$")
_F64_MAP = pa.map_(pa.string(), pa.float64())

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("traj_id", pa.string()),
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("token_ids", pa.list_(pa.int64())),
        ("roles", pa.list_(pa.dictionary(pa.int8(), pa.string()))),
        ("action_mask", pa.list_(pa.int8())),
        ("behavior_logprob", pa.list_(pa.float64())),
        ("behavior_version", pa.list_(pa.int64())),
        ("old_logprob", pa.list_(pa.float64())),
        ("old_version", pa.int64()),
        ("ref_logprob", pa.list_(pa.float64())),
        ("ref_version", pa.int64()),
        ("finish", pa.string()),
        ("status", pa.string()),
        ("reward_components", _F64_MAP),
        ("reward_weights", _F64_MAP),
        ("reward_total", pa.float64()),
        ("verifier", pa.string()),
        ("env_seed", pa.int64()),
        ("snapshot_id", pa.string()),
        ("sampling", pa.string()),  # JSON object of scalars
        ("rng_seed", pa.int64()),
        ("timings", _F64_MAP),
        ("policy_lag", pa.int64()),
        ("meta", pa.string()),  # JSON object of scalars
        ("num_actions", pa.int64()),
        ("version_span", pa.int64()),
        # Added later: a file written before them lacks these columns and still loads (None).
        ("current_logprob", pa.list_(pa.float64())),
        ("advantage", pa.list_(pa.float64())),
        ("hidden_verifier", pa.string()),
        ("hidden_status", pa.string()),
        # The step record of a multi-turn episode (null for single-turn): StepRecord's three lists.
        ("step_anchors", pa.list_(pa.int64())),
        ("step_rewards", pa.list_(pa.float64())),
        ("step_action_tokens", pa.list_(pa.int64())),
        # The distillation teacher's per-token log-probs (loss.distill; null otherwise).
        ("teacher_logprob", pa.list_(pa.float64())),
    ]
)


def _opt_list(a: np.ndarray | None) -> list[Any] | None:
    return None if a is None else a.tolist()


def trajectory_to_row(t: Trajectory) -> dict[str, Any]:
    """One ledger row of ``t`` (lossless: floats stay float64, dicts keep their types via JSON)."""
    return {
        "traj_id": t.traj_id,
        "prompt_id": t.prompt_id,
        "group_id": t.group_id,
        "token_ids": t.token_ids.tolist(),
        "roles": [r.value for r in t.roles],
        "action_mask": t.action_mask.tolist(),
        "behavior_logprob": t.behavior_logprob.tolist(),
        "behavior_version": t.behavior_version.tolist(),
        "old_logprob": _opt_list(t.old_logprob),
        "old_version": t.old_version,
        "ref_logprob": _opt_list(t.ref_logprob),
        "ref_version": t.ref_version,
        "finish": t.finish.value,
        "status": None if t.status is None else t.status.value,
        "reward_components": list(t.reward.components.items()),
        "reward_weights": list(t.reward.weights.items()),
        "reward_total": t.reward.total,
        "verifier": t.verifier,
        "env_seed": t.env_seed,
        "snapshot_id": t.snapshot_id,
        "sampling": json.dumps(dict(t.sampling), sort_keys=True),
        "rng_seed": t.rng_seed,
        "timings": list(t.timings.items()),
        "policy_lag": t.policy_lag,
        "meta": json.dumps(dict(t.meta), sort_keys=True),
        "num_actions": t.num_actions,
        "version_span": t.version_span,
        "current_logprob": _opt_list(t.current_logprob),
        "advantage": _opt_list(t.advantage),
        "hidden_verifier": t.hidden_verifier,
        "hidden_status": None if t.hidden_status is None else t.hidden_status.value,
        "step_anchors": None if t.steps is None else list(t.steps.anchors),
        "step_rewards": None if t.steps is None else list(t.steps.rewards),
        "step_action_tokens": None if t.steps is None else list(t.steps.action_tokens),
        "teacher_logprob": _opt_list(t.teacher_logprob),
    }


def row_to_trajectory(row: Mapping[str, Any]) -> Trajectory:
    """Inverse of :func:`trajectory_to_row`; columns added after a file was written read as ``None``."""

    def arr(name: str, dtype: Any) -> np.ndarray | None:
        v = row.get(name)
        return None if v is None else np.asarray(v, dtype=dtype)

    return Trajectory(
        traj_id=row["traj_id"],
        prompt_id=row["prompt_id"],
        group_id=row["group_id"],
        token_ids=np.asarray(row["token_ids"], dtype=np.int64),
        roles=tuple(Role(r) for r in row["roles"]),
        action_mask=np.asarray(row["action_mask"], dtype=np.int8),
        behavior_logprob=np.asarray(row["behavior_logprob"], dtype=np.float64),
        behavior_version=np.asarray(row["behavior_version"], dtype=np.int64),
        old_logprob=arr("old_logprob", np.float64),
        old_version=row["old_version"],
        ref_logprob=arr("ref_logprob", np.float64),
        ref_version=row["ref_version"],
        finish=Finish(row["finish"]),
        status=None if row["status"] is None else Status(row["status"]),
        reward=Reward(
            components=dict(row["reward_components"] or []),
            weights=dict(row["reward_weights"] or []),
            total=row["reward_total"],
        ),
        verifier=row["verifier"],
        env_seed=row["env_seed"],
        snapshot_id=row["snapshot_id"],
        sampling=json.loads(row["sampling"]),
        rng_seed=row["rng_seed"],
        timings=dict(row["timings"] or []),
        policy_lag=row["policy_lag"],
        meta=json.loads(row["meta"]),
        current_logprob=arr("current_logprob", np.float64),
        advantage=arr("advantage", np.float64),
        hidden_verifier=row.get("hidden_verifier"),
        hidden_status=None if row.get("hidden_status") is None else Status(row["hidden_status"]),
        steps=None if row.get("step_anchors") is None else StepRecord(
            tuple(row["step_anchors"]), tuple(row["step_rewards"]), tuple(row["step_action_tokens"])),
        teacher_logprob=arr("teacher_logprob", np.float64),
    )


def _atomic_write(table: pa.Table, path: Path) -> None:
    if path.exists():
        raise FileExistsError(f"ledger is append-only: {path} already exists")
    write_parquet_atomic(table, path)


def naming(e: OSError, path: str | os.PathLike[str]) -> OSError:
    """An ``OSError`` like ``e`` (same errno, hence the same subclass) whose ``filename`` is ``path``.

    A failed ``write`` (disk full) carries no file name; the error a user sees must name the file
    being written (``cannot write <path>: disk full``), not a temp file or nothing.
    """
    if e.errno is not None:
        return OSError(e.errno, e.strerror or str(e), os.fspath(path))
    err = OSError(f"{os.fspath(path)}: {e}")
    err.filename = os.fspath(path)
    return err


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` so a reader sees the whole file or none of it.

    Temp file in the same directory (``<name>.tmp-<pid>``, which readers ignore), fsync, rename
    over ``path``, fsync of the directory: a writer killed at any point leaves at most a temp file.
    Any error while writing (disk full, I/O error, Ctrl-C) removes the temp file before it propagates;
    an ``OSError`` is re-raised naming ``path`` (:func:`naming`).
    """
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="zstd")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the original error is the one to report
        if isinstance(e, OSError) and not isinstance(e, FileExistsError):
            raise naming(e, path) from e
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError as e:
        raise naming(e, path.parent) from e
    finally:
        os.close(dir_fd)


class Ledger:
    """Append-only store of trajectories and step metrics under ``root`` (see module docs)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.traj_dir = self.root / "trajectories"
        self.metrics_dir = self.root / "metrics"

    @staticmethod
    def _name(step: int) -> str:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return f"step_{step:06d}.parquet"

    def write_trajectories(self, step: int, trajectories: Sequence[Trajectory]) -> Path:
        """Write the trajectories of ``step`` atomically; returns the file path."""
        self.traj_dir.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajectories], schema=TRAJECTORY_SCHEMA)
        path = self.traj_dir / self._name(step)
        _atomic_write(table, path)
        return path

    def write_metrics(self, step: int, metrics: Mapping[str, float | int | str | bool | None]) -> Path:
        """Write one row of scalar metrics for ``step`` atomically."""
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        bad = [k for k, v in metrics.items() if not isinstance(v, (int, float, str, bool, type(None)))]
        if bad:
            raise TypeError(f"metrics must be scalars; not scalar: {', '.join(bad)}")
        path = self.metrics_dir / self._name(step)
        _atomic_write(pa.Table.from_pylist([{"step": step, **metrics}]), path)
        return path

    def steps(self, kind: str = "trajectories") -> list[int]:
        """Completed steps on disk (temp files of killed writers are ignored)."""
        d = self.traj_dir if kind == "trajectories" else self.metrics_dir
        if not d.exists():
            return []
        return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_RE.match(p.name)))

    def iter_trajectories(self, steps: Sequence[int] | None = None) -> Iterator[tuple[int, Trajectory]]:
        """Yield ``(step, trajectory)`` in step order."""
        for s in self.steps() if steps is None else steps:
            table = pq.read_table(self.traj_dir / self._name(s))
            for row in table.to_pylist():
                yield s, row_to_trajectory(row)

    def read_trajectories(self, steps: Sequence[int] | None = None) -> list[Trajectory]:
        """All trajectories of ``steps`` (default: every completed step)."""
        return [t for _, t in self.iter_trajectories(steps)]

    def read_metrics(self) -> list[dict[str, Any]]:
        """One dict per completed step, in step order."""
        return [pq.read_table(self.metrics_dir / self._name(s)).to_pylist()[0] for s in self.steps("metrics")]

    def discard_after(self, step: int) -> list[Path]:
        """Move files of steps ``> step`` to ``discarded/`` (used on resume from an older checkpoint).

        Nothing is deleted: moved files stay auditable. Returns the new paths.
        """
        moved: list[Path] = []
        for kind, d in (("trajectories", self.traj_dir), ("metrics", self.metrics_dir)):
            for s in self.steps(kind):
                if s > step:
                    dest = self.root / "discarded" / kind
                    dest.mkdir(parents=True, exist_ok=True)
                    src = d / self._name(s)
                    target = dest / f"{src.stem}.{os.getpid()}.parquet"
                    os.replace(src, target)
                    moved.append(target)
        return moved
