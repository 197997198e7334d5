"""Rewards tests: prints the sandbox isolation level in the test report header and summary.

Also puts this folder on ``sys.path`` so pool worker processes can import the misbehaving test
verifiers of ``_verifiers_for_tests`` by name (``forkserver`` passes ``sys.path`` to workers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _levels() -> str:
    from posttrain.sandbox import DESCRIPTIONS, LEVELS, available_levels, isolation_level
    from posttrain.sandbox.runner import probe

    lv = isolation_level()
    missing = "; ".join(f"{x} unavailable: {probe(x)}" for x in LEVELS if probe(x) is not None)
    return (f"code sandbox isolation: {lv} ({DESCRIPTIONS[lv]}); available here: {', '.join(available_levels())}"
            + (f"; {missing}" if missing else ""))


def pytest_report_header(config: pytest.Config) -> str:
    """Shown at the top of every run (no ``-s`` needed)."""
    return _levels()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Repeated at the end of the run so it is in the tail of CI logs."""
    terminalreporter.write_line(_levels())
