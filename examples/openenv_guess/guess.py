"""An environment written to OpenEnv's interface, trained by posttrain in-process (docs/openenv.md):
the task names a letter; an answer starting with it earns reward 1 and ends
the episode, a wrong first answer gets a hint and a second try."""

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typed against the restatement (the package ships no type information)
    from examples.openenv_guess._interface import Action, Environment, Observation, State
else:
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation, State
    except ImportError:  # openenv is not installed: the same interface, restated
        from examples.openenv_guess._interface import Action, Environment, Observation, State

LETTERS = "abcdefghij"


class GuessAction(Action):
    """What the policy writes."""

    text: str


class GuessObservation(Observation):
    """What the policy reads."""

    prompt: str


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Say a letter: reward 1 when the answer starts with it; ``tries`` answers per episode."""

    def __init__(self, tries: int = 2) -> None:
        super().__init__()
        self.tries = tries
        self._state = State()
        self.letter = "a"

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        """A new letter from ``seed``."""
        self.letter = random.Random(seed).choice(LETTERS)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"say {self.letter}")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        """Reward 1 and done if the answer starts with the letter; else a hint, done after the last try."""
        self._state.step_count += 1
        if action.text.strip().startswith(self.letter):
            return GuessObservation(prompt="right", done=True, reward=1.0)
        last = self._state.step_count >= self.tries
        return GuessObservation(prompt=f"no: say {self.letter}", done=last, reward=0.0 if last else None)

    @property
    def state(self) -> State:
        """Episode id and step count."""
        return self._state
