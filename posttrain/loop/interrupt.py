"""Ctrl-C as a flag that no finalizer can swallow.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to be. When that
is a finalizer (``__del__``, a ``weakref.finalize`` callback, a C library's cleanup), Python prints
``Exception ignored in ...`` and goes on: the interrupt is lost and the run would train on to its end.

:func:`interrupt_flag` installs, for the duration of ``posttrain train``, a SIGINT handler that first
records the interrupt in a process-wide flag and then raises ``KeyboardInterrupt`` as Python's own handler
does (the stop stays prompt). The trainers' step loops call :func:`raise_if_interrupted` between steps,
and the command checks :func:`interrupted` whatever way the run ended, so a swallowed interrupt still
ends the command with exit code 130 and its run directory as the prompt path leaves it. While the block is
active, a swallowed ``KeyboardInterrupt`` is not reported as Python's ``Exception ignored in ...`` traceback
(which reads like a crash) but as one line saying the run stops at the end of its step.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


class _State:
    """The process-wide flag and whether a handler of :func:`interrupt_flag` is installed."""

    interrupted = False
    active = False
    noted = False


_state = _State()


def interrupted() -> bool:
    """Whether a SIGINT reached the handler of the active :func:`interrupt_flag` (False outside one)."""
    return _state.interrupted


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` when :func:`interrupted`: the check a step loop makes between steps."""
    if _state.interrupted:
        raise KeyboardInterrupt("a SIGINT was recorded; its KeyboardInterrupt was swallowed on the way")


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """Record the interrupt, then stop promptly as Python's default handler does."""
    _state.interrupted = True
    raise KeyboardInterrupt


SWALLOWED_NOTE = "Ctrl-C arrived inside a finalizer; the run stops at the end of this step"


UnraisableHook = Callable[["sys.UnraisableHookArgs"], object]


def _quiet_swallowed_interrupt(previous: UnraisableHook) -> UnraisableHook:
    """An ``sys.unraisablehook`` that reports a swallowed ``KeyboardInterrupt`` in one line, the rest as before.

    Contract: an unraisable ``KeyboardInterrupt`` (one raised by :func:`_on_sigint` inside ``__del__`` or a
    C library's cleanup) prints :data:`SWALLOWED_NOTE` to stderr, once per block, and nothing else (the
    flag already holds it); any other unraisable exception goes to ``previous`` unchanged.
    """
    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _state.interrupted:
            if not _state.noted:
                _state.noted = True
                print(SWALLOWED_NOTE, file=sys.stderr, flush=True)
            return
        previous(unraisable)

    return hook


def forget_handled_interrupt() -> None:
    """Clear CPython's mark of an unhandled ``KeyboardInterrupt``, once the command has handled it.

    Contract: CPython marks a ``KeyboardInterrupt`` that leaves code run through ``PyRun_*`` (C extensions
    run Python that way, e.g. during torch's import) as unhandled even when the caller catches it, and a
    ``python -m`` process so marked ends by SIGINT at exit (status -2) whatever exit code it asked for.
    Every ``PyRun_*`` call clears the mark first, so running an empty one here does; a no-op outside CPython.
    """
    if sys.implementation.name != "cpython":
        return
    try:
        import ctypes

        run = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_char_p, ctypes.c_int, ctypes.py_object,
                                ctypes.py_object)(("PyRun_String", ctypes.pythonapi))
        run(b"None", 258, {}, {})  # 258: Py_eval_input
    except (ImportError, AttributeError, OSError):
        pass


@contextmanager
def interrupt_flag() -> Iterator[None]:
    """Within the block, SIGINT sets the flag of :func:`interrupted` and raises ``KeyboardInterrupt``.

    Contract: the flag is cleared on entry and on exit, and the previous SIGINT handler and
    ``sys.unraisablehook`` are restored on exit
    (in-process callers and tests keep theirs). Nothing is installed outside the main thread (signals reach
    only it), when SIGINT is ignored (a background job of a script keeps ignoring it), or inside an active
    block (the outer block owns the flag).
    """
    installable = (threading.current_thread() is threading.main_thread() and not _state.active
                   and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    if not installable:
        yield
        return
    _state.interrupted = False
    _state.noted = False
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_swallowed_interrupt(previous_hook)
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _state.active = True
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        sys.unraisablehook = previous_hook
        _state.active = False
        _state.interrupted = False
        _state.noted = False


__all__ = ["forget_handled_interrupt", "interrupt_flag", "interrupted", "raise_if_interrupted"]
