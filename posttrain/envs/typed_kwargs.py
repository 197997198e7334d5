"""A task's keyword arguments checked against its dataclass fields before the task is built.

``task.kwargs`` arrive from YAML or the command line as plain values. Passed straight to a dataclass, a
wrong type goes through unchecked: ``on_topic: "no"`` is a non-empty string, so truthy, and switches
the option *on*; ``train_max_constraints: 2.5`` slips past every ``<=`` check. :func:`build_with_typed_kwargs`
validates each given keyword against its field's annotation with pydantic (lax mode, as the run
config's own models: ``"no"`` -> ``False``, ``"3"`` -> ``3``, ``2.5`` for an ``int`` refused) and builds
the task from the validated values, so a wrong value is refused at load, naming its key.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping

from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticSchemaGenerationError

T = typing.TypeVar("T")


@functools.cache
def _adapters(cls: type) -> dict[str, TypeAdapter[object]]:
    """One pydantic adapter per init field of dataclass ``cls`` whose annotation pydantic can check
    (fields holding objects such as a verifier have none and pass unchecked)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, TypeAdapter[object]] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        try:
            out[field.name] = TypeAdapter(hints[field.name])
        except PydanticSchemaGenerationError:
            continue
    return out


def build_with_typed_kwargs(cls: type[T], kwargs: Mapping[str, object]) -> T:
    """``cls(**kwargs)`` with each keyword first validated against ``cls``'s field annotation.

    Contract: a keyword naming no field reaches ``cls`` unchanged (its ``TypeError`` names it); a value
    that does not fit its field's type raises ``ValueError`` naming ``task.kwargs.<key>``, the value and
    the expected type; otherwise the task is built from the validated (lax-coerced) values.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"build_with_typed_kwargs needs a dataclass, got {cls!r}")
    adapters = _adapters(cls)
    typed: dict[str, object] = {}
    for key, value in kwargs.items():
        adapter = adapters.get(key)
        if adapter is None:
            typed[key] = value
            continue
        try:
            typed[key] = adapter.validate_python(value)
        except ValidationError as e:
            expected = typing.get_type_hints(cls)[key]
            reason = e.errors()[0]["msg"]
            raise ValueError(f"task.kwargs.{key}={value!r} does not fit {cls.__name__}.{key} "
                             f"({_type_name(expected)}): {reason}") from None
    return cls(**typed)


def _type_name(tp: object) -> str:
    """``int | None`` rather than ``typing.Optional[int]``; classes by their bare name."""
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
