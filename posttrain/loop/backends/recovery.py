"""Learner-kill recovery for queued samples: snapshot the unconsumed queue with each checkpoint,
then on resume either restore it (dropping, and counting, what became too stale) or discard it
explicitly (counted). Nothing is silently lost: every snapshotted sample ends up in exactly one
of ``restored``, ``stale_dropped`` or ``discarded``.

Contract with the loop (asynchronous modes):

1. when the learner checkpoints at step ``s`` (version ``v``), call
   ``save_pending(dir, queue_contents, step=s, learner_version=v)`` — the samples produced but not
   yet consumed at that moment (the queue, plus in-flight groups the loop already holds);
2. on resume from the step-``s`` checkpoint, call ``restore_pending(dir, step=s, policy=...,
   current_version=v, max_staleness=...)``, put the returned trajectories back in the queue
   before new rollouts, and log the returned counts (``pending/*``) with the first step's metrics.

The snapshot is one Parquet file per step (same row format as the ledger), written atomically
(temp file, fsync, rename), so a learner killed while writing leaves the previous snapshot intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.trajectory import Trajectory
from posttrain.trajectory.ledger import (
    TRAJECTORY_SCHEMA,
    row_to_trajectory,
    trajectory_to_row,
    write_parquet_atomic,
)

RecoveryPolicy = Literal["restore", "discard"]


@dataclasses.dataclass
class PendingSamples:
    """What :func:`restore_pending` returns: samples to re-queue and the counts to log."""

    trajectories: list[Trajectory]
    counts: dict[str, float]


def _path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"pending_step_{step:06d}.parquet"


def save_pending(directory: str | os.PathLike[str], trajectories: Sequence[Trajectory], *, step: int,
                 learner_version: int) -> Path:
    """Atomically write the unconsumed samples of checkpoint ``step`` (an empty queue writes an empty file)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajectories], schema=TRAJECTORY_SCHEMA)
    meta = {b"posttrain.pending": json.dumps({"step": step, "learner_version": learner_version,
                                                "count": len(trajectories)}).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    path = _path(d, step)
    write_parquet_atomic(table, path)
    return path


def _oldest_version(t: Trajectory) -> int | None:
    v = t.behavior_version[t.action_mask.astype(bool)]
    return int(np.min(v)) if v.size else None


def restore_pending(directory: str | os.PathLike[str], *, step: int, policy: RecoveryPolicy, current_version: int,
                    max_staleness: int | None = None) -> PendingSamples:
    """The samples snapshotted at ``step``, per ``policy`` (see the module docstring).

    ``restore``: a sample whose oldest behaviour version is more than ``max_staleness`` versions
    behind ``current_version`` is dropped and counted (``pending/stale_dropped``); the rest are
    returned (``pending/restored``). ``discard``: none returned, all counted (``pending/discarded``).
    A missing snapshot raises ``FileNotFoundError`` (a checkpoint without its queue is a bug to
    see, not a silent empty queue). ``pending/snapshot`` is the number of samples in the file.
    """
    if policy not in ("restore", "discard"):
        raise ValueError(f"policy must be 'restore' or 'discard', got {policy!r}")
    path = _path(directory, step)
    if not path.exists():
        raise FileNotFoundError(f"no pending-sample snapshot for step {step} at {path}")
    table = pq.read_table(path)
    meta = json.loads((table.schema.metadata or {}).get(b"posttrain.pending", b"{}"))
    trajs = [row_to_trajectory(r) for r in table.to_pylist()]
    if meta.get("count", len(trajs)) != len(trajs):
        raise ValueError(f"{path}: snapshot says {meta.get('count')} samples, file holds {len(trajs)}")
    counts = {"pending/snapshot": float(len(trajs)), "pending/restored": 0.0,
              "pending/stale_dropped": 0.0, "pending/discarded": 0.0}
    if policy == "discard":
        counts["pending/discarded"] = float(len(trajs))
        return PendingSamples([], counts)
    keep: list[Trajectory] = []
    for t in trajs:
        oldest = _oldest_version(t)
        if max_staleness is not None and oldest is not None and current_version - oldest > max_staleness:
            counts["pending/stale_dropped"] += 1
        else:
            keep.append(t)
    counts["pending/restored"] = float(len(keep))
    return PendingSamples(keep, counts)
