"""The loop and the learner type-check under ``mypy --strict`` (issue 23: no signature there takes
``Any`` where a Protocol or dataclass exists; strict mode also checks the floors they import).
``make lint`` runs the same command; this keeps it true in the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_loop_and_learner_pass_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra (make venv installs it)")
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
                          "posttrain/loop", "posttrain/learner"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success" in out.stdout


def test_the_check_fails_on_an_any_typed_slip(tmp_path: Path) -> None:
    """Not vacuous: strict mode refuses an untyped function in the checked tree."""
    pytest.importorskip("mypy", reason="mypy is in the dev extra (make venv installs it)")
    bad = tmp_path / "slip.py"
    bad.write_text("def f(x):\n    return x\n")
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), str(bad)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and "no-untyped-def" in out.stdout
