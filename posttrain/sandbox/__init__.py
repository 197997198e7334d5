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

* the tests run in the harness process (:mod:`posttrain.sandbox.harness`), never in
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

Modules, one concept each: :mod:`~posttrain.sandbox.limits` (what a caller gives and gets),
:mod:`~posttrain.sandbox.levels` (the levels and their command lines), :mod:`~posttrain.sandbox.host`
(interpreter, root), :mod:`~posttrain.sandbox.uids` (the uid pool), :mod:`~posttrain.sandbox.workdir`
(host-side disk accounting and clean-up), :mod:`~posttrain.sandbox.launcher` (one supervised run),
:mod:`~posttrain.sandbox.runner` (the entry: level choice and :func:`run_python`) and
:mod:`~posttrain.sandbox.harness` (the program inside the sandbox). Standard library only.
"""

from __future__ import annotations

from posttrain.sandbox.levels import BWRAP, DESCRIPTIONS, LEVELS, RLIMITS_ONLY, UNSHARE
from posttrain.sandbox.limits import SandboxLimits, SandboxResult
from posttrain.sandbox.runner import available_levels, isolation_level, run_python

__all__ = ["BWRAP", "DESCRIPTIONS", "LEVELS", "RLIMITS_ONLY", "UNSHARE", "SandboxLimits", "SandboxResult",
           "available_levels", "isolation_level", "run_python"]
