"""Typed models of a registered function's keyword hyper-parameters, derived from its signature.

A registry function takes its data positionally first (an inputs dataclass, tensors) and its
hyper-parameters as annotated keywords with defaults, e.g. ``ppo_clip(inputs, *, eps_low: float = 0.2,
eps_high: float = 0.2, dual_clip: float | None = None)``. :func:`kwargs_model` turns the keywords into a
pydantic model (names, annotations, defaults; an unknown key is an error unless the function takes
``**kwargs``), so a new algorithm needs no hand-written model: its signature is its schema.
:func:`validated_kwargs` checks a recipe's ``kwargs`` against it and returns the typed values the
function is then called with (an ``int`` given for a ``float`` parameter becomes a ``float``).

Scalars are strict: a string is not a number (YAML reads ``1e-6`` as text; ``1.0e-6`` is a number),
a number is not a bool, a float is not an int. Containers (``tuple[float, float]``) take YAML lists.
An unannotated parameter, or one whose annotation names what its module defines only for type
checkers, accepts any value.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

_SCALARS: tuple[object, ...] = (bool, int, float, str, type(None))


def _tunable_parameters(fn: Callable[..., object], *, data_args: int,
                       supplied: Collection[str] = ()) -> list[inspect.Parameter]:
    """The parameters of ``fn`` a recipe may set: every keyword-capable parameter after the first
    ``data_args`` positional ones (the data the framework passes), except those named in ``supplied``
    (keywords the framework fills at run time, e.g. a correction's ``current_version``)."""
    params = list(inspect.signature(fn).parameters.values())
    return [p for i, p in enumerate(params)
            if (p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and i >= data_args))
            and p.name not in supplied]


def kwargs_model(fn: Callable[..., object], *, title: str, data_args: int,
                 supplied: Collection[str] = ()) -> type[BaseModel]:
    """A pydantic model of ``fn``'s hyper-parameters (:func:`_tunable_parameters`): one field per
    parameter with its resolved annotation (``Any`` when absent or unresolvable) and its default
    (required when it has none); extra keys are forbidden unless ``fn`` takes ``**kwargs``."""
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    fields: dict[str, Any] = {}
    for p in _tunable_parameters(fn, data_args=data_args, supplied=supplied):
        ann = _annotation(fn, p)
        default = ... if p.default is p.empty else p.default
        fields[p.name] = (ann, Field(default, strict=True) if _is_scalar(ann) else Field(default))
    config = ConfigDict(extra="allow" if takes_any else "forbid", arbitrary_types_allowed=True,
                        protected_namespaces=())
    model: type[BaseModel] = create_model(title, __config__=config, **fields)
    return model


def validated_kwargs(model: type[BaseModel], kwargs: Mapping[str, object], *, key: str,
                     what: str) -> dict[str, object]:
    """``kwargs`` validated by ``model`` (from :func:`kwargs_model`): the keys given, in their order, with
    their typed values (defaults are left to the function). Raises ``ValueError``, one line naming each
    bad key under ``key`` (``loss.kwargs.eps_low: ...``); ``what`` names the function (``policy loss
    'ppo_clip'``)."""
    try:
        m = model.model_validate(dict(kwargs))
    except ValidationError as e:
        raise ValueError(_message(model, e, key=key, what=what)) from None
    extra = m.model_extra or {}
    return {k: extra[k] if k in extra else getattr(m, k) for k in kwargs}


@functools.cache
def _factory_model(factory: Callable[..., object]) -> type[BaseModel]:
    """The typed model of ``factory``'s keywords (a class: its ``__init__``'s), built once per factory."""
    return kwargs_model(factory, title=f"{getattr(factory, '__name__', 'factory')}_kwargs", data_args=0)


def validated_factory_kwargs(factory: Callable[..., object], kwargs: Mapping[str, object], *, key: str,
                             what: str) -> dict[str, object]:
    """``kwargs`` of a factory whose every parameter is configurable (a task, an environment, a
    verifier; no data arguments) validated against its signature: :func:`validated_kwargs` over
    :func:`kwargs_model` ``(factory, data_args=0)``, the model cached per factory. A ``factory`` without
    a signature to read (not callable, a builtin without one) gets ``kwargs`` back unchanged: calling it
    gives the error."""
    try:
        hash(factory)
        cached = True
    except TypeError:  # a callable instance without __hash__: built each time
        cached = False
    try:
        model = _factory_model(factory) if cached else _factory_model.__wrapped__(factory)
    except (TypeError, ValueError):  # inspect.signature: not callable, or no signature to read
        return dict(kwargs)
    return validated_kwargs(model, kwargs, key=key, what=what)


def _message(model: type[BaseModel], e: ValidationError, *, key: str, what: str) -> str:
    """One line for all of ``e``'s errors: unknown keys, then the missing ones, then wrong values."""
    errors = e.errors()
    unknown = [str(x["loc"][0]) for x in errors if x["type"] == "extra_forbidden"]
    missing = [str(x["loc"][0]) for x in errors if x["type"] == "missing"]
    valid = ", ".join(model.model_fields) or "none"
    lines = [f"{key}.{k}: unknown keyword of {what} (valid: {valid})" for k in unknown]
    if missing:
        lines.append(f"{key}: {what} needs {', '.join(missing)}")
    for x in errors:
        if x["type"] in ("extra_forbidden", "missing"):
            continue
        name = str(x["loc"][0])
        got = x["input"]
        hint = " (text, not a number: write it unquoted; YAML reads 1e-6 as text, 1.0e-6 as a number)" \
            if isinstance(got, str) and _is_number(got) else ""
        ann = model.model_fields[name].annotation
        lines.append(f"{key}.{name}: {x['msg']}, got {got!r}{hint} ({what} takes {name}: {_type_name(ann)})")
    return "; ".join(dict.fromkeys(lines))  # a union reports each member's mismatch: one line per key


def _annotation(fn: Callable[..., object], p: inspect.Parameter) -> object:
    """``p``'s annotation resolved in ``fn``'s module (string annotations included); ``Any`` when it
    is absent or names what the module does not define at run time (an import under TYPE_CHECKING)."""
    if p.annotation is p.empty:
        return Any
    if not isinstance(p.annotation, str):
        ann: object = p.annotation
        return ann
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    namespace = getattr(fn, "__globals__", None) or (vars(module) if module is not None else {})
    holder = types.SimpleNamespace(__annotations__={p.name: p.annotation})
    try:
        return typing.get_type_hints(holder, globalns=namespace)[p.name]
    except NameError:
        return Any


def _is_scalar(ann: object) -> bool:
    """True when every member of ``ann`` (a union's, or ``ann`` itself) is ``bool``, ``int``, ``float``,
    ``str`` or ``None``: such a field is strict (a ``Literal`` matches its values exactly anyway)."""
    members = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union \
        else (ann,)
    return all(a in _SCALARS for a in members)


def _type_name(ann: object) -> str:
    return inspect.formatannotation(ann).replace("typing.", "")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
