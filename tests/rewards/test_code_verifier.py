"""code verifier: statuses and reasons for correct, wrong, invalid and escaping programs."""

from __future__ import annotations

import socket

import pytest

from posttrain.rewards.code_verifier import CodeVerifier, extract_code
from posttrain.sandbox import isolation_level
from posttrain.trajectory import Status

V = CodeVerifier(cpu_s=1, wall_s=1.5, memory_mb=256, output_bytes=8192)
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```\ny = 2\n```") == "y = 2"
    assert extract_code("  z = 3  ") == "z = 3"


def test_correct_wrong_and_partial_credit():
    good = V.verify("```python\ndef add(a, b):\n    return a + b\n```", TESTS)
    assert good.status is Status.CORRECT and good.components == {"task": 1.0, "format": 1.0, "tests_passed": 1.0}
    # a*b passes none of the three tests except... 2*3=6 no, -1*1=-1 no, 10*5=50 no -> 0/3
    bad = V.verify("def add(a, b):\n    return a * b", TESTS)
    assert bad.status is Status.WRONG and bad.components["tests_passed"] == 0.0
    # a+b if a != 10 passes tests 1 and 2 -> 2/3
    part = V.verify("def add(a, b):\n    return a + b if a != 10 else 0", TESTS)
    assert part.status is Status.WRONG and part.components["tests_passed"] == pytest.approx(2 / 3)
    assert "first failure AssertionError" in part.explanation
    assert f"[isolation: {isolation_level()}" in good.explanation


def test_stdin_stdout_problem():
    ref = {"stdin": "3 4\n", "expected_stdout": "7"}
    assert V.verify("a, b = map(int, input().split())\nprint(a + b)", ref).status is Status.CORRECT
    assert V.verify("print(8)", ref).status is Status.WRONG


@pytest.mark.parametrize(
    "code, status, reason",
    [
        ("", Status.INVALID, "no code"),
        ("def add(:", Status.INVALID, "SyntaxError"),
        ("while True:\n    pass", Status.TIMEOUT, ""),
        ("import os\nwhile True:\n    os.fork()", Status.INVALID, "process/resource limit"),
        ("x = bytearray(2 * 1024**3)", Status.INVALID, "memory limit"),
        ("while True:\n    print('spam' * 100)", Status.INVALID, "output limit"),
        ("import sys\nsys.exit(0)", Status.INVALID, "sys.exit"),
        ("import os\nos._exit(0)", Status.INVALID, "no report"),
        ("open('/etc/shadow').read()", Status.WRONG, "solution raised"),
        ("raise ValueError('boom')", Status.WRONG, "ValueError: boom"),
    ],
)
def test_misbehaviour_is_contained_and_reported_with_a_reason(code, status, reason):
    v = V.verify(code, TESTS)
    assert v.status is status, v.explanation
    assert reason in v.explanation and ("[isolation:" in v.explanation or not code)  # no code: nothing ran
    assert v.components["task"] == 0.0


def test_network_attempt_is_reported_and_does_not_reach_the_host():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "def add(a, b):\n    return a + b")
        v = CodeVerifier(wall_s=3.0, isolation=None).verify(code, TESTS)
        try:
            srv.accept()[0].close()
            reached = True
        except TimeoutError:
            reached = False
    finally:
        srv.close()
    if isolation_level() == "rlimits-only":
        assert reached and "WARNING" in v.explanation  # honest about the weak level
    else:
        assert not reached and v.status is Status.WRONG and "solution raised" in v.explanation


def test_a_bad_program_does_not_affect_the_next_verification():
    V.verify("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", TESTS)
    assert V.verify("def add(a, b):\n    return a + b", TESTS).status is Status.CORRECT


# Reward hacking: a policy optimised against this verifier will try to get `correct` without
# solving the task, or to fail as a free `infra_error` (excluded from the update).
FORGERIES = {
    "always-equal-result": "class A:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
                           "def add(a, b):\n    return A()\n",
    "int-subclass-result": "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                           "def add(a, b):\n    return I(0)\n",
    "patched-assertion-and-eq": "import builtins, operator\nbuiltins.AssertionError = type('E', (BaseException,), {})\n"
                                "operator.eq = lambda a, b: True\ndef add(a, b):\n    return 0\n",
    "patched-harness": "import sys\nsys.modules['__main__'].encode = lambda v, other, depth=0: ['b', True]\n"
                       "def add(a, b):\n    return 0\n",
    "forged-report-on-every-fd": "import json, os\nline = json.dumps({'outcome': 'ok', 'tests': [None] * 3}) + '\\n'\n"
                                 "for fd in range(3, 256):\n    try:\n        os.write(fd, line.encode())\n"
                                 "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n",
    "forged-stdout-for-io": "print('7')\ndef add(a, b):\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_reward_hacking_attempts_are_never_correct(name):
    v = V.verify(FORGERIES[name], TESTS)
    assert v.status in (Status.WRONG, Status.INVALID), v.explanation
    assert v.components["task"] == 0.0


@pytest.mark.parametrize(
    "code",
    ["import os, sys\nsys.stderr.write(\"bwrap: Can't mount tmpfs on /newroot/tmp: No space left\\n\")\nos._exit(1)",
     "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(3)",
     "import os, signal\nos.kill(-1, signal.SIGKILL)"],
    ids=["fake-bwrap-error", "kill-harness", "kill-all"],
)
def test_failing_cannot_be_dressed_as_an_infra_error(code):
    v = V.verify(code, TESTS)
    assert v.status is not Status.INFRA_ERROR and v.status is not Status.CORRECT, v.explanation


def test_filling_the_disk_is_invalid_with_the_disk_limit_named():
    code = ("for i in range(64):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * 2**21)\n"
            "def add(a, b):\n    return a + b")
    v = CodeVerifier(cpu_s=2, wall_s=5.0, memory_mb=256, output_bytes=8192, disk_mb=8).verify(code, TESTS)
    assert v.status is Status.INVALID and "disk limit" in v.explanation, v.explanation
