"""OpenEnv environments as posttrain environments, in-process (no Docker, no Space, no HTTP).

An OpenEnv ``Environment`` (the ``openenv`` package, 0.10.0: ``openenv.core.env_server.interfaces``)
has ``reset(seed=..., episode_id=...) -> Observation`` and ``step(action) -> Observation``, where
``Action`` and ``Observation`` are pydantic models and the observation carries ``done`` and
``reward``. :class:`OpenEnvAdapter` maps that onto :class:`~posttrain.envs.multiturn.Environment`:

- ``reset(seed)`` -> the observation rendered as text (the first user turn);
- ``step(text)``  -> the policy turn's text becomes ``Action(**{action_field: text})``; the
  observation's ``reward`` (None counts 0) is the reward part ``task`` of that step (summed over the
  episode, as OpenEnv's per-step rewards are), ``done`` ends the episode.

An observation is rendered as its ``observation_field`` (default: its only text field besides
``metadata``), else as JSON of its fields without ``done`` / ``reward`` / ``metadata``. The action
class is the environment's ``Environment[ActT, ...]`` type argument unless ``action`` names one.
Nothing here imports ``openenv``: the adapter reads the interface (duck typing), so an environment
written to it runs with or without the package installed.

A recipe selects it with ``env.name: posttrain.envs.openenv_adapter:openenv`` and
``env.kwargs: {env: "package.module:EnvClass", env_kwargs: {...}}`` (docs/openenv.md).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from typing import Any, Protocol

from pydantic import BaseModel

from posttrain.dotted import import_dotted
from posttrain.envs.multiturn import StepResult
from posttrain.errors import ConfigError

_BASE_OBS_FIELDS = ("done", "reward", "metadata")


class OpenEnvLike(Protocol):
    """The part of OpenEnv's ``Environment`` the adapter uses."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> BaseModel: ...

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> BaseModel: ...


def action_class_of(env_cls: type) -> type[BaseModel] | None:
    """``ActT`` of a class deriving from ``Environment[ActT, ObsT, StateT]`` (searched along the MRO), or None."""
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                return args[0]
    return None


def _text_fields(model: type[BaseModel], skip: tuple[str, ...]) -> list[str]:
    return [n for n, f in model.model_fields.items() if n not in skip and f.annotation is str]


class OpenEnvAdapter:
    """One OpenEnv environment instance seen as a posttrain :class:`~posttrain.envs.multiturn.Environment`."""

    version = "openenv"
    reward_components = ("task",)

    def __init__(self, env: OpenEnvLike, action_cls: type[BaseModel], *, action_field: str | None = None,
                 observation_field: str | None = None, name: str | None = None) -> None:
        fields = _text_fields(action_cls, ("metadata",))
        if action_field is None:
            if len(fields) != 1:
                raise ValueError(f"openenv: {action_cls.__name__} has text fields {fields}: "
                                 "name the one the policy writes with env.kwargs.action_field")
            action_field = fields[0]
        elif action_field not in action_cls.model_fields:
            raise ValueError(f"openenv: {action_cls.__name__} has no field {action_field!r} "
                             f"(fields: {sorted(action_cls.model_fields)})")
        self.env = env
        self.action_cls = action_cls
        self.action_field = action_field
        self.observation_field = observation_field
        self.name = name or type(env).__name__

    def render(self, obs: BaseModel) -> str:
        """The observation as the text the policy reads (see the module docstring).

        Raises :class:`~posttrain.errors.ConfigError` (one line naming ``env.kwargs.observation_field`` or
        ``env.kwargs.env``, the environment and the fields the observation has) for a setting that only a real
        observation can refute: an ``observation_field`` it does not have, or an observation that is not a
        pydantic model. Preflight resets one environment to find these before the run directory is written."""
        env_cls = type(self.env)
        where = f"OpenEnv environment {self.name!r} ({env_cls.__module__}:{env_cls.__qualname__})"
        if not callable(getattr(obs, "model_dump", None)):
            raise ConfigError(f"env.kwargs.env: {where} returned a {type(obs).__name__}, not a pydantic "
                              "Observation (not an OpenEnv Environment)")
        data = obs.model_dump()
        if self.observation_field is not None:
            if self.observation_field not in data:
                raise ConfigError(f"env.kwargs.observation_field={self.observation_field!r}: the observation "
                                  f"of {where}, a {type(obs).__name__}, has no such field; its fields: "
                                  f"{', '.join(sorted(data))}")
            return str(data[self.observation_field])
        texts = _text_fields(type(obs), _BASE_OBS_FIELDS)
        if len(texts) == 1:
            return str(data[texts[0]])
        return json.dumps({k: v for k, v in data.items() if k not in _BASE_OBS_FIELDS}, sort_keys=True, default=str)

    def reset(self, seed: int) -> str:
        """``env.reset(seed=seed)``, rendered."""
        return self.render(self.env.reset(seed=seed))

    def step(self, action_text: str) -> StepResult:
        """``env.step(Action(**{action_field: action_text}))``: its text, ``task`` = its reward, its ``done``."""
        obs = self.env.step(self.action_cls(**{self.action_field: action_text}))
        reward = getattr(obs, "reward", None)
        return StepResult(self.render(obs), {"task": 0.0 if reward is None else float(reward)},
                          done=bool(getattr(obs, "done", False)), info=dict(getattr(obs, "metadata", {}) or {}))


def openenv(env: str, env_kwargs: Mapping[str, Any] | None = None, action: str | None = None,
            action_field: str | None = None, observation_field: str | None = None,
            name: str | None = None) -> OpenEnvAdapter:
    """The ``env.name`` factory ``posttrain.envs.openenv_adapter:openenv``: a fresh ``env`` class
    (``'package.module:Class'``) built with ``env_kwargs``, adapted. ``action``: the Action class
    (``'package.module:Class'``) when the environment class does not declare it as its type argument;
    ``action_field`` / ``observation_field`` / ``name``: see :class:`OpenEnvAdapter`."""
    env_cls = import_dotted(env, what="openenv env", shape="package.module:Name")
    action_cls = (import_dotted(action, what="openenv action", shape="package.module:Name") if action
                  else action_class_of(env_cls))
    if action_cls is None:
        raise ValueError(f"openenv: {env} does not declare its Action type (Environment[Action, ...]); "
                         "give env.kwargs.action: 'package.module:ActionClass'")
    instance = env_cls(**dict(env_kwargs or {}))
    for method in ("reset", "step"):
        if not callable(getattr(instance, method, None)):
            raise ValueError(f"openenv: {env} has no {method}() (not an OpenEnv Environment)")
    return OpenEnvAdapter(instance, action_cls, action_field=action_field, observation_field=observation_field,
                          name=name)
