"""The verifier's answer about one response: an honest status, raw components, an audit note."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from posttrain.trajectory import Status


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one response.

    ``status`` is one of :class:`~posttrain.trajectory.Status`. ``components`` are raw,
    *unweighted* reward components (``{"task": 1.0, "format": 1.0}``); weighting happens once, in
    :func:`posttrain.rewards.compose`. An ``infra_error`` verdict carries no components: the
    trajectory gets no reward at all (never a zero). ``explanation`` is a short human-readable
    reason kept in the ledger for audits.
    """

    status: Status
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    explanation: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "components", dict(self.components))
        for k, v in self.components.items():
            if not isinstance(k, str) or not math.isfinite(float(v)):
                raise ValueError(f"Verdict: component {k!r} must be a str name with a finite value, got {v!r}")
        if self.status is Status.INFRA_ERROR and self.components:
            raise ValueError("Verdict: an infra_error verdict carries no reward components (never a zero reward)")

    @property
    def correct(self) -> bool:
        """``status is CORRECT``."""
        return self.status is Status.CORRECT


def infra_error(explanation: str) -> Verdict:
    """An ``infra_error`` verdict: the verifier or its machinery failed, not the response."""
    return Verdict(status=Status.INFRA_ERROR, components={}, explanation=explanation)


def graded(ok: bool, explanation: str = "", *, extra: Mapping[str, float] | None = None,
           status_if_wrong: Status = Status.WRONG) -> Verdict:
    """``CORRECT`` with ``task = 1`` if ``ok`` else ``status_if_wrong`` with ``task = 0``."""
    comps = {"task": 1.0 if ok else 0.0, **(extra or {})}
    return Verdict(status=Status.CORRECT if ok else status_if_wrong, components=comps, explanation=explanation)
