"""Console progress bars (rich), or a no-op when disabled."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Any]:
    """A ``rich.progress.Progress`` (``add_task`` / ``update``), or ``None`` when disabled."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as p:
        yield p
