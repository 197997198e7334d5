"""Futures of the Tinker API: every operation answers ``{request_id}`` at once, runs on one worker
thread, and its result is fetched with ``retrieve_future`` (a bounded wait, then ``try_again``).

Order: the jobs of one training model carry the SDK's ``seq_id`` (1, 2, ... per model) and run in
that order whatever order their HTTP requests arrive in (the SDK sends the chunks of one
``forward_backward`` concurrently, and an ``optim_step`` may arrive before the forward_backward's
result is fetched). A request the server refuses still takes its ``seq_id`` (it is queued as a job
that fails), so the model's later requests run. A ``seq_id`` that never arrives (the client failed
before sending it) holds the model's later jobs for at most ``gap_s`` seconds; then they run and
the missing one, should it come, is refused as already used. Jobs without an order key (sampling)
run in arrival order.

Fairness: every job belongs to a client (the SDK session that sent it). The worker serves clients
in turn (round-robin over the clients with a runnable job, the one served last going to the back), so
one client's queue of long requests delays another client's request by at most one job, not by the
whole queue. Runnable sampling jobs that share a ``batch_key`` (the same sampler weights) are handed
to the worker together, whoever sent them, so one engine call serves them all.

Cancellation: :meth:`JobQueue.drop` removes queued jobs (``cancel_future``, a finished or expired
session); the caller resolves their futures with a failure. A job already running finishes.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from posttrain.errors import UserError

JSON = "application/json"
PROTOBUF = "application/x-protobuf"

GAP_S = 60.0
"""How long a model's jobs wait for a missing earlier ``seq_id`` before they run without it."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A finished request's reply body: JSON or protobuf bytes, or a failure ``{error, category}``."""

    body: bytes
    content_type: str = JSON


@dataclasses.dataclass
class Job:
    """One queued operation.

    ``work`` computes the outcome of this job alone. Ordered jobs (``order_key`` = a model id) run in
    ``seq`` order per key. ``batch_key`` + ``batch_work``: runnable jobs with the same key may run
    together, ``batch_work(jobs)`` returning one outcome per job in order; ``payload`` is what the
    batch function reads from each job (a sampling request). ``client``: the session that sent it
    (the unit of round-robin and of cancellation); ``queued_at``: ``time.monotonic()`` at creation.
    """

    request_id: str
    work: Callable[[], Outcome]
    order_key: str | None = None
    seq: int | None = None
    batch_key: str | None = None
    batch_work: Callable[[Sequence[Job]], list[Outcome]] | None = None
    payload: object = None
    client: str = ""
    queued_at: float = dataclasses.field(default_factory=time.monotonic)


class FutureTable:
    """request_id -> pending / finished outcome; :meth:`wait` blocks at most ``timeout`` seconds.

    At most ``capacity`` finished outcomes are kept (the oldest are dropped; a retrieve of a dropped
    one is a 404 for the client)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._cond = threading.Condition()
        self._pending: set[str] = set()
        self._done: OrderedDict[str, Outcome] = OrderedDict()
        self._capacity = capacity

    def add(self, request_id: str) -> None:
        """Register a pending request."""
        with self._cond:
            self._pending.add(request_id)

    def forget(self, request_id: str) -> None:
        """Unregister a pending request that was never queued."""
        with self._cond:
            self._pending.discard(request_id)

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Store the outcome of a pending request and wake its waiters."""
        with self._cond:
            self._pending.discard(request_id)
            self._done[request_id] = outcome
            while len(self._done) > self._capacity:
                self._done.popitem(last=False)
            self._cond.notify_all()

    def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome, waiting up to ``timeout`` s; None while still pending. ``KeyError`` if unknown."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if request_id in self._done:
                    return self._done[request_id]
                if request_id not in self._pending:
                    raise KeyError(request_id)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)


class JobQueue:
    """Jobs waiting for the worker; :meth:`take` returns the next runnable ones (see module doc)."""

    def __init__(self, max_batch: int = 64, gap_s: float = GAP_S) -> None:
        self._cond = threading.Condition()
        self._jobs: list[Job] = []
        self._next_seq: dict[str, int] = {}
        self._turns: OrderedDict[str, None] = OrderedDict()  # clients, the next to serve first
        self._max_batch = max_batch
        self._gap_s = gap_s
        self._closed = False

    def open_order(self, key: str, first_seq: int) -> None:
        """Start ordering the jobs of ``key`` (a model id) at ``first_seq``."""
        with self._cond:
            self._next_seq[key] = first_seq

    def submit(self, job: Job) -> None:
        """Queue a job; an ordered job whose ``seq`` was already run is a :class:`UserError`."""
        with self._cond:
            if job.order_key is not None and job.seq is not None:
                expected = self._next_seq.get(job.order_key)
                if expected is None:
                    raise UserError(f"unknown model {job.order_key!r}")
                if job.seq < expected or any(
                    j.order_key == job.order_key and j.seq == job.seq for j in self._jobs
                ):
                    raise UserError(f"model {job.order_key!r}: seq_id {job.seq} was already used")
            self._jobs.append(job)
            self._turns.setdefault(job.client)
            self._cond.notify_all()

    def drop(self, keep: Callable[[Job], bool]) -> list[Job]:
        """Remove the queued jobs for which ``keep`` is false and return them (their ``seq_id`` s count
        as used)."""
        with self._cond:
            gone = [j for j in self._jobs if not keep(j)]
            self._jobs = [j for j in self._jobs if keep(j)]
            for j in gone:
                if j.order_key is not None and j.seq is not None:
                    self._next_seq[j.order_key] = max(self._next_seq.get(j.order_key, 0), j.seq + 1)
            self._cond.notify_all()
            return gone

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs)

    def close(self) -> None:
        """Wake the worker so that it can stop (:meth:`take` returns ``[]`` from now on)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _runnable(self, job: Job) -> bool:
        if job.order_key is None or job.seq is None:
            return True
        return self._next_seq.get(job.order_key) == job.seq

    def _skip_gaps(self, now: float) -> float | None:
        """Advance past a missing ``seq_id`` whose successor waited ``gap_s``; the time until the next
        such gap expires (None when no model waits on a gap)."""
        first: dict[str, Job] = {}
        for j in self._jobs:
            if j.order_key is not None and j.seq is not None:
                if j.order_key not in first or j.seq < first[j.order_key].seq:  # type: ignore[operator]
                    first[j.order_key] = j
        soonest: float | None = None
        for key, j in first.items():
            assert j.seq is not None
            if self._next_seq.get(key, j.seq) < j.seq:
                left = j.queued_at + self._gap_s - now
                if left <= 0:
                    self._next_seq[key] = j.seq
                else:
                    soonest = left if soonest is None else min(soonest, left)
        return soonest

    def _pick(self) -> list[Job]:
        for client in list(self._turns):
            first = next((j for j in self._jobs if j.client == client and self._runnable(j)), None)
            if first is None:
                if not any(j.client == client for j in self._jobs):
                    del self._turns[client]
                continue
            batch = [first]
            if first.batch_key is not None and first.batch_work is not None:
                batch += [j for j in self._jobs if j is not first and j.batch_key == first.batch_key
                          and self._runnable(j)][: self._max_batch - 1]
            for j in batch:
                self._jobs.remove(j)
                if j.order_key is not None and j.seq is not None:
                    self._next_seq[j.order_key] = j.seq + 1
            self._turns.move_to_end(client)
            return batch
        return []

    def take(self, timeout: float) -> list[Job]:
        """The next runnable job (of the next client in turn, its oldest) plus the runnable jobs sharing
        its ``batch_key``; ``[]`` after ``timeout`` s with nothing runnable, or once closed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                gap_left = self._skip_gaps(now)
                batch = self._pick()
                if batch:
                    return batch
                left = deadline - now
                if left <= 0:
                    return []
                self._cond.wait(left if gap_left is None else min(left, gap_left))
            return []


def failure(message: str, *, user: bool) -> Outcome:
    """The SDK's failed-request reply ``{error, category}`` (category ``user`` or ``server``)."""
    return Outcome(json.dumps({"error": message, "category": "user" if user else "server"}).encode())
