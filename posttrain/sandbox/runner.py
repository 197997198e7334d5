"""The sandbox's entry: :func:`run_python`, at the strongest level that works here
(:func:`isolation_level` probes each once per process and caches)."""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence

from posttrain.sandbox.host import is_root
from posttrain.sandbox.launcher import launch
from posttrain.sandbox.levels import BWRAP, DESCRIPTIONS, LEVELS, UNSHARE
from posttrain.sandbox.limits import SandboxLimits, SandboxResult


@functools.cache
def probe(level: str) -> str | None:
    """``None`` if ``level`` works on this machine, else why not (cached per process)."""
    if level == BWRAP and shutil.which("bwrap") is None:
        return "bwrap not installed (apt-get install bubblewrap)"
    if level == UNSHARE and (shutil.which("unshare") is None or not is_root()):
        return "unshare needs util-linux and root"
    r = launch(level, "print(6*7)", stdin="", files={}, tests=(), limits=SandboxLimits(wall_s=20.0))
    if r.outcome == "ok" and r.stdout.strip() == "42":
        return None
    return f"probe failed: {r.outcome} {r.reason} {r.stderr.strip()[:200]}"


def available_levels() -> list[str]:
    """Every isolation level that works on this machine, strongest first."""
    return [lv for lv in LEVELS if probe(lv) is None]


@functools.cache
def isolation_level() -> str:
    """The strongest working level (or ``$POSTTRAIN_SANDBOX`` if set); warns if not ``bwrap``."""
    forced = os.environ.get("POSTTRAIN_SANDBOX")
    if forced:
        if forced not in LEVELS:
            raise ValueError(f"POSTTRAIN_SANDBOX={forced!r}; valid: {', '.join(LEVELS)}")
        why = probe(forced)
        if why is not None:
            raise RuntimeError(f"POSTTRAIN_SANDBOX={forced!r} does not work here: {why}")
        return forced
    reasons: list[str] = []
    for lv in LEVELS:
        why = probe(lv)
        if why is None:
            if lv != BWRAP:
                warnings.warn(f"code sandbox falls back to {lv!r} ({DESCRIPTIONS[lv]}); "
                              f"stronger levels unavailable: {'; '.join(reasons)}", RuntimeWarning, stacklevel=2)
            return lv
        reasons.append(f"{lv}: {why}")
    raise RuntimeError(f"no sandbox level works: {'; '.join(reasons)}")


def run_python(
    code: str,
    *,
    tests: Sequence[str] = (),
    stdin: str = "",
    files: Mapping[str, str] | None = None,
    limits: SandboxLimits | None = None,
    isolation: str | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox, then each of ``tests`` against it.

    Each test runs in the harness' own process with real builtins; the names ``code`` defined
    resolve to proxies, so ``assert f(2) == 4`` calls ``f`` in the program's process and compares
    the plain value it returned (see :mod:`posttrain.sandbox.harness`). Top-level
    assignments in a test stay in the test. ``files`` (relative name -> text) are written next to
    ``main.py``; ``stdin`` (<= 32 KiB) is the program's standard input. Nothing of the run stays on
    the host. Never raises for anything the code does; see :class:`SandboxResult` for the outcomes.
    """
    level = isolation or isolation_level()
    if len(stdin.encode()) > 32 * 1024:
        raise ValueError("run_python: stdin is limited to 32 KiB")
    return launch(level, code, stdin=stdin, files=dict(files or {}), tests=tuple(tests),
                limits=limits or SandboxLimits())


__all__ = ["available_levels", "isolation_level", "probe", "run_python"]
