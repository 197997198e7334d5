"""Test helper: ``posttrain train ...`` (argv after the marker path) with one hook: before the learner's
fifth update it writes ``<marker>.ready`` (where learner rank 1 runs: ``LearnerRanks.placement[1]``)
and waits for ``<marker>.go`` — meanwhile the test removes that node from the simulated cluster — then
until Ray reports the node (id in ``.go``) dead, so the update meets the failure, not a worker that
outlives its raylet for a moment (or the rollout worker on that node, whose failure is another path)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from posttrain.cli import main
from posttrain.learner.ranks import LearnerRanks

_update = LearnerRanks.update


def _update_after_the_kill(self: LearnerRanks, *args: Any, **kwargs: Any) -> dict[str, float]:
    if self.version == 4:
        marker = Path(sys.argv[1])
        marker.with_suffix(".ready").write_text(self.placement[1])
        deadline = time.monotonic() + 120
        go = marker.with_suffix(".go")
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        import ray

        node = go.read_text()
        while time.monotonic() < deadline and any(n["NodeID"] == node and n["Alive"] for n in ray.nodes()):  # type: ignore[no-untyped-call]
            time.sleep(0.1)
    return _update(self, *args, **kwargs)


if __name__ == "__main__":
    LearnerRanks.update = _update_after_the_kill  # type: ignore[method-assign]
    sys.exit(main(["train", *sys.argv[2:]]))
