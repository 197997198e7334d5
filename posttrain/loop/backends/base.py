"""The backend interface: what the Ray backend gives the loop, and the helpers every engine call uses.

A :class:`Backend` gives the loop handles with the methods of the in-process engine and pool:

- ``rollout`` (:class:`RolloutWorkers`): a :class:`~posttrain.rollout.engine.RolloutEngine`
  (``generate`` / ``update_weights`` / ``pause`` / ``version``) spread over N workers, plus
  ``generate_detailed`` (completions *and* the requests that failed for infrastructure reasons)
  and ``broadcast_weights`` (verified transfer, see :mod:`posttrain.rollout.weight_transfer`);
- ``reward`` (:class:`RewardWorkers`, or None: the driver verifies): ``verify_batch(items) ->
  [Verdict]``, the signature of :meth:`posttrain.rewards.pool.VerifierPool.verify_batch` (so
  ``score(..., verify_batch=...)`` takes it);
- ``close()``: both, then what the backend reserved (``release``).

Exactly-once: every request given to ``generate_detailed`` ends in exactly one place — its
completions (``params.n`` for a fresh request, one for a resumed one) or one
:class:`FailedRequest` — never both, never twice. :func:`check_exactly_once` enforces it on every
call, so a backend bug surfaces as an error, not as a lost or double-counted trajectory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from posttrain.rewards.pool import Item
from posttrain.rewards.verdict import Verdict
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.types import Completion, GenerationRequest


@dataclasses.dataclass(frozen=True)
class FailedRequest:
    """A request that produced no completion: its worker died or timed out ``attempts`` times.

    The loop turns it into ``infra_error`` trajectories (reward ``None``, excluded from the update,
    counted) — never a zero reward.
    """

    request: GenerationRequest
    reason: str
    attempts: int


@dataclasses.dataclass
class RolloutResult:
    """``completions`` ordered by request then sample index (failed requests skipped), ``failed``,
    and counters (``requeued``: requests resubmitted after a worker failure; ``worker_failures``)."""

    completions: list[Completion]
    failed: list[FailedRequest]
    requeued: int = 0
    worker_failures: int = 0


class RolloutInfraError(RuntimeError):
    """Raised by ``generate`` (the plain engine protocol) when some request failed; ``result`` has the rest."""

    def __init__(self, result: RolloutResult) -> None:
        self.result = result
        reasons = "; ".join(f"{f.request.request_id}: {f.reason}" for f in result.failed[:3])
        super().__init__(f"{len(result.failed)} request(s) failed after retries ({reasons})")


def expected_completions(request: GenerationRequest) -> int:
    """Completions a request yields: 1 when resuming, else ``params.n``."""
    return 1 if request.resume is not None else int(request.params.n)


def check_exactly_once(
    requests: Sequence[GenerationRequest], completions: Sequence[Completion], failed: Sequence[FailedRequest]
) -> None:
    """Raise ``RuntimeError`` unless every request ends exactly once (see the module docstring)."""
    want = {r.request_id: expected_completions(r) for r in requests}
    if len(want) != len(requests):
        raise ValueError("generate: duplicate request_id in one call")
    got: dict[str, list[int]] = {}
    for c in completions:
        got.setdefault(c.request_id, []).append(c.sample_index)
    failed_ids = [f.request.request_id for f in failed]
    problems: list[str] = []
    if len(set(failed_ids)) != len(failed_ids):
        problems.append("a request failed twice")
    for rid, n in want.items():
        k = len(got.get(rid, []))
        if rid in failed_ids:
            if k:
                problems.append(f"{rid}: failed AND has {k} completion(s)")
        elif k != n:
            problems.append(f"{rid}: {k} completion(s), expected {n}")
        elif len(set(got[rid])) != k:
            problems.append(f"{rid}: duplicated sample index {sorted(got[rid])}")
    unknown = (set(got) | set(failed_ids)) - set(want)
    if unknown:
        problems.append(f"results for unknown requests {sorted(unknown)[:5]}")
    if problems:
        raise RuntimeError("rollout exactly-once check failed: " + "; ".join(problems[:5]))


def generate_detailed(engine: RolloutEngine, requests: Sequence[GenerationRequest], finish_target: int | None = None
                      ) -> tuple[list[Completion], list[FailedRequest]]:
    """``(completions, failed requests)`` from any engine: a worker set's ``generate_detailed`` (a
    dead worker's requests come back failed, to become ``infra_error`` samples), else the plain
    engine protocol's ``generate`` (which has no partial failures)."""
    detailed: Callable[..., RolloutResult] | None = getattr(engine, "generate_detailed", None)
    if detailed is not None:
        res = detailed(list(requests), finish_target=finish_target)
        return list(res.completions), list(res.failed)
    return list(engine.generate(list(requests), finish_target=finish_target)), []


def order_completions(requests: Sequence[GenerationRequest], completions: Sequence[Completion]) -> list[Completion]:
    """Completions sorted by their request's position, then sample index (the engine contract's order)."""
    pos = {r.request_id: i for i, r in enumerate(requests)}
    return sorted(completions, key=lambda c: (pos[c.request_id], c.sample_index))


def split_requests(requests: Sequence[GenerationRequest], parts: int) -> list[list[GenerationRequest]]:
    """Contiguous, near-equal chunks balanced by expected completions (at most ``parts``; none empty)."""
    reqs = list(requests)
    if not reqs:
        return []
    parts = max(1, min(parts, len(reqs)))
    total = sum(expected_completions(r) for r in reqs)
    out: list[list[GenerationRequest]] = [[] for _ in range(parts)]
    acc = 0
    for r in reqs:
        idx = min(parts - 1, acc * parts // max(total, 1))
        out[idx].append(r)
        acc += expected_completions(r)
    return [c for c in out if c]


@runtime_checkable
class RolloutWorkers(Protocol):
    """N rollout engines behind one engine-shaped handle (see the module docstring)."""

    version: int

    def generate(
        self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None
    ) -> list[Completion]:
        """Engine protocol: completions in order; raises :class:`RolloutInfraError` if any request failed."""
        ...

    def generate_detailed(
        self, requests: Sequence[GenerationRequest], *, finish_target: int | None = None
    ) -> RolloutResult:
        """Completions plus failed requests (each request exactly once)."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Engine protocol: same as :meth:`broadcast_weights`."""
        ...

    def broadcast_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Send weights to every worker, each verifies version + checksum; returns timing metrics."""
        ...

    def pause(self) -> None:
        """Ask every worker's running ``generate`` to return unfinished samples as paused."""
        ...

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (``rollout/...``)."""
        ...

    def close(self) -> None:
        """Release the workers."""
        ...


@runtime_checkable
class RewardWorkers(Protocol):
    """Verification spread over workers; an item whose worker fails is an ``infra_error`` verdict."""

    def verify_batch(self, items: Sequence[Item]) -> list[Verdict]:
        """One verdict per item, in order."""
        ...

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (``verify/...``)."""
        ...

    def close(self) -> None:
        """Release the workers."""
        ...


@dataclasses.dataclass
class Backend:
    """What the loop receives: ``rollout`` workers, ``reward`` workers (None: the driver verifies)
    and ``release``, run once by :meth:`close` after the parts (the Ray backend: placement groups
    and the cluster it started)."""

    rollout: RolloutWorkers
    reward: RewardWorkers | None = None
    release: Callable[[], None] | None = None
    # Where the workers run (ray_cluster.role_placement_metrics), reported once by placement_once.
    placement: dict[str, float] = dataclasses.field(default_factory=dict)

    def placement_once(self) -> dict[str, float]:
        """The workers' placement metrics the first time it is called, then ``{}`` (the run's first
        update of this process carries them, as the learner ranks' own placement)."""
        out, self.placement = self.placement, {}
        return out

    def close(self) -> None:
        """Close every part, then ``release`` (idempotent)."""
        self.rollout.close()
        if self.reward is not None:
            self.reward.close()
        release, self.release = self.release, None
        if release is not None:
            release()
