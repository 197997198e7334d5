"""Step metrics sinks: JSONL always, TensorBoard / W&B / MLflow when configured (loop/trackers.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.config import RunConfig

from posttrain.loop.trackers import Tracker, TrackerError, build_trackers, scalars_of

__all__ = ["MetricsLog", "TrackerError"]


class MetricsLog:
    """Append one JSON object per step to ``metrics.jsonl`` (flushed each line, crash-safe), and
    hand each step's numeric metrics to the trackers (TensorBoard, W&B, MLflow: loop/trackers.py).

    :meth:`for_run` builds the trackers ``cfg.logging`` switches on; a tracker package that cannot
    be imported is one error line naming the extra, ``pip install 'posttrain[tracking]'``.
    """

    def __init__(self, run_dir: Path, *, trackers: Sequence[Tracker] = ()) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = list(trackers)
        self._fh = open(self.path, "a", buffering=1)

    @classmethod
    def for_run(cls, run_dir: Path, cfg: RunConfig) -> MetricsLog:
        """The log of a run: ``metrics.jsonl`` in ``run_dir`` plus the trackers of ``cfg.logging``
        (each given the resolved config ``cfg``); raises :class:`TrackerError` before metrics.jsonl is opened."""
        return cls(run_dir, trackers=build_trackers(Path(run_dir), cfg))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics`` of ``step`` to every sink (non-finite floats become null in JSON)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self.trackers:
            scalars = scalars_of(metrics)
            for t in self.trackers:
                t.log(step, scalars)

    def truncate_after(self, step: int) -> int:
        """Drop the lines of steps after ``step`` (a resume from checkpoint ``step`` redoes them).

        Rewritten atomically (temp file + rename, the temp removed on any error) so a crash or a
        full disk leaves the old file, never half of it; a line that does not parse (the torn
        last line of a killed run) is dropped too. Returns the number of lines dropped.
        """
        from posttrain.loop.run_dir import write_text_atomic

        self._fh.close()
        kept: list[str] = []
        dropped = 0
        try:
            for line in self.path.read_text().splitlines():
                try:
                    keep = int(json.loads(line)["step"]) <= step
                except (ValueError, KeyError, TypeError):
                    keep = False
                if keep:
                    kept.append(line)
                else:
                    dropped += 1
            if dropped:
                write_text_atomic(self.path, "".join(f"{x}\n" for x in kept))
        finally:
            self._fh = open(self.path, "a", buffering=1)
        return dropped

    def close(self) -> None:
        """Close every sink (the JSONL file first: it is the one that must survive)."""
        self._fh.close()
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.close()
