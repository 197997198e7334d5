"""Deliberately misbehaving verifiers for the pool tests (imported by worker processes)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status


@dataclasses.dataclass(frozen=True)
class Echo:
    """correct iff response == reference; records the worker pid in the explanation."""

    name: str = "echo"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        ok = response == reference
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)}, f"pid {os.getpid()}")


@dataclasses.dataclass(frozen=True)
class Sleeps:
    """Sleeps ``seconds`` (interruptible by the worker's alarm)."""

    seconds: float = 60.0
    name: str = "sleeps"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        time.sleep(self.seconds)
        return Verdict(Status.CORRECT, {"task": 1.0})


@dataclasses.dataclass(frozen=True)
class HangsBlockingAlarm:
    """Blocks SIGALRM then sleeps: only the host-side kill can stop it."""

    name: str = "hangs"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(60)
        return Verdict(Status.CORRECT, {"task": 1.0})


@dataclasses.dataclass(frozen=True)
class Raises:
    name: str = "raises"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        raise RuntimeError("verifier bug")


@dataclasses.dataclass(frozen=True)
class Crashes:
    """Kills its worker process."""

    name: str = "crashes"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        os._exit(13)


@dataclasses.dataclass(frozen=True)
class FailsOnce:
    """Raises on the first attempt for a given marker file, succeeds afterwards."""

    marker_dir: str = "/nonexistent"
    name: str = "fails_once"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        m = Path(self.marker_dir, response)
        if not m.exists():
            m.write_text("seen")
            raise RuntimeError("transient failure")
        return Verdict(Status.CORRECT, {"task": 1.0}, "second attempt")


@dataclasses.dataclass(frozen=True)
class NotAVerdict:
    name: str = "not_a_verdict"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Any:
        return 1.0


@dataclasses.dataclass(frozen=True)
class Spins:
    """A pure-Python infinite loop: only an asynchronous interrupt (in-process guard) or a kill stops it."""

    name: str = "spins"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        n = 0
        while True:
            n += 1


@dataclasses.dataclass(frozen=True)
class OnThread:
    """correct; the explanation names the thread that verified it."""

    name: str = "on_thread"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        import threading

        return Verdict(Status.CORRECT, {"task": 1.0}, f"thread {threading.get_ident()}")


@dataclasses.dataclass(frozen=True)
class Exits:
    """Calls ``sys.exit`` (a BaseException that ``run_one``'s ``except Exception`` lets through)."""

    name: str = "exits"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        import sys

        sys.exit(3)
