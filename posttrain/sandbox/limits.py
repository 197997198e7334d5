"""What a caller gives the sandbox and gets back: :class:`SandboxLimits` and :class:`SandboxResult`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``cpu_s`` is CPU seconds of the program (SIGXCPU, then SIGKILL one second
    later); ``wall_s`` the wall-clock deadline, counted from the harness' start handshake;
    ``memory_mb`` the address-space limit; ``file_size_mb`` the largest file the code may write;
    ``disk_mb`` the size of each of the work dir and ``/tmp`` (size-limited tmpfs where the level
    has a mount namespace, else counted from the host: ``disk_limit``); ``nproc`` the process count
    of the run's uid; ``output_bytes`` the cap on each of stdout and stderr."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 4
    nproc: int = 32
    open_files: int = 64
    output_bytes: int = 64 * 1024
    disk_mb: int = 32

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What happened. ``outcome`` is one of:

    ``ok`` (main.py ran to its end; ``tests`` holds ``None`` per passing test, else the error),
    ``exception`` (main.py raised ``error``), ``syntax_error``, ``exit`` (``sys.exit`` before
    the end), ``timeout`` (wall deadline), ``cpu_limit``, ``output_limit``, ``file_size_limit``,
    ``disk_limit`` (work dir over ``disk_mb``, levels without a tmpfs work dir), ``signal``
    (killed by ``signal``), ``no_report`` (the program's process or the harness ended without a
    result, e.g. ``os._exit``), ``sandbox_error`` (the sandbox itself failed before any of the
    program ran: the only infra error; never inferred from the program's output).
    """

    outcome: str
    isolation: str
    wall_s: float
    returncode: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: Mapping[str, Any] | None = None
    tests: tuple[Mapping[str, Any] | None, ...] = ()
    reason: str = ""


__all__ = ["SandboxLimits", "SandboxResult"]
