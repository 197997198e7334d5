"""A task's or environment's keyword arguments checked against its signature before it is built.

``task.kwargs`` and ``env.kwargs`` arrive from YAML or the command line as plain values. Passed straight
to a dataclass or factory, a wrong type went through unchecked: ``on_topic: "no"`` is a non-empty
string, so truthy, and switched the option *on*; ``train_max_constraints: 2.5`` slipped past every
``<=`` check; ``digits: 2.5`` failed deep inside the calculator environment's first draw.
:func:`build_with_typed_kwargs` validates them with the same typed model the algorithm registries use
for ``loss.kwargs`` and ``credit.kwargs`` (:func:`posttrain.algos.hyperparameters.kwargs_model`: the
signature is the schema, scalars strict, unknown keys refused with the valid ones listed) and builds
from the validated values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TypeVar

from pydantic import BaseModel

from posttrain.algos.hyperparameters import kwargs_model, validated_kwargs

T = TypeVar("T")


@functools.cache
def _model(factory: Callable[..., object]) -> type[BaseModel]:
    """The typed model of ``factory``'s keywords (a dataclass: its ``__init__``), built once."""
    return kwargs_model(factory, title=f"{getattr(factory, '__name__', 'factory')}_kwargs", data_args=0)


def build_with_typed_kwargs(factory: Callable[..., T], kwargs: Mapping[str, object], *, key: str = "task.kwargs",
                            what: str | None = None) -> T:
    """``factory(**kwargs)`` with ``kwargs`` validated against ``factory``'s signature first.

    Contract: a value that does not fit its parameter's annotation, or a key the factory does not take
    (unless it takes ``**kwargs``), raises ``ValueError``, one line naming ``<key>.<name>``, the value
    and the expected type; otherwise ``factory`` is called with the validated values (a YAML list for
    a ``tuple[str, ...]`` becomes a tuple, an ``int`` for a ``float`` a float). ``what`` names the
    factory in the message (default: ``task 'ClassName'``).
    """
    return factory(**validated_factory_kwargs(factory, kwargs, key=key, what=what))


def validated_factory_kwargs(factory: Callable[..., object], kwargs: Mapping[str, object], *,
                             key: str = "task.kwargs", what: str | None = None) -> dict[str, object]:
    """``kwargs`` validated against ``factory``'s signature (:func:`build_with_typed_kwargs`'s contract,
    without the call): the keys given, with their typed values."""
    label = what or f"task {getattr(factory, '__name__', factory)!r}"
    return validated_kwargs(_model(factory), kwargs, key=key, what=label)
