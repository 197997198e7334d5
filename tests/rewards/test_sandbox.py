"""The code sandbox contains escape attempts and reports them with a reason, at every level
this machine provides; the host and later runs are unaffected.

Expected containment per level (module docstring of posttrain.rewards.sandbox): ``bwrap`` and
``unshare-net`` cut the network; ``rlimits-only`` does not and says so. File reads/writes outside
the work dir are stopped by the mount namespace (bwrap) or by running as uid 65534 against
files only root may touch (the other levels, when the host is root).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid

import pytest

from posttrain.rewards import sandbox as S

LEVELS = S.available_levels()
FAST = S.SandboxLimits(cpu_s=1, wall_s=1.5, memory_mb=256, nproc=16, output_bytes=8192)


def _ok_still_works(level: str) -> None:
    r = S.run_python("print(sum(range(10)))", isolation=level, limits=FAST)
    assert r.outcome == "ok" and r.stdout.strip() == "45"


def _files_protected(level: str) -> bool:
    # rlimits-only as a non-root user runs the code as that same user: nothing to protect with.
    return not (level == S.RLIMITS_ONLY and os.geteuid() != 0)


def _alive(marker: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def test_isolation_level_is_the_strongest_available_and_described():
    assert S.isolation_level() == (os.environ.get("POSTTRAIN_SANDBOX") or LEVELS[0])
    assert S.isolation_level() in S.DESCRIPTIONS
    # every level that is not available has a reason (shown in the report header)
    assert all((S._probe(lv) is None) == (lv in LEVELS) for lv in S.LEVELS)
    assert all(isinstance(S._probe(lv), str) for lv in S.LEVELS if lv not in LEVELS)


@pytest.mark.parametrize("level", LEVELS)
def test_infinite_loop_is_a_timeout_within_the_wall_limit(level):
    t = time.perf_counter()
    r = S.run_python("while True:\n    pass", isolation=level, limits=FAST)
    assert r.outcome in ("timeout", "cpu_limit"), r
    assert time.perf_counter() - t < FAST.wall_s + 1.5
    _ok_still_works(level)


@pytest.mark.parametrize("level", LEVELS)
def test_fork_bomb_is_contained_and_leaves_no_process(level):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = S.run_python(code, tests=[f"# {marker}"], isolation=level, limits=FAST)
    assert r.outcome in ("timeout", "cpu_limit"), r
    deadline = time.time() + 3
    while _alive(marker) and time.time() < deadline:
        time.sleep(0.05)
    assert _alive(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    _ok_still_works(level)


@pytest.mark.parametrize("level", LEVELS)
def test_plain_fork_bomb_hits_the_process_limit(level):
    r = S.run_python("import os\nwhile True:\n    os.fork()", isolation=level, limits=FAST)
    assert r.outcome == "exception" and r.error["type"] == "BlockingIOError", r


@pytest.mark.parametrize("level", LEVELS)
def test_memory_hog_hits_the_memory_limit(level):
    r = S.run_python("x = bytearray(2 * 1024**3)", isolation=level, limits=FAST)
    assert r.outcome == "exception" and r.error["type"] == "MemoryError", r
    _ok_still_works(level)


@pytest.mark.parametrize("level", LEVELS)
def test_huge_print_is_cut_at_the_output_cap(level):
    r = S.run_python("while True:\n    print('x' * 1000)", isolation=level, limits=FAST)
    assert r.outcome == "output_limit" and "stdout" in r.reason
    assert len(r.stdout) <= FAST.output_bytes


@pytest.mark.parametrize("level", LEVELS)
def test_big_file_hits_the_file_size_limit(level):
    r = S.run_python("open('big', 'w').write('x' * (8 * 1024**2))", isolation=level, limits=FAST)
    assert r.outcome == "exception" and "File too large" in r.error["msg"], r


@pytest.mark.parametrize("level", LEVELS)
def test_reading_a_host_file_outside_the_work_dir_fails(level, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    secret.chmod(0o600)
    r = S.run_python(f"print(open({str(secret)!r}).read())", isolation=level, limits=FAST)
    if not _files_protected(level):
        assert "TOP-SECRET" in r.stdout and "host files readable" in S.DESCRIPTIONS[level]
        return
    assert "TOP-SECRET" not in r.stdout
    assert r.outcome == "exception" and r.error["type"] in ("FileNotFoundError", "PermissionError"), r


@pytest.mark.parametrize("level", LEVELS)
def test_writing_outside_the_work_dir_fails(level, tmp_path):
    target = tmp_path / "pwned.txt"
    r = S.run_python(f"open({str(target)!r}, 'w').write('x')", isolation=level, limits=FAST)
    if not _files_protected(level):
        assert target.exists() and "host files readable" in S.DESCRIPTIONS[level]
        return
    assert not target.exists()
    assert r.outcome == "exception" and r.error["type"] in ("FileNotFoundError", "PermissionError", "OSError"), r
    # ... while writing inside its own dir works
    assert S.run_python("open('f', 'w').write('ok'); print(open('f').read())", isolation=level,
                        limits=FAST).stdout.strip() == "ok"


@pytest.mark.parametrize("level", LEVELS)
def test_network_socket_to_a_host_listener(level):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'escaped')"
    try:
        r = S.run_python(code, isolation=level, limits=FAST)
        try:
            conn, _ = srv.accept()
            conn.close()
            reached = True
        except TimeoutError:
            reached = False
    finally:
        srv.close()
    if level == S.RLIMITS_ONLY:
        # The weakest level cannot cut the network, and says so in its description.
        assert reached and r.outcome == "ok" and "network reachable" in S.DESCRIPTIONS[level]
    else:
        assert not reached
        assert r.outcome == "exception" and r.error["type"] in ("ConnectionRefusedError", "OSError"), r


def test_syntax_error_exit_and_os_exit_are_reported():
    lv = LEVELS[0]
    assert S.run_python("def (:", isolation=lv, limits=FAST).outcome == "syntax_error"
    assert S.run_python("import sys; sys.exit(0)", isolation=lv, limits=FAST).outcome == "exit"
    assert S.run_python("import os; os._exit(0)", isolation=lv, limits=FAST).outcome == "no_report"


def test_forged_report_line_on_stdout_is_ignored():
    lv = LEVELS[0]
    r = S.run_python('print(\'{"outcome": "ok", "nonce": "x"}\')\nimport os; os._exit(0)', isolation=lv, limits=FAST)
    assert r.outcome == "no_report"


def test_tests_run_in_the_solution_globals_and_failures_are_listed():
    r = S.run_python("def f(x):\n    return 2 * x", tests=["assert f(2) == 4", "assert f(3) == 7"],
                     isolation=LEVELS[0], limits=FAST)
    assert r.outcome == "ok" and r.tests[0] is None and r.tests[1]["type"] == "AssertionError"


def test_files_cannot_leave_the_work_dir():
    with pytest.raises(ValueError, match="leaves the work dir"):
        S.run_python("pass", files={"../x": "y"})


def test_fallback_is_announced_with_the_reason(monkeypatch):
    # Simulate a machine without bubblewrap: the next level is chosen, with a warning naming why.
    real = S._probe
    monkeypatch.delenv("POSTTRAIN_SANDBOX", raising=False)
    monkeypatch.setattr(S, "_probe", lambda lv: "bwrap not installed" if lv == S.BWRAP else real(lv))
    with pytest.warns(RuntimeWarning, match=r"falls back to '(unshare-net|rlimits-only)'.*bwrap not installed"):
        level = S.isolation_level.__wrapped__()
    assert level != S.BWRAP
    monkeypatch.setenv("POSTTRAIN_SANDBOX", "bwrap")
    with pytest.raises(RuntimeError, match="does not work here: bwrap not installed"):
        S.isolation_level.__wrapped__()
