"""Name -> function registries that recipes select from YAML.

A registry is a plain ``dict`` (so ``sorted(ADVANTAGES)`` lists the names) that refuses a
second registration under a taken name and answers an unknown name with the valid ones.
Pattern after verl's ``register_adv_est`` / ``get_policy_loss_fn``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from posttrain.algos.hyperparameters import kwargs_model, validated_kwargs
from posttrain.dotted import import_dotted

F = TypeVar("F", bound=Callable[..., Any])


class Registry(dict[str, Callable[..., Any]]):
    """A named mapping of string keys to pure functions.

    ``register(name)`` is a decorator; ``get(name)`` (or ``[name]``) raises ``KeyError`` naming
    the registry and listing every valid key when ``name`` is unknown. Every function takes
    ``data_args`` positional data arguments first; its other keywords, except the ``supplied`` ones
    the framework fills at run time, are its hyper-parameters (:meth:`kwargs_model`).
    """

    def __init__(self, kind: str, *, data_args: int = 1, supplied: Collection[str] = ()) -> None:
        super().__init__()
        self.kind = kind
        self.data_args = data_args
        self.supplied = frozenset(supplied)
        self._needs: dict[str, frozenset[str]] = {}
        self._models: dict[str, type[BaseModel]] = {}

    def register(self, name: str, *, needs: Collection[str] = ()) -> Callable[[F], F]:
        """Register ``fn`` under ``name``; a taken name is a ``ValueError``.

        ``needs`` declares what the entry's inputs require of the run, in the vocabulary of
        :data:`NEEDS` (e.g. ``{"critic"}`` for GAE), so a recipe that cannot fill them is refused
        at config load rather than failing at step 1 (:meth:`needs`).
        """
        unknown = sorted(set(needs) - set(NEEDS))
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown need(s) {unknown}; valid: {', '.join(NEEDS)}")

        def deco(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self[name].__module__})")
            super(Registry, self).__setitem__(name, fn)
            self._needs[name] = frozenset(needs)
            return fn

        return deco

    def resolve(self, name: str, *, key: str) -> str:
        """Make ``name`` usable: a registered name, or ``'package.module:function'`` imported now and
        registered under that very string (so every ``self[name]`` of the run finds it).

        The function must take the registry's data arguments positionally first (the inputs
        dataclass for estimators and losses; its keywords are typed by :meth:`kwargs_model`); an
        optional ``needs`` attribute (a collection of :data:`NEEDS` names) declares its needs.
        Raises ``ValueError`` naming ``key`` (one line).
        """
        if name in self:
            return name
        if ":" not in name:
            raise ValueError(f"{key}: unknown {self.kind} {name!r}; valid: {', '.join(sorted(self))}, "
                             "or 'package.module:function'")
        fn = import_dotted(name, what=key)
        if not callable(fn):
            raise ValueError(f"{key}: {name!r} is a {type(fn).__name__}, not a function")
        params = list(inspect.signature(fn).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD,
                                                params[0].VAR_POSITIONAL):
            raise ValueError(f"{key}: {name!r}{inspect.signature(fn)} must take the {self.kind}'s inputs as its "
                             "first positional argument")
        needs = getattr(fn, "needs", ())
        if isinstance(needs, str) or not all(n in NEEDS for n in needs):
            raise ValueError(f"{key}: {name!r}.needs={needs!r} must be a list of: {', '.join(NEEDS)}")
        self.register(name, needs=needs)(fn)
        return name

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a ``KeyError`` if absent); e.g. a test dropping the plug-ins it resolved."""
        self[name]  # noqa: B018 - raises KeyError listing the valid names
        super().pop(name)
        self._needs.pop(name, None)
        self._models.pop(name, None)

    def needs(self, name: str) -> frozenset[str]:
        """What entry ``name`` declared it needs (see :data:`NEEDS`); unknown names raise like ``[name]``."""
        self[name]  # noqa: B018 - raises KeyError listing the valid names
        return self._needs.get(name, frozenset())

    def __setitem__(self, key: str, value: Callable[..., Any]) -> None:
        raise TypeError(f"use {self.kind} registry .register({key!r}) instead of item assignment")

    def __missing__(self, key: str) -> Callable[..., Any]:
        raise KeyError(f"unknown {self.kind} {key!r}; valid: {', '.join(sorted(self))}")

    def kwargs_model(self, name: str) -> type[BaseModel]:
        """The pydantic model of ``self[name]``'s hyper-parameters, derived once from its signature
        (:func:`posttrain.algos.hyperparameters.kwargs_model`: the keywords after the registry's
        ``data_args``, less its ``supplied`` ones, with their annotations and defaults)."""
        if name not in self._models:
            self._models[name] = kwargs_model(self[name], title=f"{self.kind} {name}", data_args=self.data_args,
                                              supplied=self.supplied)
        return self._models[name]

    def validate_kwargs(self, name: str, kwargs: Mapping[str, object], *, key: str) -> dict[str, object]:
        """``kwargs`` for ``self[name]`` validated by :meth:`kwargs_model`: the keys given, with the typed
        values the function is to be called with. Raises ``ValueError``, one line naming each bad key
        under ``key`` (an unknown keyword, a missing required one, a value of the wrong type)."""
        return validated_kwargs(self.kwargs_model(name), kwargs, key=key, what=f"{self.kind} {name!r}")

    def get(self, key: str, default: Any = None) -> Callable[..., Any]:
        """Like ``self[key]``: unknown names raise, they never return a silent default."""
        if default is not None:
            raise TypeError("Registry.get takes no default: an unknown name is an error")
        return self[key]


NEEDS: dict[str, str] = {
    "critic": "per-token values V(s_t) from a learned critic",
    "groups>=2": "groups of >= 2 samples of the same prompt (group_index)",
    "baseline": "a per-row baseline reward (ReMax: the reward of a greedy rollout of the prompt)",
    "step_ids": "per-token step ids, step anchors and step rewards of multi-turn episodes",
}
"""The vocabulary of ``Registry.register(..., needs=...)``: name -> what the run must provide."""

ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator", data_args=2)
REDUCTIONS = Registry("loss reduction", supplied=("num_sequences", "num_tokens"))
# The learner passes the versions to a correction itself (posttrain/learner/actor.py).
CORRECTIONS = Registry("behavior correction", data_args=3, supplied=("behavior_version", "current_version"))
PREFERENCE_LOSSES = Registry("preference loss", data_args=4,
                             supplied=("chosen_lengths", "rejected_lengths", "score_diff",
                                       "margin_rtol"))
