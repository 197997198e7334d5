"""Issue 22 / deliverable 4: a ledger write that fails (disk full, Ctrl-C) leaves no temp file behind,
and the error names the file being written (a failed ``write`` carries no file name of its own)."""

from __future__ import annotations

import errno

import pytest

from posttrain.trajectory import Ledger
from posttrain.trajectory import ledger as ledger_mod


def _full_disk(after: bytes = b"PAR1 half a file"):
    """A stand-in for ``pq.write_table`` that writes some bytes, then fails like a full disk."""
    def write_table(table, where, **kw):
        where.write(after)
        raise OSError(errno.ENOSPC, "No space left on device")  # what a failed write(2) raises: no filename
    return write_table


@pytest.mark.parametrize("kind", ["trajectories", "metrics"])
def test_disk_full_leaves_no_temp_file_and_names_the_file(tmp_path, monkeypatch, kind):
    led = Ledger(tmp_path)
    monkeypatch.setattr(ledger_mod.pq, "write_table", _full_disk())
    with pytest.raises(OSError) as e:
        led.write_trajectories(3, []) if kind == "trajectories" else led.write_metrics(3, {"loss": 1.0})
    target = tmp_path / kind / "step_000003.parquet"
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    assert list((tmp_path / kind).iterdir()) == []  # no step_000003.parquet.tmp-<pid>, no half file
    monkeypatch.undo()  # space freed: the same step is written (append-only is not tripped by a leftover)
    (led.write_trajectories(3, []) if kind == "trajectories" else led.write_metrics(3, {"loss": 1.0}))
    assert [p.name for p in (tmp_path / kind).iterdir()] == ["step_000003.parquet"]


def test_an_interrupt_mid_write_leaves_no_temp_file_either(tmp_path, monkeypatch):
    def interrupted(table, where, **kw):
        where.write(b"PAR1")
        raise KeyboardInterrupt

    monkeypatch.setattr(ledger_mod.pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Ledger(tmp_path).write_metrics(1, {"loss": 1.0})
    assert list((tmp_path / "metrics").iterdir()) == []


def test_existing_step_is_still_refused_by_name(tmp_path):
    led = Ledger(tmp_path)
    led.write_metrics(1, {"loss": 1.0})
    with pytest.raises(FileExistsError, match="append-only: .*step_000001.parquet already exists"):
        led.write_metrics(1, {"loss": 2.0})
