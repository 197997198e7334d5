"""``posttrain --malloc tcmalloc|jemalloc|PATH COMMAND ...``: run a command under another C allocator.

torch's CPU tensors are C ``malloc`` blocks. glibc's allocator keeps the blocks a learner update frees in its
heap, so over several updates the heap's holes hold the peak resident memory above what is live
(docs/benchmarks.md, "Returning the freed heap"); tcmalloc (Google's thread-caching malloc, Ghemawat & Menage
2005) and jemalloc (Evans 2006) hand freed spans back. An allocator is chosen before the process starts
(the dynamic loader maps it ahead of the C library through ``LD_PRELOAD``), so the flag re-executes the
command once with ``LD_PRELOAD`` naming the library and ``POSTTRAIN_MALLOC`` set to it; the new process checks
that the library is mapped (``/proc/self/maps``) and says so on one stderr line, or stops with one line where
the loader ignored it. Child processes (bench children, rollout servers) inherit both variables.

The libraries are system packages, not Python ones: Debian/Ubuntu ``apt-get install libtcmalloc-minimal4``
(``libtcmalloc_minimal.so.4``) or ``libjemalloc2`` (``libjemalloc.so.2``). A name whose library is not found
is refused in one line naming the package; a path is taken as given.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import UserError

FLAG = "--malloc"
ENV_MARK = "POSTTRAIN_MALLOC"
"""Set to the preloaded library's path in the re-executed process (and its children)."""

LIBRARIES: dict[str, tuple[tuple[str, ...], str]] = {
    # name -> (shared-object names, most specific first; the Debian/Ubuntu package that ships them)
    "tcmalloc": (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "libtcmalloc-minimal4"),
    "jemalloc": (("libjemalloc.so.2",), "libjemalloc2"),
}
"""The allocators ``--malloc`` knows by name."""

LIB_DIRS: tuple[str, ...] = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu",
                             "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
"""Where a named allocator's library is looked for, in order."""


@dataclass(frozen=True)
class Reexec:
    """How to start the command again under the allocator: ``os.execve(executable, args, env)``."""

    executable: str
    args: list[str]
    env: dict[str, str]


def take_malloc_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(value of --malloc or None, argv without it)``; ``--malloc X`` and ``--malloc=X`` are read anywhere
    on the line (like ``--traceback``). A second ``--malloc`` or one without a value is a :class:`UserError`."""
    needs_value = f"{FLAG} needs a value: {' | '.join(LIBRARIES)} or the path of a shared library"
    value: str | None = None
    rest: list[str] = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a == FLAG or a.startswith(FLAG + "="):
            if value is not None:
                raise UserError(f"{FLAG} given twice")
            if a == FLAG:
                if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                    raise UserError(needs_value)
                value = argv[i + 1]
                next(it, None)
            else:
                value = a.split("=", 1)[1]
            if not value:
                raise UserError(needs_value)
            continue
        rest.append(a)
    return value, rest


def find_allocator(choice: str, search_dirs: Sequence[str] = LIB_DIRS) -> Path:
    """The shared library of ``choice``: a name of :data:`LIBRARIES` looked up in ``search_dirs``, or a path
    to an existing file. Anything else is a :class:`UserError` naming what to install or pass."""
    if choice in LIBRARIES:
        sonames, package = LIBRARIES[choice]
        for d in search_dirs:
            for so in sonames:
                p = Path(d) / so
                if p.is_file():
                    return p
        raise UserError(f"{FLAG} {choice}: none of {', '.join(sonames)} in {', '.join(search_dirs)}; install it "
                        f"(Debian/Ubuntu: apt-get install {package}) or pass the library's path: {FLAG} /path/to/{sonames[0]}")
    if "/" in choice or choice.endswith(".so") or ".so." in choice:
        p = Path(choice)
        if not p.is_file():
            raise UserError(f"{FLAG} {choice}: no such file")
        return p
    raise UserError(f"{FLAG} {choice!r}: unknown allocator; use one of {', '.join(LIBRARIES)} or a library path")


def is_mapped(library: Path, maps: str) -> bool:
    """Whether ``library`` (or the file its path resolves to) is mapped, per a ``/proc/PID/maps`` text."""
    want = {str(library), os.path.realpath(library)}
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and (parts[5] in want or os.path.realpath(parts[5]) in want):
            return True
    return False


def reexec_plan(library: Path, orig_argv: Sequence[str], environ: Mapping[str, str], executable: str) -> Reexec:
    """The same command line again (``orig_argv``: ``sys.orig_argv``, interpreter options and ``--malloc``
    included, so the new process checks the library) with ``library`` first in ``LD_PRELOAD`` and
    :data:`ENV_MARK` set to it."""
    env = dict(environ)
    pre = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != str(library)]
    env["LD_PRELOAD"] = ":".join([str(library), *pre])
    env[ENV_MARK] = str(library)
    return Reexec(executable, [executable, *orig_argv[1:]], env)


def apply_malloc_flag(argv: list[str], *, may_exec: bool) -> list[str]:
    """``argv`` without ``--malloc``. With the flag, in a fresh process (``may_exec``): re-execute the command
    under the allocator (this call then never returns); in the re-executed process (the same command line,
    :data:`ENV_MARK` naming the library): check that the library is mapped and say so on stderr. Linux only
    (``LD_PRELOAD``, ``/proc/self/maps``). Called by :func:`posttrain.cli.main` before anything else."""
    choice, rest = take_malloc_flag(argv)
    if choice is None:
        return rest
    if not sys.platform.startswith("linux"):
        raise UserError(f"{FLAG} needs Linux (LD_PRELOAD and /proc/self/maps); this is {sys.platform}")
    library = find_allocator(choice)
    if os.environ.get(ENV_MARK) == str(library):
        maps = Path("/proc/self/maps").read_text()
        if not is_mapped(library, maps):
            raise UserError(f"{FLAG} {choice}: LD_PRELOAD={os.environ.get('LD_PRELOAD', '')} did not load {library} "
                            "(the dynamic loader ignores LD_PRELOAD for set-user-ID programs and unloadable libraries)")
        print(f"posttrain: malloc {choice} ({library}, preloaded)", file=sys.stderr)
        return rest
    if not may_exec:
        raise UserError(f"{FLAG} starts the command again in a new process; run it from the shell "
                        f"(posttrain {FLAG} {choice} COMMAND ...)")
    plan = reexec_plan(library, sys.orig_argv, os.environ, sys.executable)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(plan.executable, plan.args, plan.env)
    raise AssertionError("unreachable: execve returned")  # pragma: no cover
