"""What the trainers' golden tests share (test_sft_golden.py, _offline_golden.py and its test): ``posttrain train``
run in-process with its lines captured (:func:`train_lines`), a SIGINT as the k-th call of a function begins
(:func:`sigint_at_call`), what a finished run left on disk (:func:`capture_run`), the comparison of its
checkpoints and metrics against a golden's (:func:`compare_checkpoints_and_metrics`) and the check that a
comparison catches a moved metric (:func:`check_catches_a_moved_loss_and_counter`)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

LOG_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
"""A line of ``posttrain train``'s logging format (``%(levelname)s %(message)s``)."""


def mask(text: str, run_dir: Path) -> str:
    """``text`` with the run directory as ``<RUN>`` and a summary's seconds as ``N``."""
    return re.sub(r" in \d+ s;", " in N s;", text.replace(str(run_dir), "<RUN>"))


@contextlib.contextmanager
def sigint_at_call(owner: Any, name: str, k: int | None) -> Iterator[None]:
    """Within the block, ``owner.name`` (a module's function or a class's method) sends this process a SIGINT
    as its ``k``-th call begins, then runs as before; ``k=None``: unchanged."""
    if k is None:
        yield
        return
    real, calls = getattr(owner, name), [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


def train_lines(recipe: str, run_dir: Path, overrides: list[str],
                during: contextlib.AbstractContextManager[Any] | None = None) -> tuple[int, list[str]]:
    """``posttrain train RECIPE run_dir=RUN_DIR OVERRIDES --no-progress`` in-process (inside ``during``, e.g.
    :func:`sigint_at_call`); ``(exit code, lines)``: the ``posttrain`` log messages, then the lines printed to
    stdout, then to stderr (but logging's), masked (:func:`mask`)."""
    from posttrain.cli import main

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler, logger = Keep(level=logging.INFO), logging.getLogger("posttrain")
    out, err = io.StringIO(), io.StringIO()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # the records whatever the root's level (pytest leaves it at WARNING)
    try:
        with during or contextlib.nullcontext(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["train", recipe, f"run_dir={run_dir}", *overrides, "--no-progress"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # stderr without logging's lines (a root handler that logging.basicConfig bound to it): the records above
    printed = [*out.getvalue().splitlines(), *(e for e in err.getvalue().splitlines() if not LOG_LINE.match(e))]
    return rc, [mask(line, run_dir) for line in [*records, *printed]]


def capture_run(run_dir: Path, timing: tuple[str, ...] = ("step_seconds",)) -> dict[str, Any]:
    """What a finished run left on disk: ``metrics`` (each ``metrics.jsonl`` line but the ``timing`` keys, which a
    clock decides), ``files`` (relative paths) and ``checkpoints`` (per checkpoint: step, format, ``extra`` but
    ``wall_seconds``, and the learner state's keys)."""
    import torch

    metrics = [{k: v for k, v in json.loads(line).items() if k not in timing}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    checkpoints = {}
    for ck in sorted((run_dir / "checkpoints").glob("step_*")):
        meta = json.loads((ck / "meta.json").read_text())
        state = torch.load(ck / "learner_state.pt", weights_only=True)
        checkpoints[ck.name] = {"step": meta["step"], "format": meta["format"],
                                "extra": {k: v for k, v in meta["extra"].items() if k != "wall_seconds"},
                                "learner_state": {k: sorted(v) for k, v in state.items()}}
    return {"metrics": metrics, "files": files, "checkpoints": checkpoints}


def compare_checkpoints_and_metrics(new: dict[str, Any], old: dict[str, Any], exact: tuple[str, ...],
                                    close: Callable[[float, float], bool]) -> None:
    """A run's checkpoints and metrics (:func:`capture_run`) against its golden's: per checkpoint its step, format,
    learner-state keys, ``extra`` keys, trainer and cursor exactly and its held-out curve's values by ``close``;
    per ``metrics.jsonl`` line the same keys, the ``exact`` counters (and a golden ``None``) equal, every other
    value by ``close``."""
    assert sorted(new["checkpoints"]) == sorted(old["checkpoints"])
    for name, g in old["checkpoints"].items():
        c = new["checkpoints"][name]
        for k in ("step", "format", "learner_state"):
            assert c[k] == g[k], f"{name}: {k} {c[k]} != {g[k]}"
        assert sorted(c["extra"]) == sorted(g["extra"]), f"{name}: extra keys {sorted(c['extra'])}"
        assert (c["extra"]["trainer"], c["extra"]["cursor"]) == (g["extra"]["trainer"], g["extra"]["cursor"]), name
        assert [s for s, _ in c["extra"]["curve"]] == [s for s, _ in g["extra"]["curve"]], f"{name}: curve steps"
        assert all(close(v, w) for (_, v), (_, w) in zip(c["extra"]["curve"], g["extra"]["curve"], strict=True)), (
            f"{name}: curve {c['extra']['curve']} != {g['extra']['curve']}")
    assert len(new["metrics"]) == len(old["metrics"]), f"{len(new['metrics'])} lines, golden {len(old['metrics'])}"
    for m, g in zip(new["metrics"], old["metrics"], strict=True):
        assert sorted(m) == sorted(g), f"step {g['step']}: metrics {sorted(set(m) ^ set(g))} added or lost"
        moved = [(k, m[k], v) for k, v in g.items()
                 if (m[k] != v if k in exact or v is None else not close(m[k], v))]
        assert not moved, f"step {g['step']}: {len(moved)} metrics moved, e.g. {moved[:6]}"


def check_catches_a_moved_loss_and_counter(compare: Callable[[dict[str, Any], dict[str, Any]], None],
                                           golden: dict[str, Any], counter: str) -> None:
    """The comparison is not vacuous: ``compare(golden, golden)`` passes, while a copy with the first loss moved by
    0.2% (+ 2e-3), or with ``counter`` off by one in its first line, fails it ("metrics moved")."""
    compare(golden, golden)
    off = json.loads(json.dumps(golden))
    line = next(m for m in off["metrics"] if "loss" in m)
    line["loss"] = line["loss"] * 1.002 + 2e-3
    with pytest.raises(AssertionError, match="metrics moved"):
        compare(off, golden)
    off = json.loads(json.dumps(golden))
    next(m for m in off["metrics"] if counter in m)[counter] += 1
    with pytest.raises(AssertionError, match="metrics moved"):
        compare(off, golden)


__all__ = ["LOG_LINE", "capture_run", "check_catches_a_moved_loss_and_counter", "compare_checkpoints_and_metrics",
           "mask", "sigint_at_call", "train_lines"]
