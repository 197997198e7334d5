"""A Ctrl-C that a finalizer swallows: recorded in the flag, reported in one line, never as a traceback.

CPython reports an exception raised inside ``__del__`` through ``sys.unraisablehook``, whose default prints
``Exception ignored in ...`` and a traceback: on the command line that reads like a crash (it failed
``tests/commands/test_interrupts.py``'s "no Traceback" check when a Ctrl-C landed in ``regex``'s finalizer).
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

from posttrain.loop.interrupt import SWALLOWED_NOTE, interrupt_flag, interrupted


class _SendsSigint:
    """Its finalizer sends this process SIGINT; the handler's ``KeyboardInterrupt`` is raised in ``__del__``."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the Python-level handler runs before os.kill returns


class _RaisesInDel:
    def __del__(self) -> None:
        raise ValueError("a finalizer's own bug")


def test_a_swallowed_interrupt_sets_the_flag_and_prints_one_line_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    previous = sys.unraisablehook
    with interrupt_flag():
        _SendsSigint()  # dropped at once: __del__ runs here
        _SendsSigint()  # a second one: still a single line
        assert interrupted()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.splitlines() == [SWALLOWED_NOTE]
    assert seen == []  # the interrupt did not reach the previous hook
    assert sys.unraisablehook is previous and not interrupted()


def test_other_unraisable_exceptions_still_reach_the_previous_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    with interrupt_flag():
        _RaisesInDel()
    assert len(seen) == 1 and isinstance(seen[0], ValueError)


def test_an_interrupt_outside_the_flag_is_not_quieted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an active block the hook is untouched: the note would claim a run that is not there."""
    seen: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous_handler = signal.signal(signal.SIGINT, raise_interrupt)
    try:
        _SendsSigint()
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    assert len(seen) == 1 and isinstance(seen[0], KeyboardInterrupt)
