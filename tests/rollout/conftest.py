"""Rollout tests run torch single-threaded: the tiny models' small GEMMs gain nothing from a second
thread and lose a lot to OpenMP barriers when the 2-core machine is shared. Restored after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
