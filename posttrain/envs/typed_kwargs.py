"""A task's or environment's keyword arguments checked against its signature before it is built.

``task.kwargs`` and ``env.kwargs`` arrive from YAML or the command line as plain values. Passed straight
to a dataclass or factory, a wrong type went through unchecked: ``on_topic: "no"`` is a non-empty
string, so truthy, and switched the option *on*; ``train_max_constraints: 2.5`` slipped past every
``<=`` check; ``digits: 2.5`` failed deep inside the calculator environment's first draw.
:func:`build_with_typed_kwargs` validates them with the typed model the algorithm registries use for
``loss.kwargs`` and ``credit.kwargs`` (:func:`posttrain.algos.hyperparameters.validated_factory_kwargs`:
the signature is the schema, scalars strict, unknown keys refused with the valid ones listed) and builds
from the validated values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from posttrain.algos.hyperparameters import validated_factory_kwargs

T = TypeVar("T")


def build_with_typed_kwargs(factory: Callable[..., T], kwargs: Mapping[str, object], *, what: str,
                            key: str = "task.kwargs") -> T:
    """``factory(**kwargs)`` with ``kwargs`` validated against ``factory``'s signature first.

    Contract: a value that does not fit its parameter's annotation, or a key the factory does not take
    (unless it takes ``**kwargs``), raises ``ValueError``, one line naming ``<key>.<name>``, the value
    and the expected type; otherwise ``factory`` is called with the validated values (a YAML list for
    a ``tuple[str, ...]`` becomes a tuple, an ``int`` for a ``float`` a float). ``what`` names the
    factory in the message (``task 'chain_sum'``).
    """
    return factory(**validated_factory_kwargs(factory, kwargs, key=key, what=what))
