"""What the host offers the sandbox: whether runs drop to other uids (root), and the interpreter
an unprivileged uid can execute."""

from __future__ import annotations

import functools
import os
import stat
import sys
from pathlib import Path


def world_accessible(path: str) -> bool:
    """True if an unprivileged uid can execute ``path``: every ancestor o+x and the file o+x."""
    p = Path(os.path.realpath(path))
    try:
        for d in [*reversed(p.parents), p]:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    return True


def is_root() -> bool:
    """True when this process is root: runs then drop to leased uids (:mod:`posttrain.sandbox.uids`)."""
    return os.geteuid() == 0


@functools.cache
def sandbox_python() -> str:
    """The interpreter run inside the sandbox (stdlib only; ``-I -S``).

    The host's base interpreter if an unprivileged uid can execute it, else ``/usr/bin/python3``.
    """
    cands = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3",
             "/usr/local/bin/python3"]
    for c in cands:
        if os.path.exists(c) and (not is_root() or world_accessible(c)):
            return os.path.realpath(c)
    raise RuntimeError(f"sandbox: no interpreter usable by an unprivileged uid among {cands}")


__all__ = ["is_root", "sandbox_python", "world_accessible"]
