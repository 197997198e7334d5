"""The body of one rollout worker and one reward worker, free of Ray (Ray actors wrap these).

:class:`RolloutWorker` owns one engine. It loads weights only from a verified
:class:`~posttrain.rollout.weight_transfer.WeightPacket` and refuses to generate under a version
other than the one the driver asks for (:meth:`RolloutWorker.ensure_version`): a worker that was
restarted (and rebuilt its engine from the factory, version 0) pulls the latest packet before it
samples a single token, so no completion is ever recorded under a wrong version.

Test hook (fault injection): ``crash_marker`` names a file. While it exists and holds a positive
integer ``k``, a ``generate`` call decrements it (removing it at 0), generates the first half of
its requests for real, then ends the process with ``os._exit`` — a worker dying mid-generation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from posttrain.rewards.pool import Item, run_one
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.rollout.weight_transfer import WeightPacket, WeightTransferError, buckets_identity

if TYPE_CHECKING:
    import torch

CRASH_EXIT_CODE = 17


def _take_crash(marker: str | None) -> bool:
    """Consume one crash from the marker file (see the module docstring)."""
    if not marker or not os.path.exists(marker):
        return False
    try:
        with open(marker) as f:
            k = int(f.read().strip() or "1")
    except (OSError, ValueError):
        return False
    if k <= 1:
        os.remove(marker)
    else:
        with open(marker, "w") as f:
            f.write(str(k - 1))
    return k >= 1


class RolloutWorker:
    """One engine plus verified weight loading (see the module docstring).

    ``engine_factory()`` builds the engine (called once per process, again after a restart).
    """

    def __init__(self, engine_factory: Callable[[], RolloutEngine], name: str, crash_marker: str | None = None) -> None:
        self.name = name
        self.engine: RolloutEngine = engine_factory()
        self.crash_marker = crash_marker
        self.checksum: str | None = None
        self.loads = 0

    @property
    def version(self) -> int:
        """The engine's weight version."""
        return int(self.engine.version)

    def load_packets(self, packets: Sequence[WeightPacket], version: int, checksums: Sequence[str]) -> dict[str, float]:
        """Verify every packet (one, or the buckets of one version) against the announced ``version`` and its
        ``checksums[i]``, then swap all of them into the engine at once; ``{"verify_s", "load_s"}``.

        Raises :class:`WeightTransferError` naming this worker (and the bucket, when there are several) on any
        mismatch or on a version older than the engine's, before any parameter is touched. The worker's
        checksum becomes :func:`~posttrain.rollout.weight_transfer.buckets_identity` of ``checksums``."""
        if len(packets) != len(checksums) or not packets:
            raise WeightTransferError(f"{self.name}: {len(packets)} weight packets for {len(checksums)} checksums")
        if version < self.version:
            raise WeightTransferError(f"{self.name}: refusing weights v{version}, engine already holds v{self.version}")
        t0 = time.perf_counter()
        for i, (packet, checksum) in enumerate(zip(packets, checksums, strict=True)):
            packet.verify(version=version, checksum=checksum,
                          where=self.name if len(packets) == 1 else f"{self.name} (weight bucket {i})")
        t1 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for packet in packets:  # views on the (object store's) bytes: every engine's update_weights copies them in
            tensors.update(packet.tensors(read_only_views=True))
        try:
            self.engine.update_weights(tensors, version)
        except ValueError as e:
            raise WeightTransferError(f"{self.name}: weights v{version} do not fit the engine: {e}") from e
        self.checksum = buckets_identity(checksums)
        self.loads += 1
        return {"verify_s": t1 - t0, "load_s": time.perf_counter() - t1}

    def ensure_version(self, version: int | None, checksums: Sequence[str] | None,
                       fetch: Callable[[], Sequence[WeightPacket]]) -> bool:
        """Load the latest weights (``fetch()``: their packets) when this worker holds another version; True if
        it loaded."""
        if version is None or not checksums:
            return False
        if self.version == version and self.checksum in (None, buckets_identity(checksums)):
            return False
        self.load_packets(fetch(), version, checksums)
        return True

    def generate(self, requests: Sequence[GenerationRequest], finish_target: int | None = None) -> list[Completion]:
        """``engine.generate`` (with the crash hook, see the module docstring)."""
        if _take_crash(self.crash_marker):
            half = list(requests)[: max(1, len(requests) // 2)]
            self.engine.generate(half)  # real work, never returned: the process dies mid-call
            os._exit(CRASH_EXIT_CODE)
        return self.engine.generate(requests, finish_target=finish_target)

    def pause(self) -> None:
        """``engine.pause()``."""
        self.engine.pause()

    def info(self) -> dict[str, str | int]:
        """Name, pid, version, loads (for tests and logs)."""
        return {"name": self.name, "pid": os.getpid(), "version": self.version, "loads": self.loads}


def verify_items(items: Sequence[Item], timeout_s: float | None, retries: int) -> list[tuple[Verdict, dict[str, int]]]:
    """Reward worker body: each item through :func:`~posttrain.rewards.pool.run_one`, retried ``retries`` times.

    Returns ``(verdict, counts)`` per item; a verifier that keeps raising or timing out gives an
    ``infra_error`` verdict (never a zero reward). ``timeout_s`` needs the calling thread to be the
    process's main thread (SIGALRM); elsewhere the caller's own deadline is the only bound.
    """
    out: list[tuple[Verdict, dict[str, int]]] = []
    for verifier, response, reference, context in items:
        counts = {"attempts": 0, "errors": 0, "timeouts": 0}
        verdict: Verdict | None = None
        msg = ""
        for _ in range(retries + 1):
            counts["attempts"] += 1
            kind, payload = run_one(verifier, response, reference, dict(context), timeout_s)
            if kind == "ok":
                verdict = payload
                break
            counts["timeouts" if kind == "timeout" else "errors"] += 1
            msg = str(payload)
        if verdict is None:
            verdict = infra_error(f"{msg} (after {counts['attempts']} attempt(s))")
        out.append((verdict, counts))
    return out


def main_thread_alarm_ok() -> bool:
    """Whether SIGALRM-based verifier time limits work here (main thread, POSIX)."""
    import signal
    import threading

    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


def install_alarm_handler() -> bool:
    """Install the pool's SIGALRM handler when possible; returns whether in-worker time limits are active."""
    if not main_thread_alarm_ok():
        return False
    from posttrain.rewards import pool

    pool._worker_init()
    return True


def merge_counts(total: dict[str, float], counts: Mapping[str, int], prefix: str = "") -> None:
    """``total[prefix + k] += v`` for every count."""
    for k, v in counts.items():
        total[prefix + k] = total.get(prefix + k, 0.0) + float(v)
