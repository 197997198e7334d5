"""Verification in a process pool, with per-call time limits and honest infra errors.

Each call runs in a worker process (``concurrent.futures.ProcessPoolExecutor``, ``forkserver``
or ``spawn`` context). Two time limits guard it:

- in the worker, ``signal.setitimer`` raises :class:`VerifierTimeout` after ``timeout_s``
  (the worker runs tasks in its main thread, so the alarm works there; this is why math-verify's
  own alarm can be disabled);
- on the host, a call still unanswered ``timeout_s + grace_s`` after submission (a verifier
  stuck in C code, a dead worker) kills every worker and restarts the pool.

A verifier that raises, times out or takes its worker down is retried up to ``retries`` times;
then the item's verdict is ``infra_error`` (no components: never a zero reward), and it is
counted. Calls that were merely in flight when the pool was restarted are resubmitted without
using up an attempt. ``workers=0`` verifies in-process (exceptions still become infra errors;
no time limit).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing as mp
import signal
import time
from collections.abc import Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.rewards.verifier import Verifier

Item = tuple[Verifier, str, Any, Mapping[str, Any]]


class VerifierTimeout(BaseException):
    """Raised inside a worker when a call exceeds its time limit (a BaseException so a
    verifier's own ``except Exception`` cannot swallow it)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise VerifierTimeout()


def _worker_init() -> None:
    import posttrain.rewards  # noqa: F401 - registers verifiers once per worker

    signal.signal(signal.SIGALRM, _on_alarm)


def _noop() -> int:
    return 0


def run_one(verifier: Verifier, response: str, reference: Any, context: Mapping[str, Any],
            timeout_s: float | None) -> tuple[str, Any]:
    """Worker body: ``("ok", Verdict)``, ``("timeout", msg)`` or ``("error", msg)``.

    The ``except Exception`` converts a verifier's exception into an explicit, counted
    ``error`` result (turned into ``infra_error`` after retries) — never into a reward.
    """
    if timeout_s:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        v = verifier.verify(response, reference, **context)
        if not isinstance(v, Verdict):
            return "error", f"{verifier.name}.verify returned {type(v).__name__}, not a Verdict"
        return "ok", v
    except VerifierTimeout:
        return "timeout", f"{verifier.name} exceeded {timeout_s:g}s"
    except Exception as e:  # noqa: BLE001 - becomes a counted infra error, see docstring
        return "error", f"{verifier.name} raised {type(e).__name__}: {e}"[:500]
    finally:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)


class VerifierPool:
    """``verify_batch(items)`` -> one :class:`Verdict` per item, in order.

    ``items`` are ``(verifier, response, reference, context)``. ``counts`` holds, cumulatively:
    ``calls`` (items), ``attempts``, ``ok``, ``errors``, ``timeouts``, ``crashes`` (worker died
    or pool broken), ``retries``, ``infra_error`` (items given up on), ``restarts``.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, retries: int = 1,
                 grace_s: float = 5.0, mp_context: str = "forkserver") -> None:
        if workers < 0 or retries < 0 or timeout_s <= 0 or grace_s <= 0:
            raise ValueError(f"VerifierPool: need workers>=0, retries>=0, timeout_s>0, grace_s>0; "
                             f"got {workers}, {retries}, {timeout_s}, {grace_s}")
        if mp_context not in ("forkserver", "spawn"):
            raise ValueError(f"VerifierPool: mp_context must be 'forkserver' or 'spawn', got {mp_context!r}")
        self.workers, self.timeout_s, self.retries, self.grace_s = workers, timeout_s, retries, grace_s
        self._ctx = mp.get_context(mp_context)
        self.counts: collections.Counter[str] = collections.Counter()
        self._ex: cf.ProcessPoolExecutor | None = None
        if workers:
            self._start()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        self._ex = cf.ProcessPoolExecutor(self.workers, mp_context=self._ctx, initializer=_worker_init)
        # Start the workers now so their start-up (imports) is not charged to the first call.
        for f in [self._ex.submit(_noop) for _ in range(self.workers)]:
            f.result()

    def _kill(self) -> None:
        ex, self._ex = self._ex, None
        if ex is None:
            return
        # ProcessPoolExecutor has no public "kill workers" before Python 3.14.
        for p in list(getattr(ex, "_processes", {}).values()):
            p.kill()
        ex.shutdown(wait=False, cancel_futures=True)

    def _restart(self) -> None:
        self.counts["restarts"] += 1
        self._kill()
        self._start()

    def close(self) -> None:
        """Shut the workers down (idempotent)."""
        ex, self._ex = self._ex, None
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ verification
    def verify_batch(self, items: Sequence[Item]) -> list[Verdict]:
        """Verdicts of ``items`` (see the class and module docstrings)."""
        self.counts["calls"] += len(items)
        if not self.workers:
            return [self._in_process(it) for it in items]
        if self._ex is None:
            raise RuntimeError("VerifierPool is closed")
        results: list[Verdict | None] = [None] * len(items)
        attempts = [0] * len(items)
        last_err = [""] * len(items)
        queue = collections.deque(range(len(items)))
        inflight: dict[cf.Future[tuple[str, Any]], tuple[int, float]] = {}
        hard = self.timeout_s + self.grace_s

        def fail(i: int, kind: str, msg: str) -> None:
            self.counts[kind] += 1
            last_err[i] = msg
            if attempts[i] <= self.retries:
                self.counts["retries"] += 1
                queue.append(i)
            else:
                self.counts["infra_error"] += 1
                results[i] = infra_error(f"{msg} (after {attempts[i]} attempt(s))")

        while queue or inflight:
            while queue and len(inflight) < self.workers:
                i = queue.popleft()
                attempts[i] += 1
                self.counts["attempts"] += 1
                v, resp, ref, ctx = items[i]
                assert self._ex is not None
                fut = self._ex.submit(run_one, v, resp, ref, dict(ctx), self.timeout_s)
                inflight[fut] = (i, time.monotonic())
            oldest = min(t for _, t in inflight.values())
            done, _ = cf.wait(inflight, timeout=max(0.0, oldest + hard - time.monotonic()),
                              return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in done:
                i, _t = inflight.pop(fut)
                try:
                    kind, payload = fut.result()
                except BrokenProcessPool as e:
                    broken = True
                    fail(i, "crashes", f"verifier worker died ({e})")
                    continue
                except Exception as e:  # noqa: BLE001 - e.g. an unpicklable verifier: counted infra error
                    fail(i, "errors", f"cannot run verifier: {type(e).__name__}: {e}")
                    continue
                if kind == "ok":
                    self.counts["ok"] += 1
                    results[i] = payload
                else:
                    fail(i, "timeouts" if kind == "timeout" else "errors", str(payload))
            now = time.monotonic()
            expired = [f for f, (_, t) in inflight.items() if now - t >= hard]
            if broken or expired:
                for f, (i, _t) in list(inflight.items()):
                    if f in expired:
                        fail(i, "timeouts", f"verifier call unanswered after {hard:g}s; workers killed")
                    else:  # collateral of the restart: resubmit without using an attempt
                        attempts[i] -= 1
                        queue.appendleft(i)
                inflight.clear()
                self._restart()
        out = [r for r in results if r is not None]
        assert len(out) == len(items)
        return out

    def _in_process(self, item: Item) -> Verdict:
        v, resp, ref, ctx = item
        self.counts["attempts"] += 1
        kind, payload = run_one(v, resp, ref, ctx, None)
        if kind == "ok":
            self.counts["ok"] += 1
            return payload  # type: ignore[no-any-return]
        self.counts["errors"] += 1
        self.counts["infra_error"] += 1
        return infra_error(str(payload))

    def metrics(self) -> dict[str, float]:
        """``{"verify/<count>": value}`` for the metrics log."""
        return {f"verify/{k}": float(v) for k, v in sorted(self.counts.items())}
