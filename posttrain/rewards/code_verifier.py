"""``code``: run model-written Python against tests in the sandbox (:mod:`posttrain.sandbox`).

``reference`` is either a string of test code (asserts that use the names the solution defined)
or a list of such strings (each test run separately: partial credit in ``tests_passed``) or a
dict ``{"tests": ..., "stdin": "...", "expected_stdout": "..."}`` for an I/O problem. The
solution is the last fenced code block of the response (```` ```python ... ``` ````), else the
whole response.

The tests are judged where the solution cannot reach: they run in the sandbox harness' own
process with real builtins, calling the solution's functions over a pipe and comparing the plain
builtin values they return (an object whose ``__eq__`` could lie is never a value), so patching
builtins, equality or the harness gives nothing (:mod:`posttrain.sandbox.harness`). Only a
sandbox that failed before any of the program ran is an ``infra_error``; what the program prints
or how it exits never is.

Status mapping (``reason`` is always in the explanation, with the isolation level):

======================================  ========================================
sandbox outcome                          status
======================================  ========================================
all tests pass (and stdout matches)      ``correct``  (task 1)
a test fails / the code raises           ``wrong``    (task 0; tests_passed = fraction)
no code, syntax error, ``sys.exit`` /     ``invalid``  (task 0, format 0 for no code / syntax)
``os._exit`` before the end, memory,
process, file-size or disk limit, output
cap, killed by a signal
wall or CPU time limit                   ``timeout``
the sandbox itself failed                ``infra_error`` (no reward)
======================================  ========================================
"""

from __future__ import annotations

import dataclasses
import errno
import re
from typing import Any

from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.rewards.verifier import VERIFIERS
from posttrain.sandbox import BWRAP, DESCRIPTIONS, SandboxLimits, run_python
from posttrain.trajectory import Status

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
# Exceptions that mean "hit a sandbox limit" rather than "computed the wrong thing".
_LIMIT_ERRORS = {"MemoryError": "memory limit", "BlockingIOError": "process/resource limit",
                 "RecursionError": "recursion limit"}
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full work dir or /tmp tmpfs: a limit, not a wrong answer


def _limit(error: Any) -> str | None:
    """The sandbox limit an exception of the program means, if any."""
    if not error:
        return None
    if error.get("errno") in _DISK_ERRNOS:
        return "disk limit"
    return _LIMIT_ERRORS.get(str(error.get("type")))


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, else ``response`` itself (stripped)."""
    blocks = _FENCE.findall(response)
    return (blocks[-1] if blocks else response).strip()


@VERIFIERS.register("code")
@dataclasses.dataclass(frozen=True)
class CodeVerifier:
    """Sandboxed execution of the response against ``reference`` tests (see the module table)."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    disk_mb: int = 32
    isolation: str | None = None
    name: str = "code"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """See the module docstring."""
        code = extract_code(response)
        if not code:
            return Verdict(Status.INVALID, {"task": 0.0, "format": 0.0, "tests_passed": 0.0}, "no code")
        if isinstance(reference, dict):
            tests, stdin, expected = reference.get("tests", ()), reference.get("stdin", ""), reference.get("expected_stdout")
        else:
            tests, stdin, expected = reference, "", None
        tests = [tests] if isinstance(tests, str) else list(tests)
        limits = SandboxLimits(cpu_s=self.cpu_s, wall_s=self.wall_s, memory_mb=self.memory_mb,
                               output_bytes=self.output_bytes, disk_mb=self.disk_mb)
        r = run_python(code, tests=tests, stdin=stdin, limits=limits, isolation=self.isolation)
        iso = f" [isolation: {r.isolation}" + ("" if r.isolation == BWRAP else f" - {DESCRIPTIONS[r.isolation]}") + "]"
        if r.outcome == "sandbox_error":
            return infra_error(f"sandbox failed: {r.reason}{iso}")
        if r.outcome in ("timeout", "cpu_limit"):
            return Verdict(Status.TIMEOUT, {"task": 0.0, "format": 1.0, "tests_passed": 0.0}, f"{r.reason}{iso}")
        if r.outcome == "syntax_error":
            return Verdict(Status.INVALID, {"task": 0.0, "format": 0.0, "tests_passed": 0.0}, f"{r.reason}{iso}")
        if r.outcome == "exception" and r.error and _limit(r.error) is None:
            return Verdict(Status.WRONG, {"task": 0.0, "format": 1.0, "tests_passed": 0.0},
                           f"solution raised {r.reason}{iso}")
        if r.outcome == "ok" and len(r.tests) != len(tests):  # never expected; fail closed
            return Verdict(Status.INVALID, {"task": 0.0, "format": 1.0, "tests_passed": 0.0},
                           f"{len(r.tests)} results for {len(tests)} tests{iso}")
        if r.outcome != "ok":
            what = _limit(r.error) or r.outcome.replace("_", " ")
            return Verdict(Status.INVALID, {"task": 0.0, "format": 1.0, "tests_passed": 0.0},
                           f"{what}: {r.reason}{iso}")
        n_pass = sum(t is None for t in r.tests)
        frac = n_pass / len(r.tests) if r.tests else 1.0
        first = next((t for t in r.tests if t is not None), None)
        out_ok = expected is None or r.stdout.strip() == str(expected).strip()
        ok = first is None and out_ok
        if ok:
            why = f"{n_pass}/{len(r.tests)} tests passed"
        elif first is not None:
            why = f"{n_pass}/{len(r.tests)} tests passed; first failure {first['type']}: {first['msg']}"
        else:
            why = f"stdout {r.stdout.strip()[:60]!r} != expected {str(expected).strip()[:60]!r}"
        comps = {"task": float(ok), "format": 1.0, "tests_passed": frac}
        return Verdict(Status.CORRECT if ok else Status.WRONG, comps, f"{why}{iso}")
