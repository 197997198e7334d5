"""OpenEnv's environment interface (``openenv`` 0.10.0, ``openenv.core.env_server``), restated for
when the package is not installed: pydantic ``Action`` / ``Observation`` / ``State`` with the same
base fields, and the abstract ``Environment[ActT, ObsT, StateT]`` with ``reset`` / ``step`` / ``state``."""

from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class Action(BaseModel):
    """Base of every action."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Observation(BaseModel):
    """Base of every observation: ``done``, ``reward`` (None: no reward signal), ``metadata``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    done: bool = False
    reward: bool | int | float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class State(BaseModel):
    """Internal state of an environment."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    episode_id: str | None = None
    step_count: int = Field(default=0, ge=0)


ActT = TypeVar("ActT", bound=Action)
ObsT = TypeVar("ObsT", bound=Observation)
StateT = TypeVar("StateT", bound=State)


class Environment(ABC, Generic[ActT, ObsT, StateT]):
    """Gym-style environment: ``reset`` and ``step`` return observations."""

    @abstractmethod
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ObsT:
        """Start an episode."""

    @abstractmethod
    def step(self, action: ActT, timeout_s: float | None = None, **kwargs: Any) -> ObsT:
        """Apply one action."""

    @property
    @abstractmethod
    def state(self) -> StateT:
        """The current state."""
