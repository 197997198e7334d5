"""A sandbox for model-written Python: a separate process with limits, no network, throwaway dir.

Isolation levels (strongest first; :func:`isolation_level` probes once and caches):

``bwrap``
    bubblewrap (``bwrap --unshare-all --die-with-parent --new-session --uid 65534``): new user,
    pid, network, mount, ipc and uts namespaces; only ``/usr`` (+ the interpreter's prefix)
    read-only, a private ``/tmp`` and the throwaway work dir ``/work`` writable. When the host
    runs as root, bwrap itself is started as uid 65534 so that the sandbox's processes belong
    to an unprivileged uid *outside* the namespace too (as root, ``RLIMIT_NPROC`` is not
    enforced, so a fork bomb would not be stopped by the process limit otherwise).
``unshare-net``
    util-linux ``unshare --net --pid --fork --kill-child`` (needs root): no network, own pid
    namespace; the child drops to uid/gid 65534 before running the code. The filesystem is the
    host's, protected only by permissions (nobody can still read world-readable files).
``rlimits-only``
    WARNING level: a plain subprocess with resource limits and a throwaway cwd. The network is
    reachable and files are readable with the host user's permissions. Used only when neither of
    the above works; it is announced with a warning and named in every result.

In every level the code runs under ``RLIMIT_CPU`` (seconds), ``RLIMIT_AS`` (memory),
``RLIMIT_FSIZE`` (largest file written), ``RLIMIT_NPROC`` (processes of the uid),
``RLIMIT_NOFILE`` and ``RLIMIT_CORE = 0``, a wall-clock deadline after which the whole process
tree is killed (process group, and the pid namespace where there is one), and caps on the bytes
of stdout / stderr kept (exceeding a cap kills the run: ``output_limit``). ``POSTTRAIN_SANDBOX``
forces a level (``bwrap`` | ``unshare-net`` | ``rlimits-only``).

Threat model: this protects the host from a program (escape, exhaustion). It is not a proof
against a program that deliberately forges the in-sandbox harness' report (it runs in the same
interpreter); the report carries a per-run nonce so accidental output cannot pass for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BWRAP = "bwrap"
UNSHARE = "unshare-net"
RLIMITS_ONLY = "rlimits-only"
LEVELS = (BWRAP, UNSHARE, RLIMITS_ONLY)

DESCRIPTIONS = {
    BWRAP: "bubblewrap: user/pid/net/mount/ipc/uts namespaces, uid 65534, read-only /usr, private work dir",
    UNSHARE: "unshare: net+pid namespaces, uid 65534; filesystem shared with the host (permissions only)",
    RLIMITS_ONLY: "WARNING rlimits only: network reachable, host files readable with the host user's permissions",
}

NOBODY = 65534
_WORK_IN_SANDBOX = "/work"

# The harness runs inside the sandbox (``python -I -S -c HARNESS ARGS``). It reads a nonce line
# from stdin, drops privileges if asked, applies the rlimits, runs main.py (and optional tests)
# and writes one JSON report line to the report fd. Forked children never report.
HARNESS = r"""
import json, os, resource, sys
a = json.loads(sys.argv[1])
nonce = b""
while not nonce.endswith(b"\n"):
    c = os.read(0, 1)
    if not c:
        break
    nonce += c
nonce = nonce.decode().strip()
if a["drop"] is not None and os.getuid() == 0:
    os.setgroups([]); os.setgid(a["drop"]); os.setuid(a["drop"])
R = resource
for r, soft, hard in ((R.RLIMIT_CPU, a["cpu"], a["cpu"] + 1), (R.RLIMIT_AS, a["mem"], a["mem"]),
                      (R.RLIMIT_FSIZE, a["fsize"], a["fsize"]), (R.RLIMIT_NPROC, a["nproc"], a["nproc"]),
                      (R.RLIMIT_NOFILE, a["nofile"], a["nofile"]), (R.RLIMIT_CORE, 0, 0)):
    R.setrlimit(r, (soft, hard))
rfd, me = a["report_fd"], os.getpid()
def send(d):
    if os.getpid() == me:
        d["nonce"] = nonce
        os.write(rfd, (json.dumps(d) + "\n").encode())
def exc(e):
    return {"type": type(e).__name__, "msg": str(e)[:300], "errno": getattr(e, "errno", None)}
def flush():
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            pass
g = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
except SyntaxError as e:
    send({"outcome": "syntax_error", "error": exc(e), "line": e.lineno}); os._exit(3)
try:
    exec(code, g)
    results = []
    for i, t in enumerate(a["tests"]):
        try:
            exec(compile(t, "test_%d" % i, "exec"), g)
            results.append(None)
        except BaseException as e:
            if os.getpid() != me:
                os._exit(1)
            results.append(exc(e))
except SystemExit as e:
    flush()
    if os.getpid() != me:
        os._exit(0)
    send({"outcome": "exit", "code": str(e.code)}); os._exit(4)
except BaseException as e:
    if os.getpid() != me:
        os._exit(1)
    flush(); send({"outcome": "exception", "error": exc(e)}); os._exit(1)
flush()
send({"outcome": "ok", "tests": results})
os._exit(0)
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``cpu_s`` is CPU seconds (SIGXCPU, then SIGKILL one second later);
    ``wall_s`` the wall-clock deadline; ``memory_mb`` the address-space limit; ``file_size_mb``
    the largest file the code may write; ``nproc`` the process count of the sandbox uid;
    ``output_bytes`` the cap on each of stdout and stderr."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 4
    nproc: int = 32
    open_files: int = 64
    output_bytes: int = 64 * 1024

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
    ``signal`` (killed by ``signal``), ``no_report`` (exited without the harness' report, e.g.
    ``os._exit``), ``sandbox_error`` (the sandbox itself failed: an infra error).
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
    """True if uid 65534 can execute ``path``: every ancestor o+x and the file o+x."""
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

    The host's base interpreter if the sandbox uid can execute it, else ``/usr/bin/python3``.
    """
    cands = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3",
             "/usr/local/bin/python3"]
    for c in cands:
        if os.path.exists(c) and (not _drop_needed() or _world_accessible(c)):
            return os.path.realpath(c)
    raise RuntimeError(f"sandbox: no interpreter usable by uid {NOBODY} among {cands}")


def _bwrap_cmd(work: str, python: str) -> list[str]:
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
    cmd += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--bind", work, _WORK_IN_SANDBOX, "--chdir", _WORK_IN_SANDBOX, "--"]
    return cmd


def _command(level: str, work: str, harness_args: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """argv and extra Popen kwargs of one run at ``level``."""
    py = sandbox_python()
    inner = [py, "-I", "-S", "-c", HARNESS]
    if level == BWRAP:
        args = dict(harness_args, drop=None)
        # Run bwrap itself as 65534 when root: the sandbox uid is then unprivileged outside too.
        popen = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if _drop_needed() else {}
        return [*_bwrap_cmd(work, py), *inner, json.dumps(args)], popen
    if level == UNSHARE:
        args = dict(harness_args, drop=NOBODY)
        return ["unshare", "--net", "--pid", "--fork", "--kill-child", *inner, json.dumps(args)], {}
    if level == RLIMITS_ONLY:
        args = dict(harness_args, drop=NOBODY if _drop_needed() else None)
        return [*inner, json.dumps(args)], {}
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
    """Run ``code`` as ``main.py`` in a fresh sandbox, then each of ``tests`` in its globals.

    ``files`` (relative name -> text) are written next to ``main.py``; ``stdin`` (<= 32 KiB) is
    the program's standard input. The work dir is deleted afterwards. Never raises for anything
    the code does; see :class:`SandboxResult` for the outcomes.
    """
    level = isolation or isolation_level()
    if len(stdin.encode()) > 32 * 1024:
        raise ValueError("run_python: stdin is limited to 32 KiB")
    return _run(level, code, stdin=stdin, files=dict(files or {}), tests=tuple(tests),
                limits=limits or SandboxLimits())


def _run(level: str, code: str, *, stdin: str, files: Mapping[str, str], tests: tuple[str, ...],
         limits: SandboxLimits) -> SandboxResult:
    work = tempfile.mkdtemp(prefix="posttrain-sbx-")
    t0 = time.perf_counter()
    try:
        for name, text in {**files, "main.py": code}.items():
            target = Path(work, name).resolve()
            if Path(work).resolve() not in target.parents:
                raise ValueError(f"run_python: file name {name!r} leaves the work dir")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        if _drop_needed():
            for root, dirs, fs in os.walk(work):
                for x in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in fs)]:
                    os.chown(x, NOBODY, NOBODY)
        rfd, wfd = os.pipe()
        nonce = secrets.token_hex(16)
        hargs = {"report_fd": wfd, "cpu": int(limits.cpu_s), "mem": limits.memory_mb * 2**20,
                 "fsize": limits.file_size_mb * 2**20, "nproc": limits.nproc, "nofile": limits.open_files,
                 "tests": list(tests)}
        argv, popen_kw = _command(level, work, hargs)
        env = {"PATH": "/usr/bin:/bin", "HOME": _WORK_IN_SANDBOX if level == BWRAP else work,
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(wfd,), cwd=work, env=env, start_new_session=True, **popen_kw)
        except OSError as e:
            os.close(rfd)
            return SandboxResult("sandbox_error", level, time.perf_counter() - t0, reason=f"cannot start: {e}")
        finally:
            os.close(wfd)
        return _supervise(proc, rfd, nonce, stdin, limits, level, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _supervise(proc: subprocess.Popen[bytes], rfd: int, nonce: str, stdin: str, limits: SandboxLimits,
               level: str, t0: float) -> SandboxResult:
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write((nonce + "\n" + stdin).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray(), rfd: bytearray()}
    caps = {out_fd: limits.output_bytes, err_fd: limits.output_bytes, rfd: 1 << 20}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = t0 + limits.wall_s
    verdict: str | None = None
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.perf_counter()
            if now >= deadline:
                verdict = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
                _kill(proc)  # stragglers of the process group (rlimits-only level)
            if exited_at is not None and now - exited_at > 1.0:
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
    wall = time.perf_counter() - t0
    stdout_b, stderr_b, report_b = bufs[out_fd], bufs[err_fd], bufs[rfd]
    stdout = stdout_b[: limits.output_bytes].decode("utf-8", "replace")
    stderr = stderr_b[: limits.output_bytes].decode("utf-8", "replace")
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 and level == BWRAP else None)
    common = {"isolation": level, "wall_s": wall, "returncode": rc, "signal": sig, "stdout": stdout, "stderr": stderr}
    if verdict == "timeout":
        return SandboxResult("timeout", reason=f"wall time over {limits.wall_s:g}s", **common)  # type: ignore[arg-type]
    if verdict == "output_limit":
        which = "stdout" if len(stdout_b) > limits.output_bytes else "stderr"
        return SandboxResult("output_limit", reason=f"{which} over {limits.output_bytes} bytes", **common)  # type: ignore[arg-type]
    report = _parse_report(bytes(report_b), nonce)
    if report is not None:
        return SandboxResult(report["outcome"], error=report.get("error"), tests=tuple(report.get("tests") or ()),
                             reason=_reason(report), **common)  # type: ignore[arg-type]
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return SandboxResult("cpu_limit", reason=f"CPU time over {limits.cpu_s}s (signal {sig})", **common)  # type: ignore[arg-type]
    if sig == signal.SIGXFSZ:
        return SandboxResult("file_size_limit", reason=f"file over {limits.file_size_mb} MiB", **common)  # type: ignore[arg-type]
    if sig is not None:
        return SandboxResult("signal", reason=f"killed by signal {sig}", **common)  # type: ignore[arg-type]
    if level == BWRAP and rc == 1 and stderr.startswith("bwrap:"):
        return SandboxResult("sandbox_error", reason=stderr.strip()[:200], **common)  # type: ignore[arg-type]
    return SandboxResult("no_report", reason=f"exited with code {rc} before the harness could report", **common)  # type: ignore[arg-type]


def _parse_report(raw: bytes, nonce: str) -> dict[str, Any] | None:
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            rep = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rep, dict) and rep.get("nonce") == nonce and "outcome" in rep:
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
