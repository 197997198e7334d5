"""An engine server started and owned by the trainer: a child process on 127.0.0.1, driven over HTTP.

Why a child process: vLLM pins its own ``transformers`` range and spawns worker processes, so it
runs best in its own environment (``.venv-vllm``) and process; :class:`SpawnedEngine` is the
:class:`~posttrain.rollout.http_engine.HTTPEngine` client plus the process it started, so the loop
drives it like any other engine. The child runs the same posttrain source as the trainer
(``PYTHONPATH`` points at it), exits when the trainer's end of its stdin closes (the trainer died or
called :meth:`SpawnedEngine.close`), and writes its log to ``log_path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.rollout.http_engine import HTTPEngine


def _source_root() -> str:
    """The directory holding the ``posttrain`` package the trainer runs (put first on the child's path)."""
    import posttrain

    return str(Path(posttrain.__file__).resolve().parents[1])


def _terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Close the child's stdin (its exit signal), then SIGTERM, then SIGKILL; never waits unbounded."""
    if proc.poll() is not None:
        return
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=grace_s)
        return
    except (subprocess.TimeoutExpired, OSError):
        pass
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


class SpawnedEngine(HTTPEngine):
    """Start ``python -m posttrain.rollout.http_engine --factory F --kwargs K`` and drive it over HTTP.

    ``python``: the interpreter of the environment that has the engine's dependencies; ``env``:
    extra environment variables of the child (e.g. ``VLLM_CPU_KVCACHE_SPACE``); ``threads``: the
    child's ``torch.set_num_threads`` (0: torch's default there). Waits at most
    ``startup_timeout_s`` for the child's ``LISTENING <port>`` line; a child that exits or stays
    silent raises ``RuntimeError`` quoting the end of ``log_path``. ``close()`` (also run at
    garbage collection and interpreter exit) stops the child.
    """

    def __init__(self, python: str | Path, factory: str, kwargs: Mapping[str, Any], *, log_path: str | Path,
                 env: Mapping[str, str] | None = None, threads: int = 0, startup_timeout_s: float = 600.0,
                 timeout_s: float = 600.0, weights_timeout_s: float = 600.0) -> None:
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_source_root(), child_env.get("PYTHONPATH")) if p)
        child_env["PYTHONUNBUFFERED"] = "1"
        cmd = [str(python), "-m", "posttrain.rollout.http_engine", "--factory", factory,
               "--kwargs", json.dumps(dict(kwargs)), "--host", "127.0.0.1", "--port", "0", "--exit-on-stdin-eof",
               "--threads", str(int(threads))]
        t0 = time.perf_counter()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - owned for the child's lifetime
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=child_env)
        self._finalizer = weakref.finalize(self, _terminate, self.proc)
        port = self._wait_listening(startup_timeout_s)
        self.startup_s = time.perf_counter() - t0
        super().__init__(f"http://127.0.0.1:{port}", timeout_s=timeout_s, weights_timeout_s=weights_timeout_s)

    def _wait_listening(self, timeout_s: float) -> int:
        """Copy the child's output to the log; return the port of its ``LISTENING`` line."""
        found: dict[str, int] = {}
        ready = threading.Event()
        assert self.proc.stdout is not None
        out, log = self.proc.stdout, self._log

        def pump() -> None:  # keeps draining after start-up so the child never blocks on a full pipe
            for line in iter(out.readline, b""):
                try:
                    log.write(line)
                    log.flush()
                except ValueError:  # the log was closed by close(): the child is being stopped
                    pass
                if not ready.is_set() and line.startswith(b"LISTENING "):
                    found["port"] = int(line.split()[1])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, name="engine-server-log", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"engine server did not start within {timeout_s:g}s; log {self.log_path}:\n"
                                   + self.log_tail())
        if "port" not in found:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"engine server exited with code {self.proc.returncode} during start-up; "
                               f"log {self.log_path}:\n" + self.log_tail())
        return found["port"]

    def log_tail(self, n_chars: int = 3000) -> str:
        """The last ``n_chars`` characters of the child's log."""
        try:
            return self.log_path.read_bytes()[-n_chars:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the child (idempotent)."""
        self._finalizer()
        self._log.close()
