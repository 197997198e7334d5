"""How the driver reaches its learner ranks: the :class:`RankTransport` protocol and the spawned-process one.

:class:`~posttrain.learner.ranks.LearnerRanks` drives ``world_size`` ranks through a transport: it
sends each rank pickled commands and waits for their replies; every rank runs
:func:`~posttrain.learner.rank_process.rank_main`'s command loop unchanged. Two transports meet the
protocol:

- :class:`SpawnedRanks` (here, the default): ``torch.multiprocessing`` spawn on the driver's machine,
  one pipe per rank, the process group over 127.0.0.1;
- ``RayRanks`` (:mod:`posttrain.loop.backends.ray_learner`, ``system.backend=ray``): one Ray actor
  per rank in a placement group, possibly on other nodes; the group forms at the rank-0 actor's node
  address.

A :data:`StartRanks` callable builds a transport from ``(world_size, spec_bytes)`` (the pickled
:class:`~posttrain.learner.rank_process.RankSpec`) once the ranks are launched; the first message of
every rank is its ``start`` reply.

Weight buckets (``("bucket", WeightBucket)`` messages of rank 0 after an update) reach the driver
through every transport. A transport may also *publish* them where other processes can fetch them
(``RayRanks`` with ``system.ray.weight_sync=direct``: Ray's object store, written by the rank's
actor); :meth:`RankTransport.published` hands out those references, which the engines load without
the driver forwarding the bytes.

Over any transport one command goes to every rank with :func:`send_all` and its replies come back with
:func:`collect_replies` (waiting in 0.5 s slices, checking the ranks in between; a failing, ended or
silent rank is a one-line :class:`LearnerRankError` naming it).
"""

from __future__ import annotations

import pickle
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from posttrain.learner.distributed import free_port
from posttrain.learner.rank_process import WeightBucket, rank_main
from posttrain.rollout.weight_transfer import PublishedBucket

_POLL_S = 0.5  # liveness check interval while waiting for ranks

RankMessage = tuple[str, object]
"""One decoded rank message: ``(status, value)``, status ``ok`` / ``error`` / ``bucket``."""


class RankTransport(Protocol):
    """The driver's link to launched learner ranks (a command goes as pickled ``bytes``, a reply comes
    back as a decoded :data:`RankMessage`)."""

    world_size: int

    def send(self, rank: int, payload: bytes) -> None:
        """Deliver ``payload`` to ``rank`` in order; raises ``OSError`` when the rank is gone."""
        ...

    def ready(self, ranks: Sequence[int], timeout_s: float) -> list[int]:
        """Those of ``ranks`` with a message (or an end: :meth:`recv` then raises) waiting; blocks at
        most ``timeout_s`` for the first."""
        ...

    def recv(self, rank: int) -> RankMessage:
        """The next message of a :meth:`ready` rank; raises ``EOFError`` when the rank is gone."""
        ...

    def published(self, version: int) -> list[PublishedBucket]:
        """The weight buckets of ``version`` this transport published, in bucket order (empty when it
        publishes none, or holds another version's)."""
        ...

    def exit_reason(self, rank: int) -> str | None:
        """None while ``rank`` runs, else why it ended (one line, e.g. ``killed by SIGKILL``)."""
        ...

    def where(self) -> Mapping[int, str]:
        """Where each rank runs: ``{rank: "node <id> (<ip>)"}`` or ``{rank: "this machine"}``."""
        ...

    def close(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the ranks to end (after their ``close`` command), then kill what
        is left and release everything; idempotent."""
        ...


StartRanks = Callable[[int, bytes], RankTransport]
"""``(world_size, spec_bytes) -> transport``: launches the ranks (see the module docstring)."""


def exit_code_reason(code: int | None) -> str | None:
    """A process exit code in words: None (still running), ``exit code N`` or ``killed by SIGNAME``."""
    if code is None:
        return None
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class SpawnedRanks:
    """``world_size`` rank processes on this machine (spawn, one pipe each, group on 127.0.0.1)."""

    def __init__(self, world_size: int, spec_bytes: bytes) -> None:
        import multiprocessing as mp

        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            for r in range(world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=rank_main, args=(r, world_size, port, child, spec_bytes),
                                name=f"posttrain-learner-rank-{r}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        except BaseException:
            self.close(0.0)
            raise

    def send(self, rank: int, payload: bytes) -> None:
        """See :meth:`RankTransport.send`."""
        self.conns[rank].send_bytes(payload)

    def ready(self, ranks: Sequence[int], timeout_s: float) -> list[int]:
        """See :meth:`RankTransport.ready` (``multiprocessing.connection.wait`` over the pipes)."""
        from multiprocessing.connection import wait

        index = {id(self.conns[r]): r for r in ranks}
        return [index[id(c)] for c in wait([self.conns[r] for r in ranks], timeout=timeout_s)]

    def recv(self, rank: int) -> RankMessage:
        """See :meth:`RankTransport.recv` (a dead rank's pipe ends: ``EOFError`` or ``OSError``)."""
        try:
            raw = self.conns[rank].recv_bytes()
        except (EOFError, OSError) as e:
            self.procs[rank].join(1.0)  # so that exit_reason knows how it ended
            raise EOFError(str(e)) from e
        msg: RankMessage = pickle.loads(raw)
        return msg

    def published(self, version: int) -> list[PublishedBucket]:
        """Nothing: the buckets travel over the pipes to the driver only."""
        return []

    def exit_reason(self, rank: int) -> str | None:
        """See :meth:`RankTransport.exit_reason`."""
        return exit_code_reason(self.procs[rank].exitcode)

    def where(self) -> Mapping[int, str]:
        """Every rank runs on the driver's machine."""
        return {r: "this machine" for r in range(len(self.procs))}

    def close(self, grace_s: float) -> None:
        """See :meth:`RankTransport.close`."""
        end = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


# ---------------------------------------------------------------------- one command, every rank
class LearnerRankError(RuntimeError):
    """A learner rank died, failed or stayed silent; the message names the rank(s)."""


def rank_exit_reason(t: RankTransport, rank: int) -> str:
    """Why ``rank`` ended (``still running`` when it did not), with where it ran when not on this machine."""
    reason = t.exit_reason(rank) or "still running"
    where = t.where().get(rank, "")
    return reason if where == "this machine" or not where else f"{reason}; on {where}"


def send_all(t: RankTransport, cmd: str, args: tuple[object, ...]) -> None:
    """Send ``(cmd, args)`` (pickled once) to every rank; :class:`LearnerRankError` naming a rank that is gone."""
    payload = pickle.dumps((cmd, args))
    for r in range(t.world_size):
        try:
            t.send(r, payload)
        except OSError:
            raise LearnerRankError(f"learner rank {r} is gone ({rank_exit_reason(t, r)}) before {cmd}") from None


def collect_replies(t: RankTransport, cmd: str, timeout_s: float,
                    on_bucket: Callable[[WeightBucket], None] | None = None) -> list[Any]:
    """Every rank's reply to ``cmd``, in rank order, waiting in ``_POLL_S`` slices and checking the ranks in
    between. Rank 0's ``bucket`` messages meanwhile go to ``on_bucket`` (a bucket it refuses fails the call).
    :class:`LearnerRankError` (one line, naming the rank) when a rank reports an error, ends, or stays silent
    past ``timeout_s``; the caller then kills the ranks."""
    n = t.world_size
    replies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(replies) < n:
        for r in t.ready([r for r in range(n) if r not in replies], _POLL_S):
            try:
                status, value = t.recv(r)
            except EOFError:
                raise LearnerRankError(f"learner rank {r} died during {cmd} ({rank_exit_reason(t, r)})") from None
            if status == "bucket" and r == 0 and on_bucket is not None:
                try:
                    if not isinstance(value, WeightBucket):
                        raise TypeError(f"a bucket message holds a {type(value).__name__}")
                    on_bucket(value)
                except Exception as e:  # noqa: BLE001 - a bad bucket ends the run (the driver copy is half-loaded)
                    raise LearnerRankError(f"learner rank 0 sent a bad weight bucket during {cmd}: "
                                           f"{type(e).__name__}: {e}".splitlines()[0][:500]) from None
                continue
            if status != "ok":
                raise LearnerRankError(f"learner rank {r} failed during {cmd}: {value}")
            replies[r] = value
        for r in range(n):
            if r not in replies and t.exit_reason(r) is not None:
                raise LearnerRankError(f"learner rank {r} died during {cmd} ({rank_exit_reason(t, r)})")
        if time.monotonic() > deadline and len(replies) < n:
            silent = sorted(set(range(n)) - set(replies))
            raise LearnerRankError(f"learner rank(s) {silent} did not answer {cmd} within {timeout_s:g}s "
                                   "(learner.rank_timeout_s)")
    return [replies[r] for r in range(n)]


__all__ = ["LearnerRankError", "RankMessage", "RankTransport", "SpawnedRanks", "StartRanks", "collect_replies",
           "exit_code_reason", "rank_exit_reason", "send_all"]
