"""Step metrics sinks: JSONL always, TensorBoard / W&B when configured."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append one JSON object per step to ``metrics.jsonl`` (flushed each line, crash-safe).

    TensorBoard (``torch.utils.tensorboard``) and W&B are optional sinks; each is imported only
    when enabled and a missing package is a clear error naming the extra to install.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, wandb: bool = False, run_name: str = "run") -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1)
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("logging.tensorboard=true needs `pip install posttrain[tensorboard]`") from e
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb:
            try:
                import wandb as wb
            except ImportError as e:
                raise ImportError("logging.wandb=true needs `pip install posttrain[wandb]`") from e
            self._wandb = wb.init(project="posttrain", name=run_name, dir=str(run_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics`` of ``step`` to every sink (non-finite floats become null in JSON)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

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
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
