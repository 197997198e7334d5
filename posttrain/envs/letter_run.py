"""``letter_run``: spell ``n`` consecutive letters from a start letter; ``n`` is long-tailed.

Prompt ``"k7:"`` -> answer ``"klmnopq"`` (7 letters from ``k``, wrapping ``z`` -> ``a``). The
response length *is* the problem's ``n``, drawn from a truncated power law
``P(n) = n^-alpha / sum_{m=1..max_len} m^-alpha`` on ``1..max_len``: most answers are a few
letters, a few are long. Built for the system-mode benchmark (``posttrain bench async``): under a
sync barrier every batch waits for its longest sample, which is exactly what partial and
asynchronous rollout avoid. Deterministic by ``(split, n, seed)``; verified by exact match.
"""

from __future__ import annotations

import dataclasses
import random
import string

from posttrain.envs.task import TASKS, TaskExample, sample_split
from posttrain.envs.typed_kwargs import build_with_typed_kwargs
from posttrain.rewards.basic import ExactVerifier
from posttrain.rewards.verifier import Verifier

LETTERS = string.ascii_lowercase


def run_of(start: str, n: int) -> str:
    """The ``n`` letters from ``start`` on, wrapping after ``z`` (``run_of('y', 3) == 'yza'``)."""
    i = LETTERS.index(start)
    return "".join(LETTERS[(i + k) % 26] for k in range(n))


def length_weights(max_len: int, alpha: float) -> list[float]:
    """Normalised ``P(n)`` for ``n = 1..max_len`` (index ``n - 1``): a power law with exponent ``alpha``."""
    w = [m ** -alpha for m in range(1, max_len + 1)]
    z = sum(w)
    return [x / z for x in w]


@dataclasses.dataclass(frozen=True)
class LetterRunTask:
    """Letter runs with power-law lengths (``max_len`` 1..60, ``alpha`` >= 0; 0 = uniform lengths).

    There are ``26 * max_len`` problems; ``heldout_fraction`` of them (by a hash of the problem)
    are held out. ``difficulty``, if given, sets ``max_len``.
    """

    max_len: int = 24
    alpha: float = 1.2
    heldout_fraction: float = 0.2
    difficulty: int | None = None
    verifier: Verifier = dataclasses.field(default_factory=ExactVerifier)
    name: str = "letter_run"

    def __post_init__(self) -> None:
        if self.difficulty is not None:
            object.__setattr__(self, "max_len", int(self.difficulty))
        if not 1 <= self.max_len <= 60:
            raise ValueError(f"letter_run: max_len must be in 1..60, got {self.max_len}")
        if self.alpha < 0:
            raise ValueError(f"letter_run: alpha must be >= 0, got {self.alpha}")

    def _draw(self, rng: random.Random) -> tuple[str, TaskExample]:
        start = LETTERS[rng.randrange(26)]
        n = rng.choices(range(1, self.max_len + 1), weights=length_weights(self.max_len, self.alpha))[0]
        key = f"{start}{n}"
        ans = run_of(start, n)
        ex = TaskExample(prompt_id=f"{self.name}/{key}", prompt=f"{key}:", reference=ans,
                         meta={"answer": ans, "difficulty": n})
        return key, ex

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` problems of ``split``; deterministic in ``(split, n, seed)`` and the knobs."""
        return sample_split(self.name, split, n, seed, self._draw, self.heldout_fraction,
                            rng_tag=f"{self.max_len}|{self.alpha}")


@TASKS.register("letter_run")
def letter_run(**kwargs: object) -> LetterRunTask:
    """Factory of :class:`LetterRunTask` (kwargs: ``max_len`` or ``difficulty``, ``alpha``, ``heldout_fraction``)."""
    return build_with_typed_kwargs(LetterRunTask, kwargs, what="task 'letter_run'")
