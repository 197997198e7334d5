"""The verifier protocol and the ``VERIFIERS`` registry of verifier factories.

A verifier is any object with ``name``, ``version`` and ``verify(response, reference, **context)
-> Verdict``. The ledger records ``name@version`` with every trajectory, so bump ``version``
whenever the verdict of some response could change. Verifiers must be picklable (they are sent to
:class:`~posttrain.rewards.pool.VerifierPool` workers): plain dataclasses are.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from posttrain.algos.registry import Registry
from posttrain.rewards.verdict import Verdict

VERIFIERS = Registry("verifier")
"""name -> factory(**kwargs) returning a :class:`Verifier`."""


@runtime_checkable
class Verifier(Protocol):
    """Checks one response against a reference; never raises for a bad *response*.

    A malformed response is ``invalid`` / ``wrong``; an exception escaping ``verify`` means the
    verifier itself failed and is recorded as ``infra_error`` by the caller. ``name`` and
    ``version`` are read-only here, so plain attributes, frozen dataclass fields and properties
    all satisfy the protocol.
    """

    @property
    def name(self) -> str:
        """Verifier name (registry name by convention)."""
        ...

    @property
    def version(self) -> str:
        """Bumped whenever the verdict of some response could change."""
        ...

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """Verdict of ``response`` against ``reference``."""
        ...


def build_verifier(name: str, **kwargs: Any) -> Verifier:
    """``VERIFIERS[name](**kwargs)``; an unknown name lists the valid ones."""
    import posttrain.rewards  # noqa: F401 - registers the built-in verifiers

    v: Verifier = VERIFIERS[name](**kwargs)
    return v


def verifier_id(v: Verifier) -> str:
    """``"name@version"`` as stored in the ledger."""
    return f"{v.name}@{v.version}"
