"""One run at a given level: start the harness, feed it the program, supervise it, judge the result.

The verdict comes only from what the program cannot forge (see :mod:`posttrain.sandbox`): the
harness' start handshake and its nonce-tagged report on a pipe the program never holds.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import selectors
import signal
import struct
import subprocess
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

from posttrain.sandbox.levels import BWRAP, RLIMITS_ONLY, UNSHARE, UNSHARE_WORK, WORK_IN_SANDBOX, command
from posttrain.sandbox.limits import SandboxLimits, SandboxResult
from posttrain.sandbox.uids import kill_uid, uid_lease
from posttrain.sandbox.workdir import MAX_ENTRIES, disk_over, remove_tree, tmpfs_inodes_over


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


def launch(level: str, code: str, *, stdin: str, files: Mapping[str, str], tests: tuple[str, ...],
           limits: SandboxLimits) -> SandboxResult:
    """Run ``code`` (and ``tests``) once at ``level``; see :func:`posttrain.sandbox.runner.run_python`."""
    for name in files:
        _check_name(name)
    t0 = time.perf_counter()
    with uid_lease() as uids:
        work: str | None = None
        try:
            if level == RLIMITS_ONLY:
                work = tempfile.mkdtemp(prefix="posttrain-sbx-")
                if uids:
                    for u in uids:
                        kill_uid(u)  # leftovers of a host that died mid-run with this slot
            nonce = secrets.token_hex(16)
            ctl = _control_fd({**files, "main.py": code}, {"nonce": nonce, "tests": list(tests)})
            rfd, wfd = os.pipe()
            cfg = {"ctl": ctl, "rep": wfd, "limits": {
                "cpu": int(limits.cpu_s), "mem": limits.memory_mb * 2**20, "fsize": limits.file_size_mb * 2**20,
                "nproc": limits.nproc, "nofile": limits.open_files}}
            argv, popen_kw, cwd = command(level, cfg, limits, uids, work)
            home = {BWRAP: WORK_IN_SANDBOX, UNSHARE: UNSHARE_WORK}.get(level, work)
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
                    kill_uid(u)
            if work is not None and not remove_tree(work):
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
                if (work is not None and disk_over(work, limits.disk_mb * 2**20)) or (
                        level == BWRAP and tmpfs_inodes_over(proc.pid)):
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
    if verdict is None and work is not None and disk_over(work, limits.disk_mb * 2**20):
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
        return SandboxResult("disk_limit", reason=f"work dir or /tmp over {limits.disk_mb} MiB or {MAX_ENTRIES} files",
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


__all__ = ["launch"]
