"""One uid pair per concurrent run (root hosts only): the lease and the clean-up of a uid's processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator

from posttrain.sandbox.host import is_root, sandbox_python

UID_BASE = 1_900_000_000
"""First uid of the pool (root hosts only). Slot ``k`` owns ``UID_BASE + 2k`` (the harness) and
``UID_BASE + 2k + 1`` (the program): no two concurrent runs, in any process of this host, share a
uid, so they cannot signal, ptrace or count against each other's process limit."""
UID_SLOTS = 512


def _lock_dir() -> str:
    for d in ("/run/posttrain-sandbox", os.path.join(tempfile.gettempdir(), f"posttrain-sandbox-{os.geteuid()}")):
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError:
            continue
        # A directory a sandboxed program could have made (world-writable /tmp) is not trusted.
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return d
    raise RuntimeError("sandbox: no private directory for the uid-slot locks")


@contextlib.contextmanager
def uid_lease() -> Iterator[tuple[int, int] | None]:
    """A (harness uid, program uid) pair held exclusively for the block; ``None`` when not root
    (then every run has the host's uid and only namespaces separate them)."""
    if not is_root():
        yield None
        return
    d = _lock_dir()
    first = secrets.randbelow(UID_SLOTS)
    for i in range(UID_SLOTS):
        slot = (first + i) % UID_SLOTS
        fd = os.open(os.path.join(d, f"{slot}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield UID_BASE + 2 * slot, UID_BASE + 2 * slot + 1
        finally:
            os.close(fd)  # releases the flock (also if this process dies)
        return
    raise RuntimeError(f"sandbox: all {UID_SLOTS} uid slots are in use")


def _has_processes(uid: int) -> bool:
    """True if a live (not zombie, not dead) process of ``uid`` exists."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid != uid:
                    continue
                with open(f"/proc/{d}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                return True
    return False


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (root only): the clean-up of levels without a pid namespace,
    which also catches processes that left the process group with ``setsid``.

    Spawns a killer only if ``/proc`` shows a process of ``uid``: with none there is nothing that
    could create one, and ``kill(-1)`` cannot be outrun by ``fork`` (the kernel holds the task
    list while it signals)."""
    if not _has_processes(uid):
        return
    # kill(-1) from the uid itself reaches exactly that uid's processes (and not the caller).
    kill = shutil.which("kill", path="/usr/bin:/bin")
    argv = ([kill, "-9", "-1"] if kill else
            [sandbox_python(), "-I", "-S", "-c", "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"])
    subprocess.run(argv, user=uid, group=uid, extra_groups=[], env={}, cwd="/", stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


__all__ = ["UID_BASE", "UID_SLOTS", "kill_uid", "uid_lease"]
