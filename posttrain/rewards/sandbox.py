"""A sandbox for model-written Python: separate processes with limits, no network, nothing left behind.

Isolation levels (strongest first; :func:`isolation_level` probes once and caches):

``bwrap``
    bubblewrap (``bwrap --unshare-all --die-with-parent --new-session --uid 65534``): new user,
    pid (own ``/proc``), network, mount, ipc and uts namespaces; a read-only root with ``/usr``
    (+ the interpreter's prefix) read-only, size-limited tmpfs ``/work`` (the work dir) and
    ``/tmp`` (``disk_mb`` each) and ``/dev/shm`` (1 MiB). When the host runs as root, bwrap itself
    is started as the run's own unprivileged uid (see *uids*), so ``RLIMIT_NPROC`` holds (as
    root it is not enforced).
``unshare-net``
    util-linux ``unshare --mount --net --pid --fork --mount-proc --ipc --uts`` (needs root): in
    the private mount namespace the host root is re-mounted read-only, ``/tmp`` and the work dir
    ``/tmp/w`` are size- and inode-limited tmpfs, ``/var/tmp``, ``/dev/shm`` and ``/run`` are
    small empty tmpfs (hiding their sockets); own ``/proc``. The harness and the program drop to
    the run's uids. Host files stay readable as far as their permissions allow.
``rlimits-only``
    WARNING level: plain subprocesses with resource limits and a throwaway work dir on the host
    disk (its size is measured by the host: ``disk_limit``). The network is reachable, files are
    readable with the host user's permissions, the host's ``/tmp`` is writable and other
    processes are visible in ``/proc``. Used only when neither of the above works; announced
    with a warning and named in every result.

*uids*: when the host is root, each run leases a pair of uids from a pool (:data:`UID_BASE`)
through a lock file, one for the harness and one for the program, so concurrent runs (in any
process) cannot signal or ptrace each other or exhaust each other's process limit; at
``rlimits-only`` every process of both uids is killed after the run (``setsid`` escapes too).
Without root every run has the host's uid and only the namespaces separate runs.

Everywhere the program runs under ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
``RLIMIT_NPROC``, ``RLIMIT_NOFILE`` and ``RLIMIT_CORE = 0``, a wall-clock deadline after which
the whole tree is killed, and caps on the stdout / stderr kept (``output_limit``).
``POSTTRAIN_SANDBOX`` forces a level (``bwrap`` | ``unshare-net`` | ``rlimits-only``).

Threat model: the program is adversarial, including a policy optimised against the reward
(reward hacking). It must not harm the host and must not obtain a verdict it did not earn:

* the tests run in the harness process (:mod:`posttrain.rewards.sandbox_harness`), never in
  the program's interpreter; the program's functions are called over a pipe and only plain
  builtin values come back, so redefining ``__eq__``, builtins or the harness' helpers does not
  change what a test sees; the tests and the nonce are read only after the program's process
  was forked, from an fd it never holds; the harness is non-dumpable (and at the lower levels a
  different uid), so its memory, fds and report pipe are out of the program's reach;
* ``sandbox_error`` (an infra error, excluded from training) is decided only from facts the
  program cannot produce: the harness' start handshake on the report pipe (written before any
  program code runs) and the harness' own setup failure; never from stdout / stderr or exit
  codes of the program;
* a program that kills the harness or itself gets ``no_report`` / ``signal`` (a failure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import os
import posixpath
import secrets
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

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
_WORK_IN_SANDBOX = "/work"


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


def _world_accessible(path: str) -> bool:
    """True if an unprivileged uid can execute ``path``: every ancestor o+x and the file o+x."""
    p = Path(os.path.realpath(path))
    try:
        for d in [*reversed(p.parents), p]:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    return True


def _drop_needed() -> bool:
    return os.geteuid() == 0


@functools.cache
def sandbox_python() -> str:
    """The interpreter run inside the sandbox (stdlib only; ``-I -S``).

    The host's base interpreter if an unprivileged uid can execute it, else ``/usr/bin/python3``.
    """
    cands = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3",
             "/usr/local/bin/python3"]
    for c in cands:
        if os.path.exists(c) and (not _drop_needed() or _world_accessible(c)):
            return os.path.realpath(c)
    raise RuntimeError(f"sandbox: no interpreter usable by an unprivileged uid among {cands}")


@functools.cache
def _harness_source() -> str:
    return Path(__file__).with_name("sandbox_harness.py").read_text()


# ------------------------------------------------------------------ one uid pair per concurrent run

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
def _uid_lease() -> Iterator[tuple[int, int] | None]:
    """A (harness uid, program uid) pair held exclusively for the block; ``None`` when not root
    (then every run has the host's uid and only namespaces separate them)."""
    if not _drop_needed():
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


def _kill_uid(uid: int) -> None:
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


# ------------------------------------------------------------------ commands per level

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
_UNSHARE_WORK = "/tmp/w"


def _bwrap_cmd(python: str, disk_bytes: int) -> list[str]:
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
            "--dir", "/tmp", "--dir", _WORK_IN_SANDBOX, "--remount-ro", "/dev", "--remount-ro", "/",
            "--size", str(2**20), "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp",
            "--size", size, "--tmpfs", _WORK_IN_SANDBOX, "--chdir", _WORK_IN_SANDBOX, "--"]
    return cmd


def _command(level: str, cfg: Mapping[str, Any], limits: SandboxLimits, uids: tuple[int, int] | None,
             work: str | None) -> tuple[list[str], dict[str, Any], str]:
    """argv, extra Popen kwargs and host cwd of one run at ``level``."""
    py = sandbox_python()
    inner = [py, "-I", "-S", "-c", _harness_source()]
    disk = limits.disk_mb * 2**20
    if level == BWRAP:
        # bwrap itself runs as the program uid when root: unprivileged outside the namespace too, so
        # RLIMIT_NPROC holds, and unique per run.
        popen = {"user": uids[1], "group": uids[1], "extra_groups": []} if uids else {}
        return [*_bwrap_cmd(py, disk), *inner, json.dumps(dict(cfg, uids=None))], popen, "/"
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


@functools.cache
def _probe(level: str) -> str | None:
    """``None`` if ``level`` works on this machine, else why not (cached per process)."""
    if level == BWRAP and shutil.which("bwrap") is None:
        return "bwrap not installed (apt-get install bubblewrap)"
    if level == UNSHARE and (shutil.which("unshare") is None or not _drop_needed()):
        return "unshare needs util-linux and root"
    r = _run(level, "print(6*7)", stdin="", files={}, tests=(), limits=SandboxLimits(wall_s=20.0))
    if r.outcome == "ok" and r.stdout.strip() == "42":
        return None
    return f"probe failed: {r.outcome} {r.reason} {r.stderr.strip()[:200]}"


def available_levels() -> list[str]:
    """Every isolation level that works on this machine, strongest first."""
    return [lv for lv in LEVELS if _probe(lv) is None]


@functools.cache
def isolation_level() -> str:
    """The strongest working level (or ``$POSTTRAIN_SANDBOX`` if set); warns if not ``bwrap``."""
    forced = os.environ.get("POSTTRAIN_SANDBOX")
    if forced:
        if forced not in LEVELS:
            raise ValueError(f"POSTTRAIN_SANDBOX={forced!r}; valid: {', '.join(LEVELS)}")
        why = _probe(forced)
        if why is not None:
            raise RuntimeError(f"POSTTRAIN_SANDBOX={forced!r} does not work here: {why}")
        return forced
    reasons: list[str] = []
    for lv in LEVELS:
        why = _probe(lv)
        if why is None:
            if lv != BWRAP:
                warnings.warn(f"code sandbox falls back to {lv!r} ({DESCRIPTIONS[lv]}); "
                              f"stronger levels unavailable: {'; '.join(reasons)}", RuntimeWarning, stacklevel=2)
            return lv
        reasons.append(f"{lv}: {why}")
    raise RuntimeError(f"no sandbox level works: {'; '.join(reasons)}")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    # The process group of the session we started; bwrap / unshare additionally tear down
    # their pid namespace when their first child dies.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


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
    the plain value it returned (see :mod:`posttrain.rewards.sandbox_harness`). Top-level
    assignments in a test stay in the test. ``files`` (relative name -> text) are written next to
    ``main.py``; ``stdin`` (<= 32 KiB) is the program's standard input. Nothing of the run stays on
    the host. Never raises for anything the code does; see :class:`SandboxResult` for the outcomes.
    """
    level = isolation or isolation_level()
    if len(stdin.encode()) > 32 * 1024:
        raise ValueError("run_python: stdin is limited to 32 KiB")
    return _run(level, code, stdin=stdin, files=dict(files or {}), tests=tuple(tests),
                limits=limits or SandboxLimits())


def _check_name(name: str) -> None:
    norm = posixpath.normpath(name)
    if not name or posixpath.isabs(name) or norm == "." or norm.split("/")[0] == "..":
        raise ValueError(f"run_python: file name {name!r} leaves the work dir")


def _control_fd(files: Mapping[str, str], secret: Mapping[str, Any]) -> int:
    """An anonymous file holding two length-prefixed JSON frames: the files (read before the
    harness forks the program) and the nonce and tests (read after, so never in its memory)."""
    fd = os.memfd_create("posttrain-sandbox-ctl", os.MFD_CLOEXEC)
    for part in (files, secret):
        data = json.dumps(part).encode()
        os.write(fd, struct.pack(">Q", len(data)))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run(level: str, code: str, *, stdin: str, files: Mapping[str, str], tests: tuple[str, ...],
         limits: SandboxLimits) -> SandboxResult:
    for name in files:
        _check_name(name)
    t0 = time.perf_counter()
    with _uid_lease() as uids:
        work: str | None = None
        try:
            if level == RLIMITS_ONLY:
                work = tempfile.mkdtemp(prefix="posttrain-sbx-")
                if uids:
                    for u in uids:
                        _kill_uid(u)  # leftovers of a host that died mid-run with this slot
            nonce = secrets.token_hex(16)
            ctl = _control_fd({**files, "main.py": code}, {"nonce": nonce, "tests": list(tests)})
            rfd, wfd = os.pipe()
            cfg = {"ctl": ctl, "rep": wfd, "limits": {
                "cpu": int(limits.cpu_s), "mem": limits.memory_mb * 2**20, "fsize": limits.file_size_mb * 2**20,
                "nproc": limits.nproc, "nofile": limits.open_files}}
            argv, popen_kw, cwd = _command(level, cfg, limits, uids, work)
            home = {BWRAP: _WORK_IN_SANDBOX, UNSHARE: _UNSHARE_WORK}.get(level, work)
            env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
                   "PYTHONDONTWRITEBYTECODE": "1"}
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(wfd, ctl), cwd=cwd, env=env, start_new_session=True, **popen_kw)
            except OSError as e:
                os.close(rfd)
                return SandboxResult("sandbox_error", level, time.perf_counter() - t0, reason=f"cannot start: {e}")
            finally:
                os.close(wfd)
                os.close(ctl)
            return _supervise(proc, rfd, nonce, stdin, limits, level, t0, work)
        finally:
            if level == RLIMITS_ONLY and uids:
                for u in uids:
                    _kill_uid(u)
            if work is not None and not _remove_tree(work):
                warnings.warn(f"sandbox: could not remove the work dir {work}", RuntimeWarning, stacklevel=2)


_STARTUP_S = 20.0  # the most a sandbox may take to come up before it counts as broken
_READY = b'{"ready": true}\n'


def _supervise(proc: subprocess.Popen[bytes], rfd: int, nonce: str, stdin: str, limits: SandboxLimits,
               level: str, t0: float, work: str | None) -> SandboxResult:
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray(), rfd: bytearray()}
    # The report is the harness' (per test at most ~400 bytes): its cap is never the program's doing.
    caps = {out_fd: limits.output_bytes, err_fd: limits.output_bytes, rfd: 64 << 20}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    ready_at: float | None = None
    verdict: str | None = None
    exited_at: float | None = None
    next_disk_check = 0.0
    try:
        while sel.get_map():
            now = time.perf_counter()
            if ready_at is None and bufs[rfd].startswith(_READY):
                ready_at = now
            deadline = t0 + _STARTUP_S if ready_at is None else ready_at + limits.wall_s
            if now >= deadline:
                verdict = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
                _kill(proc)  # stragglers of the process group (rlimits-only level)
            if exited_at is not None and now - exited_at > 1.0:
                break
            if ready_at is not None and now >= next_disk_check:
                next_disk_check = now + 0.1
                if (work is not None and _disk_over(work, limits.disk_mb * 2**20)) or (
                        level == BWRAP and _tmpfs_inodes_over(proc.pid)):
                    verdict = "disk_limit"
                    break
            for key, _ in sel.select(min(0.05, deadline - now)):
                fd = int(key.fd)
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    continue
                bufs[fd].extend(data)
                if len(bufs[fd]) > caps[fd]:
                    verdict = "output_limit"
                    break
            if verdict:
                break
    finally:
        sel.close()
        if verdict or proc.poll() is None:
            _kill(proc)
        rc = proc.wait()
        for s in (proc.stdout, proc.stderr):
            s.close()
        os.close(rfd)
    if verdict is None and work is not None and _disk_over(work, limits.disk_mb * 2**20):
        # A fast writer can fill the work dir between two 0.1 s polls and exit: judged once more at the end.
        verdict = "disk_limit"
    if ready_at is None and bufs[rfd].startswith(_READY):
        ready_at = time.perf_counter()
    wall = time.perf_counter() - t0
    stdout_b, stderr_b, report_b = bufs[out_fd], bufs[err_fd], bufs[rfd]
    stdout = stdout_b[: limits.output_bytes].decode("utf-8", "replace")
    stderr = stderr_b[: limits.output_bytes].decode("utf-8", "replace")
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 and level == BWRAP else None)
    common: dict[str, Any] = {"isolation": level, "wall_s": wall, "returncode": rc, "signal": sig,
                              "stdout": stdout, "stderr": stderr}
    if ready_at is None:
        # No program code runs before the handshake, so whatever happened is the sandbox's failure
        # (its stderr is kept for diagnosis but never parsed for the verdict).
        why = (f"did not start within {_STARTUP_S:g}s" if verdict == "timeout"
               else f"exited with code {rc} before the harness started")
        return SandboxResult("sandbox_error", reason=f"sandbox {why}", **common)
    if verdict == "timeout":
        return SandboxResult("timeout", reason=f"wall time over {limits.wall_s:g}s", **common)
    if verdict == "output_limit":
        which = "stdout" if len(stdout_b) > limits.output_bytes else "stderr"
        return SandboxResult("output_limit", reason=f"{which} over {limits.output_bytes} bytes", **common)
    if verdict == "disk_limit":
        return SandboxResult("disk_limit", reason=f"work dir or /tmp over {limits.disk_mb} MiB or {_MAX_ENTRIES} files",
                             **common)
    report = _parse_report(bytes(report_b[len(_READY):]), nonce)
    if report is None:
        # The harness started but wrote no result: its process was killed or crashed while the
        # program ran (at bwrap they share a uid, so the program can do this). A failure, not infra.
        return SandboxResult("no_report", reason=f"no result from the harness (exit code {rc})", **common)
    outcome = str(report["outcome"])
    if outcome == "sandbox_error":
        return SandboxResult("sandbox_error", reason=str(report.get("reason", ""))[:300], **common)
    if outcome == "died":
        outcome, why, csig = _death(report, limits)
        return SandboxResult(outcome, error=None, tests=tuple(report.get("tests") or ()), reason=why,
                             **{**common, "signal": csig})
    if outcome not in ("ok", "exception", "syntax_error", "exit"):
        return SandboxResult("no_report", reason=f"unknown outcome {outcome[:40]!r}", **common)
    return SandboxResult(outcome, error=report.get("error"), tests=tuple(report.get("tests") or ()),
                         reason=_reason(report), **common)


def _death(report: Mapping[str, Any], limits: SandboxLimits) -> tuple[str, str, int | None]:
    """Outcome, reason and signal for a program process that died, from its wait status as the
    harness observed it (the program cannot choose what the harness reports)."""
    sig = report.get("signal")
    if isinstance(sig, int):
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return "cpu_limit", f"CPU time over {limits.cpu_s}s (signal {sig})", sig
        if sig == signal.SIGXFSZ:
            return "file_size_limit", f"file over {limits.file_size_mb} MiB", sig
        return "signal", f"killed by signal {sig}", sig
    return "no_report", f"exited with code {report.get('exit')} before its result was complete", None


def _parse_report(raw: bytes, nonce: str) -> dict[str, Any] | None:
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            rep = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rep, dict) or "outcome" not in rep:
            continue
        # The pre-fork setup failure is written before the harness knows the nonce.
        if rep.get("nonce") == nonce or (rep["outcome"] == "sandbox_error" and "nonce" not in rep):
            return rep
    return None


def _reason(report: Mapping[str, Any]) -> str:
    err = report.get("error")
    if report["outcome"] == "exit":
        return f"sys.exit({report.get('code')}) before the end"
    if err:
        return f"{err['type']}: {err['msg']}"
    fails = [t for t in report.get("tests") or () if t]
    return f"{len(fails)} test(s) failed" if fails else "ran to the end"


# ------------------------------------------------------------------ host-side disk accounting and clean-up

_MAX_ENTRIES = 20_000  # work-dir entries counted per check; more is itself over the limit


def _disk_over(work: str, max_bytes: int) -> bool:
    """True if the tree under ``work`` uses more than ``max_bytes`` or ``_MAX_ENTRIES`` entries
    (or cannot be measured: too deep a path). Iterative; never raises."""
    used, seen, stack = 0, 0, [work]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    seen += 1
                    st = e.stat(follow_symlinks=False)
                    used += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
                    if used > max_bytes or seen > _MAX_ENTRIES:
                        return True
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                return True
            continue
    return False


def _tmpfs_inodes_over(bwrap_pid: int) -> bool:
    """True if bwrap's ``/work`` or ``/tmp`` tmpfs holds more than ``_MAX_ENTRIES`` inodes.

    bwrap cannot set ``nr_inodes``, and empty files cost kernel memory outside every limit, so the
    host counts them through the sandbox's root (``/proc/INIT/root``, INIT being bwrap's first
    child). Unmeasurable (process gone, no access): False; the size limit still holds."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            kids = f.read().split()
        for kid in kids[:1]:
            for d in (_WORK_IN_SANDBOX, "/tmp"):
                st = os.statvfs(f"/proc/{kid}/root{d}")
                if st.f_files - st.f_ffree > _MAX_ENTRIES:
                    return True
    except OSError:
        pass
    return False


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_OPEN = 64  # directory fds held while descending; deeper subtrees are moved up first


def _remove_tree(path: str) -> bool:
    """Delete ``path`` whatever the program made of it (any depth, any permissions, symlinks,
    names); True if it is gone. Never raises: a failure is returned (and warned by the caller).

    Works on directory fds (never on long paths, never following symlinks, never via ``..``),
    iteratively, with at most ``_MAX_OPEN`` fds: a subtree deeper than that is renamed to a
    direct child of the top first, which makes every chain shorter.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return True
        os.chmod(path, 0o700)  # the program may have made its own work dir unreadable
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return False
    try:
        _empty_dir(top)
    except OSError:
        pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        return not os.path.lexists(path)
    return True


def _empty_dir(top: int) -> None:
    stack: list[tuple[int, str]] = [(top, "")]  # (fd, its name in the parent)
    skipped: set[tuple[int, int]] = set()
    moved = 0
    try:
        while stack:
            cur = stack[-1][0]
            try:
                os.fchmod(cur, 0o700)
            except OSError:
                pass
            sub: str | None = None
            with os.scandir(cur) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            if (st.st_dev, st.st_ino) not in skipped:
                                sub = e.name
                                key = (st.st_dev, st.st_ino)
                                break
                        else:
                            os.unlink(e.name, dir_fd=cur)
                    except OSError:
                        pass
            if sub is not None:
                if len(stack) >= _MAX_OPEN:
                    moved += 1
                    try:
                        os.rename(sub, f".rm-{moved}-{secrets.token_hex(4)}", src_dir_fd=cur, dst_dir_fd=top)
                    except OSError:
                        skipped.add(key)
                    continue
                try:
                    nxt = os.open(sub, _DIR_FLAGS, dir_fd=cur)
                except OSError:
                    try:
                        os.chmod(sub, 0o700, dir_fd=cur)
                        nxt = os.open(sub, _DIR_FLAGS, dir_fd=cur)
                    except OSError:
                        skipped.add(key)
                        continue
                stack.append((nxt, sub))
                continue
            if len(stack) == 1:
                return
            fd, name = stack.pop()
            try:
                key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=stack[-1][0])
            except OSError:
                skipped.add(key)
    finally:
        for fd, _ in stack[1:]:
            os.close(fd)
