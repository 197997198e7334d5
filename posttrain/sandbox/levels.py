"""The isolation levels (strongest first) and the command line that starts a run at each.

See :mod:`posttrain.sandbox` for what each level isolates; :mod:`posttrain.sandbox.harness` is
the program every command runs (its source is passed with ``-c``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.sandbox.host import sandbox_python
from posttrain.sandbox.limits import SandboxLimits

BWRAP = "bwrap"
UNSHARE = "unshare-net"
RLIMITS_ONLY = "rlimits-only"
LEVELS = (BWRAP, UNSHARE, RLIMITS_ONLY)

DESCRIPTIONS = {
    BWRAP: "bubblewrap: user/pid/net/mount/ipc/uts namespaces, per-run uid, read-only root, sized tmpfs /work and /tmp",
    UNSHARE: "unshare: net/pid/mount/ipc/uts namespaces, per-run uids, own /proc, read-only host root, sized tmpfs "
             "work dir and /tmp; host files readable by permissions",
    RLIMITS_ONLY: "WARNING rlimits only: network reachable, host files readable with the host user's permissions, "
                  "host /tmp writable, other processes visible in /proc",
}

NOBODY = 65534
WORK_IN_SANDBOX = "/work"


@functools.cache
def harness_source() -> str:
    """The source of :mod:`posttrain.sandbox.harness` (run with ``python -I -S -c``)."""
    return Path(__file__).with_name("harness.py").read_text()


# unshare level: in the new mount namespace (private propagation) make the host's root read-only,
# hide the host's /tmp, /var/tmp, /dev/shm and /run (and their sockets) under small tmpfs, and
# give the work dir its own size-limited tmpfs. A failing step exits before the harness' handshake,
# so it is reported as the sandbox's failure.
_UNSHARE_SETUP = r"""set -e
mount -o remount,bind,ro /
mount -t tmpfs -o "size=$1k,nr_inodes=16384,mode=1777,nosuid,nodev" tmpfs /tmp
for d in /var/tmp /dev/shm /run; do
  if [ -d "$d" ] && [ ! -L "$d" ]; then mount -t tmpfs -o "size=1024k,nr_inodes=1024,mode=1777,nosuid,nodev" tmpfs "$d"; fi
done
mkdir /tmp/w
mount -t tmpfs -o "size=$1k,nr_inodes=16384,mode=0700,uid=$2,gid=$2,nosuid,nodev" tmpfs /tmp/w
cd /tmp/w
shift 2
exec "$@"
"""
UNSHARE_WORK = "/tmp/w"


def bwrap_cmd(python: str, disk_bytes: int) -> list[str]:
    """The bubblewrap prefix of a ``bwrap`` run (``disk_bytes``: size of the ``/work`` and ``/tmp`` tmpfs)."""
    size = str(disk_bytes)
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(NOBODY),
           "--gid", str(NOBODY), "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    prefix = str(Path(python).parent.parent)
    if not prefix.startswith("/usr"):
        cmd += ["--ro-bind", prefix, prefix]
    # bwrap's root and /dev are unbounded tmpfs: made read-only, with sized tmpfs where writing is
    # allowed (measured: without --remount-ro, "/" and /dev/shm took any amount of data).
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev",
            "--dir", "/tmp", "--dir", WORK_IN_SANDBOX, "--remount-ro", "/dev", "--remount-ro", "/",
            "--size", str(2**20), "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp",
            "--size", size, "--tmpfs", WORK_IN_SANDBOX, "--chdir", WORK_IN_SANDBOX, "--"]
    return cmd


def command(level: str, cfg: Mapping[str, Any], limits: SandboxLimits, uids: tuple[int, int] | None,
             work: str | None) -> tuple[list[str], dict[str, Any], str]:
    """argv, extra Popen kwargs and host cwd of one run at ``level``."""
    py = sandbox_python()
    inner = [py, "-I", "-S", "-c", harness_source()]
    disk = limits.disk_mb * 2**20
    if level == BWRAP:
        # bwrap itself runs as the program uid when root: unprivileged outside the namespace too, so
        # RLIMIT_NPROC holds, and unique per run.
        popen = {"user": uids[1], "group": uids[1], "extra_groups": []} if uids else {}
        return [*bwrap_cmd(py, disk), *inner, json.dumps(dict(cfg, uids=None))], popen, "/"
    if level == UNSHARE:
        assert uids is not None
        argv = ["unshare", "--mount", "--propagation", "private", "--net", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--ipc", "--uts", "--", "sh", "-c", _UNSHARE_SETUP, "sh",
                str(limits.disk_mb * 1024), str(uids[1])]
        return [*argv, *inner, json.dumps(dict(cfg, uids=list(uids)))], {}, "/"
    if level == RLIMITS_ONLY:
        assert work is not None
        return [*inner, json.dumps(dict(cfg, uids=list(uids) if uids else None))], {}, work
    raise ValueError(f"unknown isolation level {level!r}; valid: {', '.join(LEVELS)}")


__all__ = ["BWRAP", "DESCRIPTIONS", "LEVELS", "NOBODY", "RLIMITS_ONLY", "UNSHARE", "UNSHARE_WORK", "WORK_IN_SANDBOX",
           "bwrap_cmd", "command", "harness_source"]
